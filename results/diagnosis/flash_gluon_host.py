"""Where the Gluon path's host time goes at the grid's mid-size points (issue #26's median target).

    python results/diagnosis/flash_gluon_host.py --out-dir DIR [--shapes 1x16x4096x64 2x32x2048x128c ...]

`flash_short_calls.py --fa2-too` (H100, 8d42203) found ours with the Gluon kernels (as "auto" picks them) at
1.37-1.50 ms forward+backward at five mid-size points where the same calls with both passes forced to FA2 took
0.68-0.91 ms and cuDNN 0.68-0.89, while the Gluon kernels' summed device time (0.56-0.84 ms) was cuDNN's. A call that
takes its host time plus its device time, rather than the larger of the two, is one whose host waits for the device
somewhere. This looks for such a wait, per shape, forced Gluon against forced FA2, in one run:
- `blocks_ms`: each host piece of the Gluon forward and backward (and FA2's whole passes) timed alone with ~20 ms of
  matmuls queued ahead of it: a piece that waits for the device takes ~20 ms, one that does not takes microseconds;
- `issue_us` / `sync_us` / `bench_ms`: forward+backward through the autograd Function as flash_short_calls times it;
- the CUDA runtime and driver calls of 10 forward+backward calls (torch.profiler's key averages, so a
  synchronisation or a pageable copy shows by name) into DIR/runtime_{variant}_{shape}.txt;
- a cProfile of 50 forward+backward calls (top functions by own time) into DIR/profile_{variant}_{shape}.txt.
Rows go to DIR/gluon_host.csv with provenance.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_short_calls import issue_us, parse_shape, sync_us, tensors  # noqa: E402

from cs336_systems.kernels import flash_dispatch, flash_gluon, flash_gluon_bwd  # noqa: E402
from cs336_systems.kernels.flash_triton import (FlashAttentionTriton, flash_backward_triton,  # noqa: E402
                                                flash_forward_triton)
from cs336_systems.kernels.settings import use_flash_settings  # noqa: E402
from cs336_systems.provenance import provenance  # noqa: E402
from cs336_systems.results import write_rows  # noqa: E402
from cs336_systems.timing import bench_ms  # noqa: E402

SHAPES = [(1, 16, 4096, 64, False), (2, 32, 2048, 128, True), (8, 32, 1024, 128, True)]


def blocking_ms(piece, n=5, queued_ms: float = 20.0) -> float:
    """Median host time of `piece()` with about `queued_ms` of matmuls queued ahead of it, not waited for."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        for _ in range(max(1, int(queued_ms / 1.5))):  # an 8192^3 bf16 matmul: ~1.4 ms on an H100
            torch.mm(a, a)
        start = time.perf_counter()
        piece()
        samples.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return sorted(samples)[n // 2]


def pieces(q, k, v, do, causal):
    """The Gluon passes' host pieces, each runnable alone (inputs detached, outputs fresh at each call), and FA2's."""
    qd, kd, vd, dod = (t.detach() for t in (q, k, v, do))
    o, lse = flash_gluon.flash_attention_gluon_forward(qd, kd, vd, causal)
    q4, k4, v4, o4, do4 = map(flash_gluon._as_4d, (qd, kd, vd, o, dod))
    lse4 = torch.empty_like(lse)
    fwd_args, fwd_grid, fwd_options = flash_gluon.kernel_launch(q4, k4, v4, torch.empty_like(q4), lse4, causal)
    tile = flash_gluon_bwd.tile_for(q.shape[-1])
    batch, heads, n_queries, dim = q4.shape
    n_pad = flash_gluon_bwd.padded_queries(n_queries, tile)
    lse2, delta = (torch.empty(batch * heads, n_pad, dtype=torch.float32, device=q.device) for _ in range(2))
    dq_acc = torch.zeros(batch, heads, n_queries, dim, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k4), torch.empty_like(v4)
    scale = dim**-0.5
    bwd_args, bwd_grid, bwd_options = flash_gluon_bwd.kernel_launch(q4, k4, v4, do4, dk, dv, dq_acc, lse2, delta,
                                                                    causal, scale)
    return {
        "gluon_forward": lambda: flash_dispatch.gluon_forward(qd, kd, vd, causal, chosen=True),
        "gluon_forward_kernel_launch": lambda: flash_gluon.kernel_launch(q4, k4, v4, o4, lse4, causal),
        "gluon_forward_launch": lambda: flash_gluon._LAUNCHER(fwd_grid, *fwd_args, **fwd_options),
        "gluon_forward_choice": lambda: flash_dispatch.choose_forward(qd, kd, vd, causal),
        "gluon_backward": lambda: flash_dispatch.gluon_backward(qd, kd, vd, o, lse, dod, causal, chosen=True),
        "gluon_backward_choice": lambda: flash_dispatch.choose_backward(qd, kd, vd, o, lse, dod, causal),
        "gluon_backward_kernel_launch": lambda: flash_gluon_bwd.kernel_launch(q4, k4, v4, do4, dk, dv, dq_acc, lse2,
                                                                              delta, causal, scale),
        "gluon_backward_launch": lambda: flash_gluon_bwd._LAUNCHER(bwd_grid, *bwd_args, **bwd_options),
        "gluon_backward_dq_accumulator": lambda: flash_gluon_bwd._dq_accumulator(q4),
        "fa2_forward": lambda: flash_forward_triton(qd, kd, vd, causal),
        "fa2_backward": lambda: flash_backward_triton(qd, kd, vd, o, lse, dod, causal),
    }


def runtime_calls(call, path: Path, n=10) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60))


def python_profile(call, path: Path, n=50) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES,
                        help="BxHxNxD, a trailing c for causal (default: three of the grid's mid-size Gluon points)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prov = provenance("cuda")
    rows = []
    for shape in args.shapes:
        batch, heads, seq, dim, causal = shape
        q, k, v, do = tensors(batch, heads, seq, dim)
        name = f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}"
        base = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal}
        for piece, call in pieces(q, k, v, do, causal).items():
            for _ in range(3):
                call()
            rows.append({**base, "variant": piece, "measure": "blocks_ms", "value": blocking_ms(call), **prov})
            print(name, piece, f"{rows[-1]['value']:.3f} ms with 20 ms queued", flush=True)
        for variant in ("gluon", "triton"):
            with use_flash_settings(forward=variant, backward=variant):
                def both():
                    FlashAttentionTriton.apply(q, k, v, causal).backward(do)
                    q.grad = k.grad = v.grad = None

                for _ in range(20):
                    both()
                for measure, value in (("bench_ms", bench_ms(both, q.device, 100, 300, min_calls=10)),
                                       ("sync_us", sync_us(both)), ("issue_us", issue_us(both))):
                    rows.append({**base, "variant": f"{variant}_forward_backward", "measure": measure,
                                 "value": value, **prov})
                    print(name, variant, measure, f"{value:.3f}", flush=True)
                runtime_calls(both, args.out_dir / f"runtime_{variant}_{name}.txt")
                python_profile(both, args.out_dir / f"profile_{variant}_{name}.txt")
        write_rows(rows, args.out_dir / "gluon_host.csv")


if __name__ == "__main__":
    main()
