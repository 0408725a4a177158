"""Stage 1 of issue #26 on one GPU: is the Gluon forward (kernels/flash_gluon.py) correct, and how fast is it
against SDPA's cuDNN and flash backends, in the same run?

    python results/diagnosis/flash_gluon_stage1.py --out flash_gluon_stage1.csv [--triton] [--groups 1 64]

Checks (as tests/test_flash_gluon.py, on fresh random inputs): O against a float64 reference, its error within
2x (+2e-3) of PyTorch's own attention in the same dtype, L within 1e-3, and O and L against our Triton
FlashAttention-2 forward; the EXACT pipeline (integer inputs, P = S mod 8, bit for bit on 3 launches).
Timing: `triton.testing.do_bench` medians of the forward at the issue's shapes, bf16, contiguous
(batch, heads, seq, dim) inputs, with each provider's max abs error against float64 on two sampled heads.
TFLOP/s counts 4 n_q n_k d per head, halved when causal. One long-format CSV row per measurement, with provenance.
Exits 1 if a check fails.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton

from cs336_systems.kernels import flash_gluon
from cs336_systems.kernels.flash_triton import flash_forward_triton, pinned_tiles
from cs336_systems.model.attention import attention_scores, naive_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

# (name, batch, heads, seq, head dim, causal)
SHAPES = [
    ("leaderboard", 1, 16, 16384, 64, True),
    ("8b_attention", 2, 32, 32768, 128, True),
    ("4x32x4096_d128_causal", 4, 32, 4096, 128, True),
    ("8x16x2048_d64", 8, 16, 2048, 64, False),
    ("probe_4x16x4096_d128", 4, 16, 4096, 128, False),
]
# (q shape, k shape, causal, model layout): lengths off the tiles, one query, rectangular both ways, 3-d inputs
CHECKS = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False),
    ((2, 3, 777, 128), (2, 3, 777, 128), False, True),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, False),
    ((1, 4, 1000, 64), (1, 4, 300, 64), True, True),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False),
    ((3, 1, 64), (3, 1, 64), True, False),
    ((2, 257, 128), (2, 257, 128), True, False),
    ((1, 2, 4096, 128), (1, 2, 4096, 128), True, True),
]

FA2_TILE = (64, 32, 4, 2)  # tests/test_flash.py's GPU_TEST_TILE


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1.0)).item()


def fresh(shape, model_layout=False, dtype=torch.bfloat16):
    t = torch.randn(shape, device="cuda", dtype=torch.float64)
    if model_layout:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(dtype)


def check_rows():
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for q_shape, k_shape, causal, model_layout in CHECKS:
            q, k, v = fresh(q_shape, model_layout, dtype), fresh(k_shape, model_layout, dtype), fresh(k_shape, model_layout, dtype)
            out, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
            ref = naive_attention(q.double(), k.double(), v.double(), causal)
            ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
            with pinned_tiles(FA2_TILE, FA2_TILE):  # one config: autotuning each case's bucket takes minutes
                fa2_out, fa2_lse = flash_forward_triton(q, k, v, causal)
            err, own = rel_err(out, ref), rel_err(naive_attention(q, k, v, causal), ref)
            limit = 2 * own + 2e-3
            lse_err = (lse.double() - ref_lse).abs().max().item()
            row = {"section": "check", "case": f"q{list(q_shape)} k{list(k_shape)}", "causal": causal,
                   "model_layout": model_layout, "dtype": str(dtype).removeprefix("torch."),
                   "o_rel_err": err, "torch_own_rel_err": own, "limit": limit, "l_max_abs_err": lse_err,
                   "fa2_o_rel_err": rel_err(fa2_out, ref), "diff_vs_fa2_o": rel_err(out, fa2_out.double()),
                   "diff_vs_fa2_l": (lse - fa2_lse).abs().max().item(),
                   "strides_kept": out.stride() == q.stride()}
            row["ok"] = bool(torch.isfinite(out).all() and err < limit and lse_err < 1e-3
                             and row["diff_vs_fa2_o"] < limit and row["diff_vs_fa2_l"] < 1e-3 and row["strides_kept"])
            rows.append(row)
            print(f"check {row['case']} causal={causal} {row['dtype']} layout={'model' if model_layout else 'bhnd'}: "
                  f"O {err:.2e} (torch own {own:.2e}, FA2 {row['fa2_o_rel_err']:.2e}) L {lse_err:.1e} "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    for head_dim in (64, 128):
        for causal in (True, False):
            shape = (2, 3, 1500, head_dim)
            q, k = (torch.randint(-1, 2, shape, device="cuda").to(torch.bfloat16) for _ in range(2))
            v = (torch.randint(-1, 2, shape, device="cuda") * (torch.rand(shape, device="cuda") < 0.25)).to(torch.bfloat16)
            s = q.double() @ k.double().transpose(-1, -2)
            p = s - torch.floor(s / 8) * 8
            if causal:
                p = p.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), 0.0)
            expected = (p @ v.double()).to(torch.bfloat16)
            mismatches = []
            for _ in range(3):
                out, _ = flash_gluon._forward(q, k, v, causal, exact=True)
                mismatches.append(int((out != expected).sum()))
            rows.append({"section": "exact", "case": f"{list(shape)}", "causal": causal, "dtype": "bfloat16",
                         "mismatches": str(mismatches), "ok": not any(mismatches)})
            print(f"exact {list(shape)} causal={causal}: mismatches per launch {mismatches}", flush=True)
    return rows


def sampled_reference(q, k, v, causal, heads):
    """float64 O of the sampled (batch, head) pairs."""
    return {bh: naive_attention(q[bh].double(), k[bh].double(), v[bh].double(), causal) for bh in heads}


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def time_rows(with_triton: bool, groups: list[int]):
    from torch.nn.attention import SDPBackend

    providers = {"gluon": lambda q, k, v, c: flash_gluon.flash_attention_gluon_forward(q, k, v, c)[0],
                 "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    for group in groups:  # another program order: HEADS_PER_GROUP overridden
        providers[f"gluon_group{group}"] = lambda q, k, v, c, g=group: flash_gluon._forward(q, k, v, c, group=g)[0]
    if with_triton:
        providers["flash_triton"] = lambda q, k, v, c: flash_forward_triton(q, k, v, c)[0]
    rows = []
    for name, batch, heads, n, d, causal in SHAPES:
        q, k, v = (fresh((batch, heads, n, d)) for _ in range(3))
        sample = [(0, 0), (batch - 1, heads - 1)]
        ref = sampled_reference(q, k, v, causal, sample)
        flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
        times = {}
        default_group = flash_gluon.heads_per_group(n, causal, flash_gluon.tile_for(d).persistent)
        for provider, fn in providers.items():
            row = {"section": "timing", "case": name, "default_group": default_group, "batch": batch, "heads": heads, "seq": n, "head_dim": d,
                   "causal": causal, "dtype": "bfloat16", "provider": provider}
            try:
                out = fn(q, k, v, causal)
                torch.cuda.synchronize()
                err = max((out[bh].double() - ref[bh]).abs().max().item() for bh in sample)
                ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=25, rep=200, return_mode="median")
                del out
            except Exception as error:  # a backend torch refuses at this shape is a row, not the end of the run
                rows.append({**row, "error": f"{type(error).__name__}: {error}"[:300]})
                print(f"time {name} {provider}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            times[provider] = ms
            rows.append({**row, "ms": ms, "tflops": flops / ms * 1e-9, "max_abs_err": err})
        for row in rows:
            if row.get("case") == name and "ms" in row:
                for other in ("cudnn", "sdpa_flash"):
                    if other in times:
                        row[f"ratio_vs_{other}"] = row["ms"] / times[other]
        shown = "  ".join(f"{p} {t:.3f} ms" for p, t in times.items())
        ratio = f"{times['gluon'] / times['cudnn']:.3f}x cuDNN" if {"gluon", "cudnn"} <= set(times) else ""
        print(f"time {name}: {shown}  gluon = {ratio}", flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    parser.add_argument("--triton", action="store_true", help="also time our Triton FA2 forward (autotunes per shape)")
    parser.add_argument("--groups", nargs="*", type=int, default=[],
                        help="also time the Gluon kernel with these HEADS_PER_GROUP (program order) overrides")
    parser.add_argument("--only-timing", action="store_true", help="skip the checks")
    parser.add_argument("--only-checks", action="store_true", help="skip the timing")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    prov = provenance("cuda")
    rows = []
    start = time.time()
    if not args.only_timing:
        rows += check_rows()
        write_rows([{**row, **prov} for row in rows], args.out)
        print(f"checks done in {time.time() - start:.0f} s", flush=True)
    if not args.only_checks:
        rows += time_rows(args.triton, args.groups)
        write_rows([{**row, **prov} for row in rows], args.out)
    failed = [row for row in rows if row["section"] != "timing" and not row["ok"]]
    print(f"{len(failed)} failed checks; {time.time() - start:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
