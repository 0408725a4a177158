"""Longer key steps in the non-causal d=128 Gluon forward: a second, narrower S GEMM per step (issue #26).

    python results/diagnosis/flash_gluon_key_tail.py --out FILE.csv [--shapes ...] [--rounds N]

kernels/NOTES.md, "Where the d=128 forward's time goes": a consumer warpgroup spends X ~ 1,550 cycles of a
128-key step outside its own GEMMs (G = 1,024 cycles), so ping-pong keeps the tensor pipe busy 2G / (G + X), ~80%.
Part of X is paid once a step whatever its keys (the turn and slot waits, O's rescale, the row reductions' shuffles,
the GEMMs' issue), so a longer step spreads it over more work. FlashAttention-3 steps 176 keys at d=128 when the
call is not causal (its tile_size_fwd_sm90). A Gluon tensor's shape must be a power of two, so our longer steps are
128 keys and a tail of 16, 32 or 64 in a ring of its own (GluonTile.key_tail): the step's scores come from two
wgmmas, and so does P V. Shared memory holds two slots of 192 keys only without the persistent kernel's O buffers.

Candidates (GluonTile, d=128, non-causal): the shipped tile (persistent, 128 keys) and its one-tile twin; tails of
16 and 32 keys on the persistent grid; tails of 32 and 64 keys on the one-tile grid. For each: EXACT (P = S mod 8,
bit for bit) at lengths that leave a partial step, including a single step; float64 errors of O and L at awkward
lengths beside the shipped tile's; then the forward kernel's device time (torch.profiler, mean of 10 calls) in
alternating rounds beside cuDNN's, medians of the rounds. Rows go to --out with provenance.
"""

import argparse
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

SHIPPED = TILES[128]
CANDIDATES = {
    "shipped": SHIPPED,
    "one_tile": GluonTile(128, num_slots=2, persistent=False),
    "tail16_persistent": GluonTile(128, block_n=144, num_slots=2, persistent=True),
    "tail32_persistent": GluonTile(128, block_n=160, num_slots=2, persistent=True),
    "tail32_one_tile": GluonTile(128, block_n=160, num_slots=2, persistent=False),
    "tail64_one_tile": GluonTile(128, block_n=192, num_slots=2, persistent=False),
}
SHAPES = ["1x16x16384x128", "1x16x32768x128", "2x32x8192x128", "4x32x4096x128", "4x16x8192x128", "8x16x2048x128",
          "2x32x32768x128"]
# (queries, keys): partial last steps of every tail, one step only (100, 150: n_blk == 1), rectangular both ways
EXACT_LENGTHS = ((1500, 1500), (300, 1000), (1000, 100), (200, 150))
FLOAT64_LENGTHS = ((777, 777), (1000, 1000), (300, 1000), (1000, 300), (513, 129), (64, 150))


def exact_mismatches(tile: GluonTile, n_q: int, n_k: int, programs: int | None) -> int:
    """test_gpu_exact_pipeline's check for one tile, non-causal: 2 x 29 heads, inputs in {-1, 0, 1}."""
    q = torch.randint(-1, 2, (2, 29, n_q, 128), device="cuda").to(torch.bfloat16)
    k = torch.randint(-1, 2, (2, 29, n_k, 128), device="cuda").to(torch.bfloat16)
    v = (torch.randint(-1, 2, k.shape, device="cuda") * (torch.rand(k.shape, device="cuda") < 0.25)).to(torch.bfloat16)
    s = q.double() @ k.double().transpose(-1, -2)
    expected = ((s - torch.floor(s / 8) * 8) @ v.double()).to(torch.bfloat16)
    real = flash_gluon.sm_count
    if programs is not None:
        flash_gluon.sm_count = lambda device: programs
    try:
        # fast_launch off: a plan (keyed by layout and tile, not by the grid) would replay another variant's grid
        return sum(int((flash_gluon._forward(q, k, v, False, exact=True, tile=tile, fast_launch=False)[0]
                        != expected).sum()) for _ in range(2))
    finally:
        flash_gluon.sm_count = real


def float64_error(tile: GluonTile, q_len: int, k_len: int) -> tuple[float, float]:
    """Max |O - O_float64| and max |L - L_float64| on the model's layout, non-causal."""
    q, k, v = (torch.randn(2, n, 3, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for n in (q_len, k_len, k_len))
    s = (q.double() @ k.double().transpose(-1, -2)) * 128**-0.5
    ref = torch.softmax(s, -1) @ v.double()
    out, lse = flash_gluon._forward(q, k, v, False, tile=tile)
    return (out.double() - ref).abs().max().item(), (lse.double() - torch.logsumexp(s, -1)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prov = provenance("cuda")
    rows = []
    for name, tile in CANDIDATES.items():
        for n_q, n_k in EXACT_LENGTHS:
            for programs in ((None, 3) if tile.persistent else (None, )):
                row = {"kind": "exact", "tile": name, "block_n": tile.block_n, "persistent": tile.persistent,
                       "q_len": n_q, "k_len": n_k, "programs": programs or "all",
                       "mismatches": exact_mismatches(tile, n_q, n_k, programs), **prov}
                print(row, flush=True)
                rows.append(row)
        for q_len, k_len in FLOAT64_LENGTHS:
            torch.manual_seed(q_len * 7919 + k_len)  # the same inputs for every candidate
            o_err, l_err = float64_error(tile, q_len, k_len)
            row = {"kind": "float64", "tile": name, "block_n": tile.block_n, "persistent": tile.persistent,
                   "q_len": q_len, "k_len": k_len, "o_err": o_err, "l_err": l_err, **prov}
            print(row, flush=True)
            rows.append(row)
    for batch, heads, seq, dim, causal in args.shapes:
        if dim != 128 or causal:
            raise SystemExit(f"flash_gluon_key_tail: shapes are d=128 and non-causal, got {batch}x{heads}x{seq}x{dim}"
                             f"{'c' if causal else ''}")
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
        times = {name: [] for name in [*CANDIDATES, "cudnn"]}
        for _ in range(args.rounds):
            for name, tile in CANDIDATES.items():
                times[name].append(kernel_ms(lambda: flash_gluon._forward(q, k, v, False, tile=tile),
                                             "flash_fwd_gluon"))
            times["cudnn"].append(kernel_ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, False, False), ""))
        med = {name: statistics.median(values) for name, values in times.items()}
        for name, tile in CANDIDATES.items():
            rows.append({"kind": "time", "batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim,
                         "causal": causal, "tile": name, "block_n": tile.block_n, "persistent": tile.persistent,
                         "kernel_ms": med[name], "cudnn_ms": med["cudnn"], "over_shipped": med[name] / med["shipped"],
                         "over_cudnn": med[name] / med["cudnn"],
                         "rounds": " ".join(f"{t:.4f}" for t in times[name]),
                         "cudnn_rounds": " ".join(f"{t:.4f}" for t in times["cudnn"]), **prov})
        print(f"{batch}x{heads}x{seq}x{dim}: "
              + ", ".join(f"{n} {m:.4f} ms ({m / med['cudnn']:.3f}x cuDNN)" for n, m in med.items()), flush=True)
        q = k = v = None
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
