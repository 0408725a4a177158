"""What one tile costs the persistent Gluon forward beyond its key steps, causal and not (issue #26: d=128 forward
at or below 0.9x cuDNN).

    python results/diagnosis/flash_gluon_tile_overhead.py --out FILE.csv [--head-dim 128]

In the f634041 grid the d=128 causal forward climbs from ~510 TFLOP/s at 2048 keys to ~660 at 32768, while the
non-causal one is flat at ~620-660 from 4096 keys. A causal tile of 128 queries visits as many key tiles as its
rank, 32.5 on average at 8192 keys, so a fixed cost per tile weighs twice as much there as in a non-causal tile at
the same length. Fitting the grid's causal points to (steps + c) per tile gives c ~2.5-3.8 key steps, where the
non-causal points leave room for ~1 at most: is the cost per tile larger when causal, or is it something else?

This times the Gluon forward's kernel (torch.profiler device time, mean of 10 calls; the kernel alone, no host)
at two families of shapes, each holding ~1,056 tiles (8 per SM of an H100):
- non-causal, one query tile per head (128 queries, 33 x 32 heads), keys 128 to 8192: every tile 1 to 64 steps;
- the same with 1,024 queries per head (8 tiles, 132 heads);
- causal, n queries = n keys from 1024 to 32768, batch x heads shrunk as n grows (1,024-1,056 tiles).
For each it writes the kernel time, the tiles, the key steps (sum over tiles), and the device time per key step
per SM; then a least-squares fit of time x SMs = a * steps + b * tiles per family: b / a is the cost of a tile in
key steps. cuDNN's forward at the same shapes is timed beside it. Rows go to --out with provenance.
"""

import argparse
import statistics
from pathlib import Path

import torch

from cs336_systems.kernels import flash_gluon
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

ROWS = BLOCK_N = 128  # the d=64 and d=128 tiles' query rows per program and key tile
# (family, batch, heads, queries, keys, causal)
SHAPES = ([("noncausal_1tile", 33, 32, 128, n, False) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
          + [("noncausal_8tiles", 132 // 32 + 1, 32, 1024, n, False) for n in (128, 256, 512, 1024, 2048, 4096)]
          + [("causal", max(1, 1056 // (n // ROWS) // 32), min(32, 1056 // (n // ROWS)), n, n, True)
             for n in (1024, 2048, 4096, 8192, 16384, 32768)])


def kernel_ms(call, name: str, n: int = 10) -> float:
    """Mean device time per call of the kernels whose name contains `name`."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name]
    return sum(e.device_time for e in events) / n / 1e3


def steps_and_tiles(batch, heads, n_q, n_k, head_dim, causal) -> tuple[int, int]:
    tile = flash_gluon.tile_for(head_dim)
    n_q_tiles = -(-n_q // tile.rows)
    steps = sum(flash_gluon.key_tiles(t, n_q, n_k, tile, causal) for t in range(n_q_tiles)) * batch * heads
    return steps, n_q_tiles * batch * heads


def fit(rows: list[dict], provider: str) -> tuple[float, float]:
    """Least squares of time x SMs = a * steps + b * tiles over `rows` of `provider`: (a, b) in us."""
    xs = [(r["steps"], r["tiles"], r["kernel_ms"] * 1e3 * r["sms"]) for r in rows if r["provider"] == provider]
    s11 = sum(x * x for x, _, _ in xs)
    s12 = sum(x * y for x, y, _ in xs)
    s22 = sum(y * y for _, y, _ in xs)
    t1 = sum(x * t for x, _, t in xs)
    t2 = sum(y * t for _, y, t in xs)
    det = s11 * s22 - s12 * s12
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    args = parser.parse_args()
    prov = provenance("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for family, batch, heads, n_q, n_k, causal in SHAPES:
        q = torch.randn(batch, heads, n_q, args.head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, heads, n_k, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        steps, tiles = steps_and_tiles(batch, heads, n_q, n_k, args.head_dim, causal)
        calls = {
            "gluon": (lambda: flash_gluon.flash_attention_gluon_forward(q, k, v, causal), "flash_fwd_gluon"),
            "sdpa_cudnn": (lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, causal, False), ""),  # its only kernel
        }
        for provider, (call, name) in calls.items():
            ms = kernel_ms(call, name)
            flops = 4 * args.head_dim * steps * ROWS * BLOCK_N  # as computed, diagonal tiles whole
            row = {"family": family, "provider": provider, "batch": batch, "heads": heads, "n_queries": n_q,
                   "n_keys": n_k, "head_dim": args.head_dim, "causal": causal, "tiles": tiles, "steps": steps,
                   "sms": sms, "kernel_ms": ms, "us_per_step_per_sm": ms * 1e3 * sms / steps,
                   "executed_tflops": flops / ms / 1e9, **prov}
            print(f"{family:17s} {provider:10s} {batch}x{heads}x{n_q}x{n_k} tiles={tiles} steps={steps} "
                  f"{ms:.4f} ms {row['us_per_step_per_sm']:.3f} us/step/SM {row['executed_tflops']:.0f} TFLOP/s",
                  flush=True)
            rows.append(row)
        q = k = v = None  # freed before the next shape
    for family in dict.fromkeys(r["family"] for r in rows):
        a, b = fit([r for r in rows if r["family"] == family], "gluon")
        print(f"fit {family}: {a:.3f} us per key step, {b:.3f} us per tile = {b / a:.2f} key steps", flush=True)
        rows.append({"family": family, "provider": "gluon_fit", "head_dim": args.head_dim, "us_per_step_per_sm": a,
                     "us_per_tile_per_sm": b, "tile_in_steps": b / a, "sms": sms, **prov})
    print("median us/step/SM, gluon:", statistics.median(r["us_per_step_per_sm"] for r in rows
                                                            if r["provider"] == "gluon"))
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
