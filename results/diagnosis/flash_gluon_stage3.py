"""Issue #26, the forward's persistent grid on one GPU: is the persistent Gluon forward (GluonTile.persistent in
kernels/flash_gluon.py) correct, and is it faster than the one-tile-per-program forward shipped now, against SDPA's
cuDNN and flash backends, in the same run? Also the backward alone at d=64 with each dQ scheme (BwdTile.split_dq).

    python results/diagnosis/flash_gluon_stage3.py --out $OUT/flash_gluon_stage3.csv [--only-checks]

Checks first, and the run stops (exit 1, nothing timed) if one fails:
- EXACT (P = S mod 8, integer inputs, every value exact): O bit for bit against float64 on 3 launches, d 64/128,
  causal or not, 2 x 30 heads of 1500 rows (720 tiles: more than the SMs, so persistent programs walk several
  tiles), for the one-tile kernel, the persistent one, and the persistent one on 3 programs (240 tiles each);
- two awkward shapes, bf16, fresh random inputs: (2, 24, 1000, 64) causal in the model's (batch, seq, heads, dim)
  strides (384 tiles), and 777 queries x 1300 keys, d=128, causal, 40 heads (rectangular, 280 tiles). O within 2x
  (+2e-3) of PyTorch's own bf16 error against float64, L within 1e-3, for each variant; whether the persistent
  O and L equal the one-tile kernel's bit for bit is recorded (the same per-tile code in another loop).
Timing (`triton.testing.do_bench` medians, bf16, contiguous (batch, heads, seq, dim), the issue's four shapes):
- forward alone: gluon_one_tile, gluon_persistent, cudnn, sdpa_flash, with the persistent O's max abs difference
  to the one-tile O at that shape;
- forward + backward through `FlashAttentionTriton` (the model's path) with the forward forced to Gluon and each
  variant, the backward forced to Gluon's (the same for both variants; "auto" would take FA2's at 2048 keys and
  autotune it on a cold cache), against SDPA cudnn and flash (forward + backward of their own);
- backward alone at the two d=64 shapes, Gluon's with split_dq True and False, from the one-tile forward's O, L.
TFLOP/s counts 4 n_q n_k d per head for the forward, 10 for the backward, 14 for both, halved when causal.
One long-format CSV row per measurement with provenance (git commit: CS336_GIT_COMMIT where .git is absent),
rewritten after every row; a watchdog ends the run if one case takes longer than --case-timeout (a pipeline hang,
the persistent kernel's first risk).
"""

import argparse
import dataclasses
import faulthandler
import functools
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
import triton

# the shapes, the inputs and the error measure as in stage 2 (this folder is on sys.path when run as a script)
from flash_gluon_stage2 import SHAPES, fresh, rel_err, watched

from cs336_systems.kernels import flash_gluon, flash_gluon_bwd
from cs336_systems.kernels.flash_triton import FlashAttentionTriton
from cs336_systems.kernels.settings import use_flash_settings
from cs336_systems.model.attention import attention_scores, naive_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

# name -> (persistent, SMs the persistent grid is sized for; None: the device's), as in tests/test_flash_gluon.py
VARIANTS = {"one_tile": (False, None), "persistent": (True, None), "persistent_3_programs": (True, 3)}
TIMED_VARIANTS = ("one_tile", "persistent")
# (q shape, k shape, causal, model layout)
CHECKS = [
    ((2, 24, 1000, 64), (2, 24, 1000, 64), True, True),
    ((1, 40, 777, 128), (1, 40, 1300, 128), True, False),
]
EXACT_SHAPE = (2, 30, 1500)


@functools.cache
def variant_tile(variant: str, head_dim: int) -> flash_gluon.GluonTile:
    return dataclasses.replace(flash_gluon.tile_for(head_dim), persistent=VARIANTS[variant][0])


def run_variant(variant, q, k, v, causal, exact=False):
    """O, L of the Gluon forward in this variant (a persistent grid on fewer SMs where the variant says so; the
    timed variants run without any patching)."""
    tile, sms = variant_tile(variant, q.shape[-1]), VARIANTS[variant][1]
    if sms is None:
        return flash_gluon._forward(q, k, v, causal, exact=exact, tile=tile)
    with mock.patch.object(flash_gluon, "sm_count", lambda device: sms):
        return flash_gluon._forward(q, k, v, causal, exact=exact, tile=tile)


def exact_forward_case(shape: tuple, causal: bool) -> tuple:
    """q, k, v of small integers (v sparse) and the EXACT forward's O computed in float64 (P = S mod 8, no softmax,
    causal-masked), rounded to bf16: every value is an exact integer, so the kernel must match it bit for bit."""
    q, k = (torch.randint(-1, 2, shape, device="cuda").to(torch.bfloat16) for _ in range(2))
    sparse = torch.rand(shape, device="cuda") < 0.25
    v = (torch.randint(-1, 2, shape, device="cuda") * sparse).to(torch.bfloat16)
    s = q.double() @ k.double().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), 0.0)
    return q, k, v, (p @ v.double()).to(torch.bfloat16)


def exact_rows():
    for head_dim in (64, 128):
        for causal in (True, False):
            shape = (*EXACT_SHAPE, head_dim)
            q, k, v, expected = exact_forward_case(shape, causal)
            for variant in VARIANTS:
                mismatches = [int((run_variant(variant, q, k, v, causal, exact=True)[0] != expected).sum())
                              for _ in range(3)]
                ok = not any(mismatches)
                print(f"exact {list(shape)} causal={causal} {variant}: mismatches per launch {mismatches} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
                yield {"section": "exact", "case": str(list(shape)), "head_dim": head_dim, "causal": causal,
                       "dtype": "bfloat16", "variant": variant, "mismatches": str(mismatches), "ok": ok}


def float_rows():
    for q_shape, k_shape, causal, model_layout in CHECKS:
        q, k, v = fresh(q_shape, model_layout), fresh(k_shape, model_layout), fresh(k_shape, model_layout)
        ref = naive_attention(q.double(), k.double(), v.double(), causal)
        ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
        own = rel_err(naive_attention(q, k, v, causal), ref)  # PyTorch's own attention in bf16
        limit = 2 * own + 2e-3
        outputs = {variant: run_variant(variant, q, k, v, causal) for variant in VARIANTS}
        base_out, base_lse = outputs["one_tile"]
        for variant, (out, lse) in outputs.items():
            err, lse_err = rel_err(out, ref), (lse.double() - ref_lse).abs().max().item()
            row = {"section": "check", "case": f"q{list(q_shape)} k{list(k_shape)}", "head_dim": q_shape[-1],
                   "causal": causal, "model_layout": model_layout, "dtype": "bfloat16", "variant": variant,
                   "o_rel_err": err, "torch_own_rel_err": own, "limit": limit, "l_max_abs_err": lse_err,
                   "o_max_abs_diff_vs_one_tile": (out.float() - base_out.float()).abs().max().item(),
                   "l_max_abs_diff_vs_one_tile": (lse - base_lse).abs().max().item(),
                   "bitwise_equal_to_one_tile": bool(torch.equal(out, base_out) and torch.equal(lse, base_lse)),
                   "strides_kept": out.stride() == q.stride()}
            row["ok"] = bool(torch.isfinite(out).all() and err < limit and lse_err < 1e-3 and row["strides_kept"])
            print(f"check {row['case']} causal={causal} {variant}: O {err:.2e} (torch own {own:.2e}, limit "
                  f"{limit:.2e}) L {lse_err:.1e}, bitwise = one-tile: {row['bitwise_equal_to_one_tile']} "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
            yield row
        del q, k, v, ref, ref_lse, outputs


def sdpa_forward(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def ours_forward_backward(variant, q, k, v, do, causal):
    """One forward + backward through the model's autograd Function, forward forced to this Gluon variant."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    tiles = {q.shape[-1]: variant_tile(variant, q.shape[-1])}

    def run():
        with use_flash_settings(forward="gluon", backward="gluon"), mock.patch.dict(flash_gluon.TILES, tiles):
            out = FlashAttentionTriton.apply(*leaves, causal)
            return torch.autograd.grad(out, leaves, do)

    return run


def sdpa_forward_backward(backend, q, k, v, do, causal):
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def run():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        return torch.autograd.grad(out, leaves, do)

    return run


def timed_row(row, fn, flops):
    """`row` with fn's do_bench median (after one call that also compiles), or with the error that stopped it."""
    try:
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except Exception as error:  # a backend torch refuses at this shape is a row, not the end of the run
        return {**row, "error": f"{type(error).__name__}: {error}"[:300]}
    return {**row, "ms": ms, "tflops": flops / ms * 1e-9}


def time_shape(name, batch, heads, n, d, causal):
    """The rows of one timing shape, each section's ratios against cuDNN's in the same section."""
    from torch.nn.attention import SDPBackend

    q, k, v, do = (fresh((batch, heads, n, d)) for _ in range(4))
    base = {"case": name, "batch": batch, "heads": heads, "seq": n, "head_dim": d, "causal": causal,
            "dtype": "bfloat16"}
    flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
    one_tile_out, one_tile_lse = run_variant("one_tile", q, k, v, causal)
    forward = {f"gluon_{variant}": (lambda vr=variant: run_variant(vr, q, k, v, causal)) for variant in TIMED_VARIANTS}
    forward["cudnn"] = lambda: sdpa_forward(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)
    forward["sdpa_flash"] = lambda: sdpa_forward(SDPBackend.FLASH_ATTENTION)(q, k, v, causal)
    both = {f"ours_{variant}": ours_forward_backward(variant, q, k, v, do, causal) for variant in TIMED_VARIANTS}
    both["cudnn"] = sdpa_forward_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal)
    both["sdpa_flash"] = sdpa_forward_backward(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal)
    sections = [("forward", forward, flops), ("forward_backward", both, 3.5 * flops)]
    if d == 64:  # the backward alone, each dQ scheme, from the shipped forward's O and L
        bwd_tile = flash_gluon_bwd.tile_for(d)
        backward = {f"gluon_bwd_split_dq_{split}": (lambda t=dataclasses.replace(bwd_tile, split_dq=split):
                    flash_gluon_bwd.flash_backward_gluon(q, k, v, one_tile_out, do, one_tile_lse, causal, tile=t))
                    for split in (True, False)}
        sections.append(("backward", backward, 2.5 * flops))
    rows = []
    for section, providers, section_flops in sections:
        times = {}
        for provider, fn in providers.items():
            row = timed_row({"section": section, **base, "provider": provider}, fn, section_flops)
            if section == "forward" and provider == "gluon_persistent":
                row["o_max_abs_diff_vs_one_tile"] = (fn()[0].float() - one_tile_out.float()).abs().max().item()
            if "ms" in row:
                times[provider] = row["ms"]
            rows.append(row)
            shown = f"{row['ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s" if "ms" in row else row["error"]
            print(f"time {section} {name} {provider}: {shown}", flush=True)
        for row in rows:
            if row["section"] == section and "ms" in row and "cudnn" in times:
                row["ratio_vs_cudnn"] = row["ms"] / times["cudnn"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    parser.add_argument("--only-checks", action="store_true", help="skip the timing")
    parser.add_argument("--case-timeout", type=float, default=180.0,
                        help="seconds one check row or one timing shape may take before the run is ended (hang)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm_{props.major}{props.minor} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    prov = provenance("cuda")
    rows = []
    start = time.time()

    def record(new_rows):
        """Each row pulled under the watchdog, then the CSV rewritten: a watchdog exit keeps what was measured."""
        for row in watched(new_rows, args.case_timeout):
            rows.append(row)
            write_rows([{**row, **prov} for row in rows], args.out)

    for checks in (exact_rows, float_rows):
        record(checks())
    failed = [row for row in rows if not row["ok"]]
    print(f"checks: {len(failed)} failed of {len(rows)}; {time.time() - start:.0f} s", flush=True)
    if failed:
        print("FAIL: a wrong result; nothing timed", flush=True)
        sys.exit(1)
    if not args.only_checks:
        for shape in SHAPES:  # one shape's rows under one watchdog (the ratios need its whole section)
            faulthandler.dump_traceback_later(args.case_timeout, exit=True)
            shape_rows = time_shape(*shape)
            faulthandler.cancel_dump_traceback_later()
            record(shape_rows)
            torch.cuda.empty_cache()
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
