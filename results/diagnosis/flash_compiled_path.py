"""What our attention does under torch.compile that it does not do eagerly, at points where compiled
forward+backward costs more than the compile overhead SDPA pays there.

    python results/diagnosis/flash_compiled_path.py --out-dir DIR [--shapes 2x32x2048x128c 4x16x2048x64c]

`flash_bench llm-shapes` at be4c1a6 (H100, 5 interleaved rounds, ours beside SDPA flash and cuDNN each eager and
compiled) had torch.compile add 0.3-0.5 ms per forward+backward to every provider at host-bound points, and nothing
to SDPA's where the device takes longer than that; ours at 2 x 32 x 2048 x 128 causal went from 0.651 to 1.108 ms
(SDPA cuDNN 0.627 -> 0.629). Per shape and mode (eager, compiled), this records:
- which kernel each pass chose (flash_dispatch.choose_forward / choose_backward, counted over the calls);
- the plans each pass kept (a plan cache that misses at every call would rebuild on the host each time);
- the CUDA kernels of 10 forward+backward calls (name, count, total us) and the CUDA runtime calls that can make the
  host wait (memcpy, synchronize, event sync), from torch.profiler;
- wall time per call with a synchronisation after each (median of 50) and the grid's do_bench statistic.
Writes DIR/compiled_path.txt (and prints it). With --forward-only, the calls are the grid's forward pass (no_grad)
instead: the grid at 569d72e had ours compiled at 1.02-1.11x eager in the forward at nine long d=128 points.
"""

import argparse
import collections
from pathlib import Path

import torch
from flash_short_calls import parse_shape, sync_us  # this folder is on sys.path as a script's

from cs336_systems.kernels import flash_dispatch
from cs336_systems.model.attention import get_attention
from cs336_systems.timing import bench_ms

WAITS = ("Memcpy", "Synchronize", "EventSynchronize", "StreamWaitEvent", "Memset")


def plan_counts() -> dict[str, int]:
    """Plans kept by each pass's module, for those already imported."""
    import sys

    counts = {}
    for name in ("cs336_systems.kernels.flash_gluon", "cs336_systems.kernels.flash_gluon_bwd"):
        module = sys.modules.get(name)
        if module is not None:
            counts[name.rsplit(".", 1)[1]] = len(module._PLANS)
    from cs336_systems.kernels import flash_triton

    counts["fa2_forward"] = len(flash_triton._FORWARD_PLANS)
    counts["fa2_backward"] = len(flash_triton._BACKWARD_PLANS)
    return counts


def report(shape, mode: str, fn, lines: list[str], forward_only: bool = False) -> None:
    batch, heads, seq, dim, causal = shape
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    do = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)

    def both():
        if forward_only:  # as the grid times the forward
            with torch.no_grad():
                fn(q, k, v, causal)
            return
        fn(q, k, v, causal).backward(do)
        q.grad = k.grad = v.grad = None

    for _ in range(5):
        both()
    torch.cuda.synchronize()
    choices = collections.Counter()
    chose_forward, chose_backward = flash_dispatch.choose_forward, flash_dispatch.choose_backward

    def counting(pass_, choose):
        def wrapped(*args, **kwargs):
            choice = choose(*args, **kwargs)
            choices[pass_, choice] += 1
            return choice
        return wrapped

    before = plan_counts()
    flash_dispatch.choose_forward = counting("forward", chose_forward)
    flash_dispatch.choose_backward = counting("backward", chose_backward)
    try:
        for _ in range(10):
            both()
        torch.cuda.synchronize()
    finally:
        flash_dispatch.choose_forward, flash_dispatch.choose_backward = chose_forward, chose_backward
    after = plan_counts()

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            both()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    runtime = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time
        elif event.name.startswith("cuda") and any(w in event.name for w in WAITS):
            runtime[event.name] += 1
    wall_ms = sync_us(both, n=50) / 1e3
    bench = bench_ms(both if forward_only else lambda: fn(q, k, v, causal).backward(do), q.device, 25, 100,
                     grad_to_none=[q, k, v], min_calls=10)
    lines.append(f"== {batch}x{heads}x{seq}x{dim} {'causal' if causal else 'not causal'}, {mode}"
                 + (", forward only" if forward_only else ""))
    lines.append(f"choices over 10 calls: {dict(choices)}")
    lines.append(f"plans before/after those 10 calls: {before} -> {after}")
    lines.append(f"sync wall ms (median of 50): {wall_ms:.3f}; do_bench ms: {bench:.3f}")
    lines.append("kernels over 10 calls (count, total us):")
    for name, (count, total) in sorted(kernels.items(), key=lambda item: -item[1][1]):
        lines.append(f"  {count:4d} {total:10.1f}  {name[:140]}")
    lines.append(f"runtime calls that can wait, over 10 calls: {dict(runtime)}")
    print("\n".join(lines[-(6 + len(kernels)):]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+",
                        default=[parse_shape("2x32x2048x128c"), parse_shape("4x16x2048x64c")])
    parser.add_argument("--forward-only", action="store_true", help="the grid's forward pass (no_grad) only")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    eager = get_attention("flash_triton")
    compiled = torch.compile(eager)
    lines: list[str] = []
    for shape in args.shapes:
        for mode, fn in (("eager", eager), ("compiled", compiled)):
            report(shape, mode, fn, lines, args.forward_only)
    (args.out_dir / "compiled_path.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
