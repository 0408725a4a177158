"""Three consumer warpgroups in the Gluon forward against the shipped two (issue #26; branch h-3wg).

    python results/diagnosis/flash_gluon_consumers.py --out FILE.csv [--shapes ...]

kernels/NOTES.md, "Where the d=128 forward's time goes": a consumer warpgroup spends X ~ 1,550 cycles per key step
outside its own GEMMs (G = 1,024 cycles at d=128 with 128-key tiles, 512 at d=64), so two warpgroups in ping-pong
keep the tensor pipe busy 2G / (G + X): 80% at d=128, 50% at d=64. With k warpgroups taking turns it is
min(1, kG / (G + X)). Three warpgroups fit the register file at 160 registers each, which needs 64-key tiles at
d=128 (S and P half as large; G and the exp2 per step halve too, the waits and barriers in X do not).

Candidates (GluonTile): the shipped tile of each head dim, and three-consumer tiles (192 query rows, 64 keys per
step). For each: EXACT (P = S mod 8, bit for bit against float64 rounded) causal and not, one-tile, persistent and
persistent on 3 programs; float64 error at awkward lengths against the shipped tile's; then the forward kernel's
device time (torch.profiler, mean of 10 calls) in alternating rounds beside cuDNN's. Rows go to --out.
"""

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from cs336_systems.kernels import flash_gluon
from cs336_systems.kernels.flash_gluon import TILES, GluonTile
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_gluon_tile_overhead import kernel_ms  # noqa: E402
from flash_short_calls import parse_shape  # noqa: E402

THREE = dict(block_n=64, consumer_registers=160, maxnreg=128, persistent=True, consumers=3)
CANDIDATES = {
    128: {"shipped": TILES[128], "c3_slots4": GluonTile(128, num_slots=4, **THREE),
          "c3_slots3": GluonTile(128, num_slots=3, **THREE)},
    64: {"shipped": TILES[64], "c3_slots6": GluonTile(64, num_slots=6, **THREE)},
}
SHAPES = ["1x16x16384x128", "1x16x16384x128c", "2x32x32768x128c", "2x32x8192x128", "4x32x4096x128c",
          "8x32x1024x128c", "1x16x16384x64c", "4x16x8192x64", "8x16x2048x64"]


def exact_mismatches(tile: GluonTile, causal: bool, programs: int | None) -> int:
    """test_gpu_exact_pipeline's check for one tile: 2 x 29 heads x 1500 rows, inputs in {-1, 0, 1}."""
    shape = (2, 29, 1500, tile.head_dim)
    q, k = (torch.randint(-1, 2, shape, device="cuda").to(torch.bfloat16) for _ in range(2))
    v = (torch.randint(-1, 2, shape, device="cuda") * (torch.rand(shape, device="cuda") < 0.25)).to(torch.bfloat16)
    s = q.double() @ k.double().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), 0.0)
    expected = (p @ v.double()).to(torch.bfloat16)
    real = flash_gluon.sm_count
    if programs is not None:
        flash_gluon.sm_count = lambda device: programs
    try:
        # fast_launch off: a plan (keyed by layout and tile, not by the grid) would replay another variant's grid
        return sum(int((flash_gluon._forward(q, k, v, causal, exact=True, tile=tile, fast_launch=False)[0]
                        != expected).sum()) for _ in range(2))
    finally:
        flash_gluon.sm_count = real


def float64_error(tile: GluonTile, q_len: int, k_len: int, causal: bool) -> tuple[float, float]:
    """Max |O - O_float64| and max |L - L_float64| on the model's layout."""
    d = tile.head_dim
    q, k, v = (torch.randn(2, n, 3, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for n in (q_len, k_len, k_len))
    s = (q.double() @ k.double().transpose(-1, -2)) * d**-0.5
    if causal:
        s = s.masked_fill(torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    out, lse = flash_gluon._forward(q, k, v, causal, tile=tile)
    return (out.double() - ref).abs().max().item(), (lse.double() - torch.logsumexp(s, -1)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prov = provenance("cuda")
    rows = []
    for d, tiles in CANDIDATES.items():
        for name, tile in tiles.items():
            for causal in (True, False):
                for variant, persistent, programs in (("one_tile", False, None), ("persistent", True, None),
                                                      ("persistent_3_programs", True, 3)):
                    t = dataclasses.replace(tile, persistent=persistent)
                    row = {"kind": "exact", "head_dim": d, "tile": name, "causal": causal, "variant": variant,
                           "mismatches": exact_mismatches(t, causal, programs), **prov}
                    print(row, flush=True)
                    rows.append(row)
            for q_len, k_len, causal in ((777, 777, True), (1000, 1000, False), (300, 1000, True),
                                         (1000, 300, True), (513, 129, False)):
                o_err, l_err = float64_error(tile, q_len, k_len, causal)
                row = {"kind": "float64", "head_dim": d, "tile": name, "causal": causal, "q_len": q_len,
                       "k_len": k_len, "o_err": o_err, "l_err": l_err, **prov}
                print(row, flush=True)
                rows.append(row)
    for batch, heads, seq, dim, causal in args.shapes:
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
        times = {name: [] for name in [*CANDIDATES[dim], "cudnn"]}
        for _ in range(args.rounds):
            for name, tile in CANDIDATES[dim].items():
                times[name].append(kernel_ms(lambda: flash_gluon._forward(q, k, v, causal, tile=tile),
                                             "flash_fwd_gluon"))
            times["cudnn"].append(kernel_ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, causal, False), ""))
        med = {name: statistics.median(values) for name, values in times.items()}
        for name in CANDIDATES[dim]:
            row = {"kind": "time", "batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                   "tile": name, "kernel_ms": med[name], "cudnn_ms": med["cudnn"],
                   "over_shipped": med[name] / med["shipped"], "over_cudnn": med[name] / med["cudnn"],
                   "rounds": " ".join(f"{t:.4f}" for t in times[name]), **prov}
            rows.append(row)
        print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}: "
              + ", ".join(f"{n} {m:.4f} ms ({m / med['cudnn']:.3f}x cuDNN)" for n, m in med.items()), flush=True)
        q = k = v = None
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
