"""Stage 2 of issue #26 on one GPU: is the Gluon backward (kernels/flash_gluon_bwd.py) correct, and how fast is it
against our Triton FA2 backward and SDPA's cuDNN and flash backwards, in the same run?

    python results/diagnosis/flash_gluon_stage2.py --out flash_gluon_stage2.csv [--no-fa2-timing] [--only-checks]

Checks (fresh random inputs, bf16; O and L from the Gluon forward, as the dispatch gives them on Hopper): dQ, dK, dV
of the Gluon backward, with the shipped tile and with the other dQ scheme (BwdTile.split_dq flipped), against a
float64 autograd reference (plain math, `naive_attention` in float64), each within 2x (+2e-3) of our FA2
backward's own error on the same O and L; also FA2's and PyTorch's same-dtype errors for the record, dK and dV
bitwise repeatable across two launches, gradients in their inputs' layouts. Cases: lengths 1000, 777, 513, 257 and 1,
rectangular causal both ways (n_q < n_k visits key tiles past the last query), 3-d inputs, the model's strides, a
stride-0 dO (as `o.sum().backward()` gives). EXACT (P^T = S^T mod 8 with integer inputs): dQ, dK, dV bit for bit
against the float64 reference on 3 launches, both dQ schemes.
Timing: `triton.testing.do_bench` medians of the backward alone at the issue's shapes (bf16, contiguous (batch,
heads, seq, dim)): ours from O, L, dO; FA2's the same; SDPA's as `torch.autograd.grad` of its output with the
graph retained (its backward kernels only). TFLOP/s counts 10 n_q n_k d per head (five products), halved when
causal. Each Gluon row has its relative difference to cuDNN's gradients. One long-format CSV row per
measurement, with provenance. A watchdog ends the run if one case takes longer than --case-timeout (a pipeline
hang). Exits 1 if a check fails.
"""

import argparse
import dataclasses
import faulthandler
import sys
import time

import torch
import torch.nn.functional as F
import triton

from cs336_systems.kernels import flash_gluon, flash_gluon_bwd
from cs336_systems.kernels.flash_triton import flash_backward_triton, pinned_tiles
from cs336_systems.model.attention import naive_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

# (name, batch, heads, seq, head dim, causal)
SHAPES = [
    ("leaderboard", 1, 16, 16384, 64, True),
    ("8b_attention", 2, 32, 32768, 128, True),
    ("4x32x4096_d128_causal", 4, 32, 4096, 128, True),
    ("8x16x2048_d64", 8, 16, 2048, 64, False),
]
# (q shape, k shape, causal, model layout, stride-0 dO)
CHECKS = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False, False),
    ((2, 3, 1000, 128), (2, 3, 1000, 128), True, True, False),
    ((2, 3, 777, 128), (2, 3, 777, 128), False, True, False),
    ((2, 3, 777, 64), (2, 3, 777, 64), True, False, False),
    ((1, 4, 513, 64), (1, 4, 513, 64), False, False, False),
    ((1, 4, 513, 128), (1, 4, 513, 128), True, False, False),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, False, False),
    ((1, 4, 1000, 64), (1, 4, 300, 64), True, True, False),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False, False),
    ((3, 1, 64), (3, 1, 64), True, False, False),
    ((2, 2, 1, 128), (2, 2, 1, 128), False, False, False),
    ((2, 257, 128), (2, 257, 128), True, False, False),
    ((1, 2, 1000, 128), (1, 2, 1000, 128), True, False, True),
    ((1, 2, 4096, 64), (1, 2, 4096, 64), True, True, False),
]
FA2_TILE = (64, 32, 4, 2)  # tests/test_flash.py's GPU_TEST_TILE: no autotuning per check case


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1.0)).item()


def watched(rows, timeout_s: float):
    """The rows of a generator, each pulled under a watchdog that ends the process (with every thread's
    traceback) if producing it takes longer than `timeout_s`: a barrier deadlock ends the run, not the session."""
    rows = iter(rows)
    while True:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        row = next(rows, None)
        faulthandler.cancel_dump_traceback_later()
        if row is None:
            return
        yield row


def exact_backward_mismatches(q, k, v, o, do, lse, causal: bool, tile, expected) -> list[list[int]]:
    """Per launch of 3, the (dQ, dK, dV) elements of the EXACT backward that differ from `expected`."""
    return [[int((g != e).sum()) for g, e in
             zip(flash_gluon_bwd._backward(q, k, v, o, do, lse, causal, scale=1.0, tile=tile, exact=True), expected)]
            for _ in range(3)]


def gradients_within_fa2s_error(row: dict, grads, fa2, ref) -> bool:
    """dQ, dK, dV against float64 (`ref`), each within 2x (+2e-3) of our FA2 backward's own error (`fa2`, on the
    same O and L) and that close to FA2's values, and finite; the errors and limits go into `row`."""
    ok = True
    for name, g, f, r in zip(("dq", "dk", "dv"), grads, fa2, ref):
        err, fa2_err = rel_err(g, r), rel_err(f, r)
        limit = 2 * fa2_err + 2e-3
        row.update({f"{name}_rel_err": err, f"{name}_fa2_rel_err": fa2_err, f"{name}_limit": limit,
                    f"{name}_diff_vs_fa2": rel_err(g, f)})
        ok &= bool(torch.isfinite(g).all()) and err < limit and row[f"{name}_diff_vs_fa2"] < limit
    return ok


def fresh(shape, model_layout=False, dtype=torch.bfloat16):
    t = torch.randn(shape, device="cuda", dtype=torch.float64)
    if model_layout:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(dtype)


def variants(head_dim):
    """(name, tile): the shipped tile and the other dQ scheme."""
    tile = flash_gluon_bwd.tile_for(head_dim)
    # the other dQ scheme on the lockstep schedule (per-consumer dQ has no deferred form)
    other = dataclasses.replace(tile, split_dq=not tile.split_dq, defer_dq=False, pingpong=False)
    return [("shipped", tile), ("split_dq" if other.split_dq else "per_consumer_dq", other)]


def reference_grads(q, k, v, do, causal, dtype=torch.float64):
    """dQ, dK, dV of plain attention in `dtype` (float64: the reference; the inputs' dtype: PyTorch's own error)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = naive_attention(*leaves, causal)
    return torch.autograd.grad(out, leaves, do.to(dtype))


def check_rows(timeout_s):
    for q_shape, k_shape, causal, model_layout, stride0 in CHECKS:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        q, k, v = fresh(q_shape, model_layout), fresh(k_shape, model_layout), fresh(k_shape, model_layout)
        o, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
        do = torch.ones((), device=q.device, dtype=q.dtype).expand(q.shape) if stride0 else fresh(q_shape, model_layout)
        ref = reference_grads(q, k, v, do, causal)
        own = reference_grads(q, k, v, do, causal, q.dtype)
        with pinned_tiles(FA2_TILE, FA2_TILE):
            fa2 = flash_backward_triton(q, k, v, o, lse, do, causal)
        case = f"q{list(q_shape)} k{list(k_shape)}"
        for variant, tile in variants(q_shape[-1]):
            grads = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            again = flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, tile=tile)
            torch.cuda.synchronize()
            row = {"section": "check", "case": case, "causal": causal, "model_layout": model_layout,
                   "stride0_do": stride0, "dtype": "bfloat16", "variant": variant, "split_dq": tile.split_dq}
            ok = gradients_within_fa2s_error(row, grads, fa2, ref)
            row.update({f"{name}_torch_own_rel_err": rel_err(own_g, r)
                        for name, own_g, r in zip(("dq", "dk", "dv"), own, ref)})
            row["dkdv_repeatable"] = bool(torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]))
            row["layouts_kept"] = all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
            row["ok"] = ok and row["dkdv_repeatable"] and row["layouts_kept"]
            yield row
            print(f"check {case} causal={causal} layout={'model' if model_layout else 'bhnd'}"
                  f"{' dO stride 0' if stride0 else ''} {variant}: "
                  + " ".join(f"{n} {row[f'{n}_rel_err']:.2e} (FA2 {row[f'{n}_fa2_rel_err']:.2e})"
                             for n in ("dq", "dk", "dv"))
                  + f" {'ok' if row['ok'] else 'FAIL'}", flush=True)
        faulthandler.cancel_dump_traceback_later()
    yield from exact_rows(timeout_s)


def exact_rows(timeout_s):
    """EXACT (P^T = S^T mod 8, integer inputs, O = 0, scale 1): dQ, dK, dV bit for bit against the float64
    reference rounded to bf16 on 3 launches, both dQ schemes, ragged and rectangular (777 queries, 1000 keys)."""
    for head_dim in (64, 128):
        for causal in (True, False):
            faulthandler.dump_traceback_later(timeout_s, exit=True)
            q, k, v, do = flash_gluon_bwd.exact_inputs((2, 3, 777, head_dim), (2, 3, 1000, head_dim), "cuda")
            expected = [g.to(torch.bfloat16) for g in flash_gluon_bwd.exact_reference(q, k, v, do, causal)]
            o, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], device="cuda")
            for variant, tile in variants(head_dim):
                mismatches = exact_backward_mismatches(q, k, v, o, do, lse, causal, tile, expected)
                ok = not any(any(m) for m in mismatches)
                print(f"exact d={head_dim} causal={causal} {variant}: mismatches (dQ, dK, dV) per launch {mismatches}"
                      f" {'ok' if ok else 'FAIL'}", flush=True)
                yield {"section": "exact", "case": f"q{list(q.shape)} k{list(k.shape)}", "causal": causal,
                       "dtype": "bfloat16", "variant": variant, "split_dq": tile.split_dq,
                       "mismatches_dq_dk_dv": str(mismatches), "ok": ok}
            faulthandler.cancel_dump_traceback_later()


def sdpa_backward(backend, q, k, v, do, causal):
    """A function running SDPA's backward only (its graph kept), and the gradients it gives."""
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def time_shape(name, batch, heads, n, d, causal, with_fa2: bool):
    """The rows of one timing shape (its tensors are freed when this returns)."""
    from torch.nn.attention import SDPBackend

    q, k, v, do = (fresh((batch, heads, n, d)) for _ in range(4))
    o, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
    # provider -> a function making the timed call (SDPA's forward runs there, so a refusal is caught per provider)
    providers = {f"gluon_{variant}": (lambda t=tile: lambda: flash_gluon_bwd.flash_backward_gluon(
        q, k, v, o, do, lse, causal, tile=t)) for variant, tile in variants(d)}
    providers["cudnn"] = lambda: sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)
    providers["sdpa_flash"] = lambda: sdpa_backward(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal)
    if with_fa2:
        providers["flash_triton"] = lambda: lambda: flash_backward_triton(q, k, v, o, lse, do, causal)
    flops = 10.0 * batch * heads * n * n * d / (2 if causal else 1)
    rows, times, grads = [], {}, {}
    for provider, make in providers.items():
        row = {"section": "timing", "case": name, "batch": batch, "heads": heads, "seq": n, "head_dim": d,
               "causal": causal, "dtype": "bfloat16", "provider": provider}
        try:
            fn = make()
            grads[provider] = fn()  # also compiles / autotunes before timing
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        except Exception as error:  # a backend torch refuses at this shape is a row, not the end of the run
            rows.append({**row, "error": f"{type(error).__name__}: {error}"[:300]})
            print(f"time {name} {provider}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        times[provider] = ms
        rows.append({**row, "ms": ms, "tflops": flops / ms * 1e-9})
    for row in rows:
        if "ms" not in row:
            continue
        for other in ("cudnn", "sdpa_flash", "flash_triton"):
            if other in times:
                row[f"ratio_vs_{other}"] = row["ms"] / times[other]
        if row["provider"].startswith("gluon") and "cudnn" in grads:
            for label, g, c in zip(("dq", "dk", "dv"), grads[row["provider"]], grads["cudnn"]):
                row[f"{label}_rel_diff_vs_cudnn"] = rel_err(g, c)
    shown = "  ".join(f"{p} {t:.3f} ms" for p, t in times.items())
    ratio = f"{times['gluon_shipped'] / times['cudnn']:.3f}x cuDNN" if {"gluon_shipped", "cudnn"} <= set(times) else ""
    print(f"time {name}: {shown}  gluon = {ratio}", flush=True)
    return rows


def time_rows(with_fa2: bool, timeout_s: float):
    for shape in SHAPES:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        yield from time_shape(*shape, with_fa2)
        torch.cuda.empty_cache()
        faulthandler.cancel_dump_traceback_later()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    parser.add_argument("--no-fa2-timing", action="store_true",
                        help="do not time our Triton FA2 backward (it autotunes at each shape on a cold cache)")
    parser.add_argument("--only-timing", action="store_true", help="skip the checks")
    parser.add_argument("--only-checks", action="store_true", help="skip the timing")
    parser.add_argument("--case-timeout", type=float, default=120.0,
                        help="seconds one check case or one timing shape may take before the run is ended (hang)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    prov = provenance("cuda")
    rows = []
    start = time.time()
    sections = ([] if args.only_timing else [check_rows(args.case_timeout)]) + \
        ([] if args.only_checks else [time_rows(not args.no_fa2_timing, args.case_timeout)])
    for section in sections:
        for row in section:  # the CSV rewritten after every row: a watchdog exit keeps what was measured
            rows.append(row)
            write_rows([{**row, **prov} for row in rows], args.out)
        print(f"section done at {time.time() - start:.0f} s", flush=True)
    failed = [row for row in rows if row["section"] != "timing" and not row["ok"]]
    print(f"{len(failed)} failed checks; {time.time() - start:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
