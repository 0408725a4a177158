"""Issue #26 at head dim 64 on one GPU: which Gluon tiles are fastest? The forward's K/V ring depth (GluonTile.
num_slots) with the one-tile and the persistent grid, and the backward's Q/dO ring depth (BwdTile.num_slots) with
each dQ scheme (split, per consumer, deferred), each beside SDPA's cuDNN in the same run, so that TILES[64] of
kernels/flash_gluon.py and kernels/flash_gluon_bwd.py can be set from one measurement. Written to finish in one call
of under 7 minutes on an H100, compiles included (each kernel variant compiles in ~2 s).

    python results/diagnosis/flash_gluon_d64.py [--out-dir DIR] [--rounds 5] [--only-checks]

(--out-dir defaults to $OUT; the CSV is DIR/flash_gluon_d64.csv. `--list` prints the variants and shapes and exits;
`--backward NAME ...` and `--forward-shipped-only` narrow the search, e.g. to the block_m 128 tiles of run 2.)
The variants are tile values passed to the kernels' entries (`tile=`), never an edit of TILES; the tile TILES ships
is always among them (`shipped` column). Their resources (registers, spills, shared memory) were read without a GPU:
results/diagnosis/flash_gluon_d64/*_resources.csv (`python -m cs336_systems.bench.flash_gluon_resources --d64-tiles`,
and the backward's sibling). Which candidates are timed, and why, is in kernels/NOTES.md ("d=64 tiles").

Checks first; the run stops (exit 1, nothing timed) if one fails, each with a watchdog (a barrier deadlock):
- EXACT (P = S mod 8, integer inputs: every value an exact integer), bit for bit on 3 launches, d=64, causal or
  not: each forward variant's O on 2 x 30 heads x 1500 rows (720 tiles: persistent programs walk ~5 tiles each), each
  backward variant's dQ, dK, dV on 777 queries x 1000 keys and on 4096 x 4096 causal (64 steps a program: many wraps
  of every ring depth);
- two awkward cases in float64, bf16 inputs in the model's (batch, seq, heads, dim) strides, 777 queries x 1000 keys,
  causal and not: each forward variant's O within 2x (+2e-3) of PyTorch's own bf16 error against float64 and L
  within 1e-3; each backward variant's dQ, dK, dV (from the shipped forward's O and L) within 2x (+2e-3) of our FA2
  backward's own error, finite, in their inputs' layouts, dK and dV repeatable. Whether a variant's results equal
  the shipped tile's bit for bit (the same per-tile arithmetic) is recorded, not required.
Timing, bf16, inputs as `flash_llm_shapes` draws them (q, k, v in the model's strides, dO contiguous), at five of
its d=64 points that take Gluon (flash_dispatch: from 4096 keys and 2^29 scores), spanning 2^29 to 2^34 scores:
the forward alone (each forward variant) and the backward alone (each backward variant, from the shipped forward's
O and L), beside cuDNN, in `--rounds` interleaved rounds (each round times every provider once, the order rotated
per round) by a `triton.testing.do_bench` median; the summary row per provider is the median over rounds (min and
max beside), with its ratio to cuDNN and to the shipped tile. One long-format CSV with provenance, rewritten after
every row; a summary printed at the end: per shape, the fastest forward and backward variant and its ratios.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

# stage 2's inputs, error measure and references, stage 3's SDPA forward (this folder is on sys.path as a script)
from flash_gluon_stage2 import (FA2_TILE, exact_backward_mismatches, fresh, gradients_within_fa2s_error,
                                reference_grads, rel_err, sdpa_backward, watched)
from flash_gluon_stage3 import exact_forward_case, sdpa_forward

from cs336_systems.bench.flash_gluon_bwd_resources import D64_CANDIDATES
from cs336_systems.kernels import flash_gluon, flash_gluon_bwd
from cs336_systems.kernels.flash_dispatch import attention_scores as scores_computed
from cs336_systems.model.attention import attention_scores, naive_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

HEAD_DIM = 64
# Forward variants (num_slots, persistent), named as below. The ring depths span 2 to 6 (6 is the deepest that fits
# 227 KiB with the persistent kernel's O buffers); the persistent grid was 0.87-0.98x the one-tile forward's time at
# d=64 (NOTES, "Persistent forward") and its walk across tiles is where a deeper ring can help.
FORWARD = [(2, False), (4, False), (6, False), (4, True), (6, True)]
# Backward variants, by their name in bench.flash_gluon_bwd_resources.D64_CANDIDATES (lockstep unless "deferred";
# block_m 128 spills 48-176 B and is left out): ring depth 2 to 4 with each dQ scheme the earlier runs disagreed on.
BACKWARD = ["m64_s4_split", "m64_s3_split", "m64_s2_split", "m64_s4_percons", "m64_s3_percons", "m64_s2_percons",
            "m64_s4_deferred"]
# (name, batch, heads, seq, causal): flash_llm_shapes' d=64 points, 16 heads; the leaderboard's among them
SHAPES = [
    ("4x16x4096_causal", 4, 16, 4096, True),  # the rule's edge: 2^29 scores
    ("32x16x4096", 32, 16, 4096, False),  # many short heads, non-causal: 2^33
    ("16x16x8192_causal", 16, 16, 8192, True),  # 2^33
    ("leaderboard", 1, 16, 16384, True),  # the 2025 leaderboard case: 2^31
    ("1x16x32768", 1, 16, 32768, False),  # the longest rows, non-causal: 2^34
]
EXACT_FORWARD_SHAPE = (2, 30, 1500, HEAD_DIM)
EXACT_BACKWARD = [((2, 3, 777, HEAD_DIM), (2, 3, 1000, HEAD_DIM), causal) for causal in (True, False)]
EXACT_BACKWARD.append(((1, 2, 4096, HEAD_DIM), (1, 2, 4096, HEAD_DIM), True))
FLOAT_CHECKS = [((2, 3, 777, HEAD_DIM), (2, 3, 1000, HEAD_DIM), causal) for causal in (True, False)]


def forward_name(num_slots: int, persistent: bool) -> str:
    return f"{'persistent' if persistent else 'one_tile'}_s{num_slots}"


def forward_variants(forward=FORWARD) -> dict[str, flash_gluon.GluonTile]:
    """name -> GluonTile of every forward variant, the shipped tile first (added if `forward` lacks it)."""
    shipped = flash_gluon.tile_for(HEAD_DIM)
    tiles = {forward_name(shipped.num_slots, shipped.persistent): shipped}
    for num_slots, persistent in forward:
        tiles.setdefault(forward_name(num_slots, persistent),
                         dataclasses.replace(shipped, num_slots=num_slots, persistent=persistent))
    return tiles


def backward_variants(backward=BACKWARD) -> dict[str, flash_gluon_bwd.BwdTile]:
    """name -> BwdTile of every backward variant in `backward`, the shipped tile first (named by its fields)."""
    shipped = flash_gluon_bwd.tile_for(HEAD_DIM)
    tiles = {}
    for name in backward:
        tile = dataclasses.replace(shipped, **D64_CANDIDATES[name])
        if tile == shipped:
            tiles = {name: tile, **tiles}
        else:
            tiles[name] = tile
    if shipped not in tiles.values():
        tiles = {"shipped": shipped, **tiles}
    return tiles


def shipped_name(tiles: dict) -> str:
    return next(iter(tiles))


def scores(batch, heads, seq, causal) -> int:
    """Scores a call computes (the dispatch rule's measure: 2^29 and more take Gluon at d=64)."""
    return scores_computed((batch, heads, seq, HEAD_DIM), (batch, heads, seq, HEAD_DIM), causal)


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
def exact_forward_rows(fwd):
    for causal in (True, False):
        q, k, v, expected = exact_forward_case(EXACT_FORWARD_SHAPE, causal)
        for name, tile in fwd.items():
            mismatches = [int((flash_gluon._forward(q, k, v, causal, exact=True, tile=tile)[0] != expected).sum())
                          for _ in range(3)]
            ok = not any(mismatches)
            print(f"exact forward {list(EXACT_FORWARD_SHAPE)} causal={causal} {name}: mismatches per launch "
                  f"{mismatches} {'ok' if ok else 'FAIL'}", flush=True)
            yield {"section": "exact", "pass": "forward", "case": str(list(EXACT_FORWARD_SHAPE)), "causal": causal,
                   "variant": name, "mismatches": str(mismatches), "ok": ok}


def exact_backward_rows(bwd):
    for q_shape, k_shape, causal in EXACT_BACKWARD:
        q, k, v, do = flash_gluon_bwd.exact_inputs(q_shape, k_shape, "cuda")
        expected = [g.to(torch.bfloat16) for g in flash_gluon_bwd.exact_reference(q, k, v, do, causal)]
        o, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], device="cuda")
        case = f"q{list(q_shape)} k{list(k_shape)}"
        for name, tile in bwd.items():
            mismatches = exact_backward_mismatches(q, k, v, o, do, lse, causal, tile, expected)
            ok = not any(any(m) for m in mismatches)
            print(f"exact backward {case} causal={causal} {name}: mismatches (dQ, dK, dV) per launch {mismatches} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            yield {"section": "exact", "pass": "backward", "case": case, "causal": causal, "variant": name,
                   "mismatches": str(mismatches), "ok": ok}


def float_rows(fwd, bwd):
    """The awkward cases: every forward variant's O and L, then every backward variant's gradients."""
    from cs336_systems.kernels.flash_triton import flash_backward_triton, pinned_tiles

    for q_shape, k_shape, causal in FLOAT_CHECKS:
        q, k, v, do = (fresh(shape, model_layout=True) for shape in (q_shape, k_shape, k_shape, q_shape))
        case = f"q{list(q_shape)} k{list(k_shape)}"
        base = {"section": "check", "case": case, "causal": causal, "model_layout": True, "dtype": "bfloat16"}
        ref = naive_attention(q.double(), k.double(), v.double(), causal)
        ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
        own = rel_err(naive_attention(q, k, v, causal), ref)  # PyTorch's own attention in bf16
        shipped = None
        for name, tile in fwd.items():
            out, lse = flash_gluon._forward(q, k, v, causal, tile=tile)
            shipped = shipped or (out, lse)
            err, lse_err = rel_err(out, ref), (lse.double() - ref_lse).abs().max().item()
            row = {**base, "pass": "forward", "variant": name, "o_rel_err": err, "torch_own_rel_err": own,
                   "limit": 2 * own + 2e-3, "l_max_abs_err": lse_err, "strides_kept": out.stride() == q.stride(),
                   "bitwise_equal_to_shipped": bool(torch.equal(out, shipped[0]) and torch.equal(lse, shipped[1]))}
            row["ok"] = bool(torch.isfinite(out).all() and err < row["limit"] and lse_err < 1e-3
                             and row["strides_kept"])
            print(f"check forward {case} causal={causal} {name}: O {err:.2e} (torch own {own:.2e}) L {lse_err:.1e}, "
                  f"bitwise = shipped: {row['bitwise_equal_to_shipped']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
            yield row
        o, lse = shipped
        ref_grads = reference_grads(q, k, v, do, causal)
        with pinned_tiles(FA2_TILE, FA2_TILE):
            fa2 = flash_backward_triton(q, k, v, o, lse, do, causal)
        first = None
        for name, tile in bwd.items():
            grads = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            again = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            torch.cuda.synchronize()
            first = first or grads
            row = {**base, "pass": "backward", "variant": name}
            ok = gradients_within_fa2s_error(row, grads, fa2, ref_grads)
            row["dkdv_repeatable"] = bool(torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]))
            row["layouts_kept"] = all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
            row["dkdv_equal_to_shipped"] = bool(torch.equal(grads[1], first[1]) and torch.equal(grads[2], first[2]))
            row["ok"] = ok and row["dkdv_repeatable"] and row["layouts_kept"]
            print(f"check backward {case} causal={causal} {name}: "
                  + " ".join(f"{n} {row[f'{n}_rel_err']:.2e} (FA2 {row[f'{n}_fa2_rel_err']:.2e})"
                             for n in ("dq", "dk", "dv"))
                  + f" dK,dV = shipped's: {row['dkdv_equal_to_shipped']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
            yield row


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def do_bench_ms(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def interleaved_rows(base: dict, fns: dict, shipped: str, rounds: int, flops: float, timer):
    """Per-round rows (each round every provider once, the order rotated), then one summary row per provider:
    the median over rounds, min and max, TFLOP/s, ratios to cuDNN and to the shipped tile. `timer(fn) -> ms`."""
    providers = list(fns)
    times = {provider: [] for provider in providers}
    for r in range(rounds):
        order = providers[r % len(providers):] + providers[:r % len(providers)]  # no provider always first
        for position, provider in enumerate(order):
            ms = timer(fns[provider])
            times[provider].append(ms)
            yield {**base, "section": "timing_round", "provider": provider, "round": r, "position": position, "ms": ms}
    median = {provider: statistics.median(ms) for provider, ms in times.items()}
    for provider in providers:
        yield {**base, "section": "timing", "provider": provider, "shipped": provider == shipped, "rounds": rounds,
               "ms": median[provider], "ms_min": min(times[provider]), "ms_max": max(times[provider]),
               "tflops": flops / median[provider] * 1e-9,
               "ratio_vs_cudnn": median[provider] / median["cudnn"] if "cudnn" in median else float("nan"),
               "ratio_vs_shipped": median[provider] / median[shipped]}


def shape_rows(name, batch, heads, seq, causal, fwd, bwd, rounds: int, rep_ms: int):
    """The rows of one shape: the forward section, then the backward's (its tensors freed on return)."""
    from torch.nn.attention import SDPBackend

    shape = (batch, heads, seq, HEAD_DIM)
    q, k, v = (fresh(shape, model_layout=True) for _ in range(3))  # flash_llm_shapes' layout
    do = fresh(shape)  # contiguous, as flash_llm_shapes draws it
    o, lse = flash_gluon._forward(q, k, v, causal)  # the shipped forward's O and L feed every backward variant
    base = {"case": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": HEAD_DIM, "causal": causal,
            "dtype": "bfloat16", "scores": scores(batch, heads, seq, causal)}
    flops = 4.0 * batch * heads * seq * seq * HEAD_DIM / (2 if causal else 1)
    forward = {n: (lambda t=t: flash_gluon._forward(q, k, v, causal, tile=t)) for n, t in fwd.items()}
    forward["cudnn"] = lambda: sdpa_forward(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)
    backward = {n: (lambda t=t: flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=t))
                for n, t in bwd.items()}
    backward["cudnn"] = sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)
    for section, fns, shipped, section_flops in (("forward", forward, shipped_name(fwd), flops),
                                                  ("backward", backward, shipped_name(bwd), 2.5 * flops)):
        for fn in fns.values():  # compiles before timing
            fn()
        torch.cuda.synchronize()
        yield from interleaved_rows({**base, "pass": section}, fns, shipped, rounds, section_flops,
                                    lambda fn: do_bench_ms(fn, rep_ms))


def summary(rows: list[dict]) -> list[str]:
    """Per shape and pass: the fastest variant (cuDNN aside) and its ratios, from the summary rows."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("section") == "timing"):
        for pass_ in ("forward", "backward"):
            done = [r for r in rows if r.get("section") == "timing" and r["case"] == case and r["pass"] == pass_]
            ours = [r for r in done if r["provider"] != "cudnn"]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["ms"])
            shipped = next(r for r in ours if r["shipped"])
            lines.append(f"{case} {pass_}: fastest {best['provider']} {best['ms']:.3f} ms ({best['ms_min']:.3f}-"
                         f"{best['ms_max']:.3f}) = {best['ratio_vs_shipped']:.3f}x shipped ({shipped['provider']} "
                         f"{shipped['ms']:.3f} ms), {best['ratio_vs_cudnn']:.3f}x cuDNN (shipped "
                         f"{shipped['ratio_vs_cudnn']:.3f}x)")
    return lines


def print_plan(fwd, bwd):
    print(f"forward variants ({len(fwd)}, shipped first): " + ", ".join(fwd))
    print(f"backward variants ({len(bwd)}, shipped first): " + ", ".join(bwd))
    for name, batch, heads, seq, causal in SHAPES:
        print(f"shape {name}: {batch} x {heads} x {seq}, d={HEAD_DIM}, causal={causal}, "
              f"{scores(batch, heads, seq, causal) / 2**29:g} x 2^29 scores")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.environ.get("OUT"), help="folder for the CSV (default: $OUT)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape and pass")
    parser.add_argument("--rep-ms", type=int, default=150, help="do_bench's timing window per measurement (ms)")
    parser.add_argument("--only-checks", action="store_true", help="skip the timing")
    parser.add_argument("--list", action="store_true", help="print the variants and shapes and exit")
    parser.add_argument("--backward", nargs="+", default=BACKWARD, choices=list(D64_CANDIDATES), metavar="NAME",
                        help="the backward variants to check and time (D64_CANDIDATES names; the shipped tile is "
                        f"always added; default: {' '.join(BACKWARD)})")
    parser.add_argument("--forward-shipped-only", action="store_true",
                        help="check and time the shipped forward tile only (a backward-only search)")
    parser.add_argument("--case-timeout", type=float, default=180.0,
                        help="seconds one check case or one timing shape may take before the run is ended (hang)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.rep_ms < 1:
        parser.error(f"--rep-ms must be at least 1, got {args.rep_ms}")
    if not args.out_dir and not args.list:
        parser.error("--out-dir is required when $OUT is not set")
    return args


def main(argv=None):
    args = parse_args(argv)
    fwd, bwd = forward_variants(() if args.forward_shipped_only else FORWARD), backward_variants(args.backward)
    print_plan(fwd, bwd)
    if args.list:
        return
    out = Path(args.out_dir) / "flash_gluon_d64.csv"
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm_{props.major}{props.minor} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, cuDNN {torch.backends.cudnn.version()}; writing {out}", flush=True)
    prov = provenance("cuda")
    tiles = {**{n: ("forward", t) for n, t in fwd.items()}, **{n: ("backward", t) for n, t in bwd.items()}}
    rows = []
    start = time.time()

    def record(new_rows):
        """Each row pulled under the watchdog, then the CSV rewritten: a watchdog exit keeps what was measured."""
        for row in watched(new_rows, args.case_timeout):
            name = row.get("variant", row.get("provider"))
            if name in tiles:  # the tile's fields beside its name
                row = {**row, **{f"tile_{k}": v for k, v in vars(tiles[name][1]).items() if k != "head_dim"}}
            rows.append(row)
            write_rows([{**r, **prov} for r in rows], out)

    for checks in (exact_forward_rows(fwd), exact_backward_rows(bwd), float_rows(fwd, bwd)):
        record(checks)
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(failed)} failed of {len(rows)}; {time.time() - start:.0f} s", flush=True)
    if failed:
        print("FAILED: " + "; ".join(f"{r['section']} {r['pass']} {r['case']} causal={r['causal']} {r['variant']}"
                                     for r in failed) + "; nothing timed", flush=True)
        sys.exit(1)
    if not args.only_checks:
        for shape in SHAPES:
            record(shape_rows(*shape, fwd, bwd, rounds=args.rounds, rep_ms=args.rep_ms))
            torch.cuda.empty_cache()
            print(f"shape {shape[0]} done at {time.time() - start:.0f} s", flush=True)
        print("\n".join(["summary (median over rounds, min-max beside):", *summary(rows)]), flush=True)
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
