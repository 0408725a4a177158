"""Issue #26 at head dim 128: is the persistent Gluon forward faster than the one-tile forward TILES[128] ships?

    python results/diagnosis/flash_gluon_d128_forward.py [--out-dir DIR] [--rounds 5]

Stage 3 (results/diagnosis/flash_gluon_stage3/, 0037fdf) timed the two d=128 forwards at two shapes only: the
persistent one 0.91-0.94x the one-tile one at 4 x 32 x 4096 causal, even at the 8B shape; it stayed unshipped for
the noise of its forward+backward. Since then the d=64 search shipped the persistent forward there (flash_gluon_d64.py,
NOTES "d=64 tiles"), and the grid's d=128 points that take Gluon are mostly short ones, where a persistent grid
saves a CTA launch and the barrier setup per tile. Both compile for sm_90 with 0 B spilled (`python -m
cs336_systems.bench.flash_gluon_resources --head-dims 128 --no-exact --persistent both`: 164,208 / 197,024 B shared).

Checks first (the run stops, nothing timed, if one fails): each variant's EXACT O bit for bit on 2 x 30 heads x 1500
rows (persistent programs walk several tiles), causal or not, three launches; O and L on 777 queries x 1000 keys in
the model's strides against float64, causal or not (O within 2x PyTorch's own bf16 error + 2e-3, L within 1e-3).
Then the forward alone at seven of flash_llm_shapes' d=128 Gluon points, from the rule's edge (2^27 scores) to the 8B
shape, beside cuDNN, in `--rounds` interleaved rounds (flash_gluon_d64's timer: do_bench medians, the order rotated
per round). Rows to DIR/flash_gluon_d128_forward.csv with provenance; a summary per shape at the end.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from flash_gluon_d64 import do_bench_ms, interleaved_rows, summary
from flash_gluon_stage2 import fresh, rel_err, watched
from flash_gluon_stage3 import exact_forward_case, sdpa_forward

from cs336_systems.kernels import flash_gluon
from cs336_systems.model.attention import attention_scores, naive_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

HEAD_DIM = 128
SHIPPED = flash_gluon.tile_for(HEAD_DIM)
VARIANTS = {"shipped_one_tile_s2" if not SHIPPED.persistent else "shipped": SHIPPED,
            "persistent_s2": dataclasses.replace(SHIPPED, num_slots=2, persistent=True)}
# (name, batch, heads, seq, causal): flash_llm_shapes' d=128 points that take Gluon (flash_dispatch: from 1024 keys
# and 2^27 scores), short to long
SHAPES = [("8x32x1024_causal", 8, 32, 1024, True), ("2x32x2048_causal", 2, 32, 2048, True),
          ("1x16x4096", 1, 16, 4096, False), ("4x32x4096_causal", 4, 32, 4096, True),
          ("1x16x16384_causal", 1, 16, 16384, True), ("2x32x8192", 2, 32, 8192, False),
          ("8B_2x32x32768_causal", 2, 32, 32768, True)]


def check_rows():
    for causal in (True, False):
        q, k, v, expected = exact_forward_case((2, 30, 1500, HEAD_DIM), causal)
        for name, tile in VARIANTS.items():
            mismatches = [int((flash_gluon._forward(q, k, v, causal, exact=True, tile=tile)[0] != expected).sum())
                          for _ in range(3)]
            yield {"section": "exact", "case": "2x30x1500", "causal": causal, "variant": name,
                   "mismatches": str(mismatches), "ok": not any(mismatches)}
    for causal in (True, False):
        q, k, v = (fresh(shape, model_layout=True) for shape in ((2, 3, 777, HEAD_DIM), (2, 3, 1000, HEAD_DIM),
                                                                   (2, 3, 1000, HEAD_DIM)))
        ref = naive_attention(q.double(), k.double(), v.double(), causal)
        ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
        own = rel_err(naive_attention(q, k, v, causal), ref)
        for name, tile in VARIANTS.items():
            out, lse = flash_gluon._forward(q, k, v, causal, tile=tile)
            err, lse_err = rel_err(out, ref), (lse.double() - ref_lse).abs().max().item()
            yield {"section": "check", "case": "q777_k1000", "causal": causal, "variant": name, "o_rel_err": err,
                   "torch_own_rel_err": own, "l_max_abs_err": lse_err,
                   "ok": bool(torch.isfinite(out).all() and err < 2 * own + 2e-3 and lse_err < 1e-3)}


def shape_rows(name, batch, heads, seq, causal, rounds: int, rep_ms: int):
    from torch.nn.attention import SDPBackend

    q, k, v = (fresh((batch, heads, seq, HEAD_DIM), model_layout=True) for _ in range(3))
    fns = {n: (lambda t=t: flash_gluon._forward(q, k, v, causal, tile=t)) for n, t in VARIANTS.items()}
    fns["cudnn"] = lambda: sdpa_forward(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)
    for fn in fns.values():  # compiles before timing
        fn()
    torch.cuda.synchronize()
    base = {"case": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": HEAD_DIM, "causal": causal,
            "dtype": "bfloat16", "pass": "forward"}
    flops = 4.0 * batch * heads * seq * seq * HEAD_DIM / (2 if causal else 1)
    yield from interleaved_rows(base, fns, next(iter(VARIANTS)), rounds, flops, lambda fn: do_bench_ms(fn, rep_ms))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.environ.get("OUT"), help="folder for the CSV (default: $OUT)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per shape")
    parser.add_argument("--rep-ms", type=int, default=150, help="do_bench's timing window per measurement (ms)")
    parser.add_argument("--case-timeout", type=float, default=180.0, help="seconds per case before the run ends")
    args = parser.parse_args(argv)
    if not args.out_dir:
        parser.error("--out-dir is required when $OUT is not set")
    if args.rounds < 1 or args.rep_ms < 1:
        parser.error(f"--rounds and --rep-ms must be at least 1, got {args.rounds} and {args.rep_ms}")
    out = Path(args.out_dir) / "flash_gluon_d128_forward.csv"
    prov, rows, start = provenance("cuda"), [], time.time()

    def record(new_rows):
        for row in watched(new_rows, args.case_timeout):
            rows.append(row)
            if row["section"] != "timing_round":
                print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()
                       if k in ("section", "case", "causal", "variant", "provider", "ms", "mismatches", "o_rel_err",
                                "torch_own_rel_err", "l_max_abs_err", "ok", "ratio_vs_cudnn", "ratio_vs_shipped")},
                      flush=True)
            write_rows([{**r, **prov} for r in rows], out)

    record(check_rows())
    failed = [r for r in rows if not r["ok"]]
    print(f"checks: {len(failed)} failed of {len(rows)}", flush=True)
    if failed:
        sys.exit(1)
    for shape in SHAPES:
        record(shape_rows(*shape, rounds=args.rounds, rep_ms=args.rep_ms))
        torch.cuda.empty_cache()
    print("\n".join(["summary (median over rounds, min-max beside):", *summary(rows)]), flush=True)
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
