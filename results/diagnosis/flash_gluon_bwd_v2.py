"""Issues #26 and #24 on one GPU: are the Gluon backward's new schedules (kernels/flash_gluon_bwd.py: `BwdTile.
defer_dq`, the deferred-dQ schedule, and `BwdTile.dq_buffers` = 2, two float32 dQ buffers per consumer, alone and
together; then `BwdTile.pingpong`, consumers a step apart at most) correct, and faster than the lockstep schedule
shipped now, against SDPA's cuDNN backward, in the same run? Written to finish in one call of under 5 minutes on
an H100 or H200. Two stages (STAGES), each checks then timing: the first four schedules, then ping-pong beside
lockstep (its new barrier protocol last, so that a hang costs only its own rows).

    python results/diagnosis/flash_gluon_bwd_v2.py [--out-dir DIR] [--rounds 5] [--only-checks] [--skip-pingpong]

(--out-dir defaults to $OUT; the CSV is DIR/flash_gluon_bwd_v2.csv.)
Checks first, and the run stops (exit 1, nothing more timed) if one fails, each schedule beside the others:
- EXACT (P^T = S^T mod 8, integer inputs, O = 0, scale 1: every value an exact integer): dQ, dK, dV bit for bit
  against the float64 reference (`flash_gluon_bwd.exact_reference`) rounded to bf16, on 3 launches, d 64/128 x
  causal or not, 777 queries x 1000 keys (ragged, rectangular), and one long case (4096 x 4096, d=128, causal:
  up to 64 steps per program, so many ring wraps and ds_ready phases);
- stage 2's awkward cases (`flash_gluon_stage2.CHECKS`: ragged lengths, rectangular both ways, 3-d inputs, the
  model's strides, a stride-0 dO), bf16, fresh random inputs, O and L from the Gluon forward: dQ, dK, dV within 2x
  (+2e-3) of our FA2 backward's own error against float64 on the same O and L, finite, in their inputs' layouts,
  dK and dV repeatable across two launches. Whether a schedule's dK, dV equal the lockstep ones bit for bit (the
  same per-step arithmetic in another order of issue; expected) is recorded, not required.
Timing: the backward alone from the Gluon forward's O and L (bf16, contiguous (batch, heads, seq, dim)), at the 8B
shape (2 x 32 x 32768, d=128, causal), 4 x 32 x 4096 d=128 causal, 1 x 16 x 16384 d=64 causal and 8 x 16 x 2048
d=64 non-causal: `--rounds` interleaved rounds, each round timing every schedule and cuDNN once each (the order
rotated per round) by a `triton.testing.do_bench` median; the summary row per provider is the median over rounds
(min and max beside), with its ratio to cuDNN and to lockstep. TFLOP/s counts 10 n_q n_k d per head, halved when
causal. One long-format CSV row per measurement with provenance, rewritten after every row; a watchdog ends the run
if one case or shape takes longer than --case-timeout (a barrier deadlock).
"""

import argparse
import dataclasses
import faulthandler
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

# stage 2's cases, inputs, error measure and references (this folder is on sys.path when run as a script)
from flash_gluon_stage2 import (CHECKS, FA2_TILE, fresh, gradients_within_fa2s_error, reference_grads, rel_err,
                               sdpa_backward)

from cs336_systems.kernels import flash_gluon, flash_gluon_bwd
from cs336_systems.kernels.flash_triton import flash_backward_triton, pinned_tiles
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

# (name, batch, heads, seq, head dim, causal): the 8B step's attention first
SHAPES = [
    ("8b_attention", 2, 32, 32768, 128, True),
    ("4x32x4096_d128_causal", 4, 32, 4096, 128, True),
    ("leaderboard", 1, 16, 16384, 64, True),
    ("8x16x2048_d64", 8, 16, 2048, 64, False),
]
# (q shape, k shape): the EXACT cases, each at d 64 and 128 and causal or not, and the long one (d=128, causal)
EXACT_SHAPES = [((2, 3, 777), (2, 3, 1000))]
EXACT_LONG = ((1, 2, 4096, 128), (1, 2, 4096, 128), True)


# the schedules by name: flash_gluon_bwd.SCHEDULES (lockstep first; the others are compared with it)
SCHEDULES = flash_gluon_bwd.SCHEDULES
# stage 1 checks and times these; stage 2 the ping-pong schedule (new barrier protocol: a deadlock there, which the
# watchdog ends, must not cost stage 1's rows), beside the lockstep one again
STAGES = [["lockstep", "deferred", "lockstep_dq2", "deferred_dq2"], ["lockstep", "pingpong"]]


def schedules(head_dim, names):
    """(name, tile) of each named schedule at this head dim, lockstep first."""
    tile = flash_gluon_bwd.tile_for(head_dim)
    return [(name, dataclasses.replace(tile, **SCHEDULES[name])) for name in names]


def exact_cases():
    for q_shape, k_shape in EXACT_SHAPES:
        for head_dim in (64, 128):
            for causal in (True, False):
                yield (*q_shape, head_dim), (*k_shape, head_dim), causal
    yield EXACT_LONG


def exact_rows(names, timeout_s):
    """EXACT, each named schedule: mismatching elements of dQ, dK, dV on each of 3 launches (all must be 0)."""
    for q_shape, k_shape, causal in exact_cases():
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        q, k, v, do = flash_gluon_bwd.exact_inputs(q_shape, k_shape, "cuda")
        expected = [g.to(torch.bfloat16) for g in flash_gluon_bwd.exact_reference(q, k, v, do, causal)]
        o, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], device="cuda")
        for schedule, tile in schedules(q_shape[-1], names):
            mismatches = []
            for _ in range(3):
                grads = flash_gluon_bwd._backward(q, k, v, o, do, lse, causal, scale=1.0, tile=tile, exact=True)
                mismatches.append([int((g != e).sum()) for g, e in zip(grads, expected)])
            ok = not any(any(m) for m in mismatches)
            case = f"q{list(q_shape)} k{list(k_shape)}"
            print(f"exact {case} causal={causal} {schedule}: mismatches (dQ, dK, dV) per launch {mismatches} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            yield {"section": "exact", "case": case, "causal": causal, "dtype": "bfloat16", "schedule": schedule,
                   **SCHEDULES[schedule], "mismatches_dq_dk_dv": str(mismatches), "ok": ok}
        faulthandler.cancel_dump_traceback_later()


def float_rows(names, timeout_s):
    """Stage 2's awkward cases, each named schedule, against float64 and our FA2 backward (see the docstring)."""
    for q_shape, k_shape, causal, model_layout, stride0 in CHECKS:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        q, k, v = fresh(q_shape, model_layout), fresh(k_shape, model_layout), fresh(k_shape, model_layout)
        o, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
        do = torch.ones((), device=q.device, dtype=q.dtype).expand(q.shape) if stride0 else fresh(q_shape, model_layout)
        ref = reference_grads(q, k, v, do, causal)
        with pinned_tiles(FA2_TILE, FA2_TILE):
            fa2 = flash_backward_triton(q, k, v, o, lse, do, causal)
        case = f"q{list(q_shape)} k{list(k_shape)}"
        lockstep = None
        for schedule, tile in schedules(q_shape[-1], names):
            grads = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            again = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            torch.cuda.synchronize()
            row = {"section": "check", "case": case, "causal": causal, "model_layout": model_layout,
                   "stride0_do": stride0, "dtype": "bfloat16", "schedule": schedule, **SCHEDULES[schedule]}
            ok = gradients_within_fa2s_error(row, grads, fa2, ref)
            row["dkdv_repeatable"] = bool(torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]))
            row["layouts_kept"] = all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
            if lockstep is None:
                lockstep = grads
            else:
                row["dkdv_equal_to_lockstep"] = bool(torch.equal(grads[1], lockstep[1])
                                                     and torch.equal(grads[2], lockstep[2]))
                row["dq_rel_diff_vs_lockstep"] = rel_err(grads[0], lockstep[0])
            row["ok"] = ok and row["dkdv_repeatable"] and row["layouts_kept"]
            print(f"check {case} causal={causal} layout={'model' if model_layout else 'bhnd'}"
                  f"{' dO stride 0' if stride0 else ''} {schedule}: "
                  + " ".join(f"{n} {row[f'{n}_rel_err']:.2e} (FA2 {row[f'{n}_fa2_rel_err']:.2e})"
                             for n in ("dq", "dk", "dv"))
                  + (f" dK,dV = lockstep's: {row['dkdv_equal_to_lockstep']}" if "dkdv_equal_to_lockstep" in row else "")
                  + f" {'ok' if row['ok'] else 'FAIL'}", flush=True)
            yield row
        faulthandler.cancel_dump_traceback_later()


def timing_rows(name, batch, heads, n, d, causal, names, rounds: int, rep_ms: int):
    """The per-round rows of one shape, then one summary row per provider (its tensors freed on return)."""
    from torch.nn.attention import SDPBackend

    q, k, v, do = (fresh((batch, heads, n, d)) for _ in range(4))
    o, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
    fns = {schedule: (lambda t=tile: flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=t))
           for schedule, tile in schedules(d, names)}
    base = {"section": "timing_round", "case": name, "batch": batch, "heads": heads, "seq": n, "head_dim": d,
            "causal": causal, "dtype": "bfloat16"}
    try:  # a backend torch refuses at this shape is a row, not the end of the run
        fns["cudnn"] = sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)
    except Exception as error:
        yield {**base, "section": "timing", "provider": "cudnn", "error": f"{type(error).__name__}: {error}"[:300]}
        print(f"time {name} cudnn: {type(error).__name__}: {str(error)[:200]}", flush=True)
    grads = {provider: fn() for provider, fn in fns.items()}  # compiles before timing
    torch.cuda.synchronize()
    flops = 10.0 * batch * heads * n * n * d / (2 if causal else 1)
    providers = list(fns)
    times = {provider: [] for provider in providers}
    for r in range(rounds):
        order = providers[r % len(providers):] + providers[:r % len(providers)]  # no provider always first
        for provider in order:
            ms = triton.testing.do_bench(fns[provider], warmup=25, rep=rep_ms, return_mode="median")
            times[provider].append(ms)
            yield {**base, "provider": provider, "round": r, "position": order.index(provider), "ms": ms}
    median = {provider: statistics.median(ms) for provider, ms in times.items()}
    cudnn = median.get("cudnn", float("nan"))
    for provider in providers:
        row = {**base, "section": "timing", "provider": provider, "rounds": rounds, "ms": median[provider],
               "ms_min": min(times[provider]), "ms_max": max(times[provider]),
               "tflops": flops / median[provider] * 1e-9,
               "ratio_vs_cudnn": median[provider] / cudnn,
               "ratio_vs_lockstep": median[provider] / median["lockstep"]}
        if provider != "cudnn":
            for i, label in enumerate(("dq", "dk", "dv")):
                if "cudnn" in grads:
                    row[f"{label}_rel_diff_vs_cudnn"] = rel_err(grads[provider][i], grads["cudnn"][i])
                row[f"{label}_rel_diff_vs_lockstep"] = rel_err(grads[provider][i], grads["lockstep"][i])
        yield row
    print(f"time {name}: " + "  ".join(f"{p} {median[p]:.3f} ms ({flops / median[p] * 1e-9:.0f} TFLOP/s, "
                                       f"{median[p] / cudnn:.3f}x cuDNN)" for p in providers)
          + "  vs lockstep: " + " ".join(f"{p} {median[p] / median['lockstep']:.3f}" for p in names[1:]), flush=True)


def time_all(names, rounds: int, timeout_s: float):
    for shape in SHAPES:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        rep_ms = 500 if shape[3] >= 32768 else 200  # a few calls per do_bench at the 8B shape's ~80 ms
        yield from timing_rows(*shape, names, rounds=rounds, rep_ms=rep_ms)
        torch.cuda.empty_cache()
        faulthandler.cancel_dump_traceback_later()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.environ.get("OUT"), help="folder for the CSV (default: $OUT)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape")
    parser.add_argument("--only-checks", action="store_true", help="skip the timing")
    parser.add_argument("--skip-pingpong", action="store_true", help="stage 1 only (no BwdTile.pingpong)")
    parser.add_argument("--case-timeout", type=float, default=120.0,
                        help="seconds one check case or one timing shape may take before the run is ended (hang)")
    args = parser.parse_args()
    if not args.out_dir:
        parser.error("--out-dir is required when $OUT is not set")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    out = Path(args.out_dir) / "flash_gluon_bwd_v2.csv"
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}; writing {out}", flush=True)
    prov = provenance("cuda")
    rows = []
    start = time.time()

    def record(section):
        for row in section:  # the CSV rewritten after every row: a watchdog exit keeps what was measured
            rows.append(row)
            write_rows([{**r, **prov} for r in rows], out)
        print(f"section done at {time.time() - start:.0f} s", flush=True)

    for stage, names in enumerate(STAGES[:1] if args.skip_pingpong else STAGES, 1):
        print(f"stage {stage}: {', '.join(names)}", flush=True)
        first = len(rows)
        record({**row, "stage": stage} for row in exact_rows(names, args.case_timeout))
        record({**row, "stage": stage} for row in float_rows(names, args.case_timeout))
        failed = [row for row in rows[first:] if not row["ok"]]
        print(f"stage {stage}: {len(failed)} failed checks of {len(rows) - first}; {time.time() - start:.0f} s",
              flush=True)
        if failed:
            print("FAILED: " + "; ".join(f"{r['section']} {r['case']} causal={r['causal']} {r['schedule']}"
                                         for r in failed), flush=True)
            sys.exit(1)
        if not args.only_checks:
            record({**row, "stage": stage} for row in time_all(names, args.rounds, args.case_timeout))
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
