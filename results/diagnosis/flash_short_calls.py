"""Why our attention is slower than SDPA flash at short calls (issue #26: "never slower than SDPA flash").

    python results/diagnosis/flash_short_calls.py --out-dir DIR [--shapes 1x16x4096x64 2x32x2048x128c ...] [--fa2-too]
        [--floor]

`flash_llm_shapes` at 69bcc27 (H100) has ours (eager, FA2 path) slower than SDPA flash at 12 forward+backward
points, all below 2^28 scores, where every provider is host-bound. `flash_host_floor.py` put our eager forward
at ~60 us of issue time and forward+backward at ~475 us at 1 x 16 x 1024 x 128, where the same Python with its
launches stubbed costs ~40 us on a CPU: the backward's host time on the H100 is not accounted for. Its issue
time was measured over 200 unsynchronised calls, which at ~8 launches a call can fill CUDA's launch queue, so
some of it may have been device time. This measures, per shape and provider (ours eager; SDPA flash; SDPA cuDNN),
forward+backward, in one run:
- `bench_ms`: the grid's statistic (do_bench median, L2 flushed between calls);
- `sync_us`: wall time per call with a synchronisation after each (median of 200 calls);
- `issue_us`: host time per call over 20 unsynchronised calls (too few to fill the launch queue);
- `kernel_us`: the summed duration of the call's kernels, from torch.profiler (mean over 10 calls);
and the same for ours and SDPA flash with autograd's device threads off (`torch.autograd.set_multithreading_enabled(
False)`: the backward runs on the calling thread, no hand-off to the engine's CUDA thread). torch.profiler traces of 5 calls each go
to DIR/traces/ (chrome trace JSON), rows to DIR/short_calls.csv with provenance. `--floor` adds `host_floor`:
`HostFloor`, a Python autograd.Function that allocates what ours allocates and launches nothing, the least that any
attention written as a Python Function costs a host-bound call; where it is not below SDPA flash, no Python path can
be, and only a C++ autograd node could.
"""

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from flash_host_floor import host_us  # this folder is on sys.path as a script's

from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.kernels.settings import use_flash_settings
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

# (batch, heads, seq, head_dim, causal): the grid's points where ours was slower than SDPA flash at 69bcc27,
# one per (head dim, length) and both masks at the worst one
SHAPES = [(1, 16, 1024, 128, True), (1, 16, 512, 128, False), (1, 16, 512, 64, True), (1, 16, 1024, 64, False),
          (1, 16, 2048, 64, True), (4, 16, 1024, 64, True)]
PROVIDERS = ("flash_triton", "sdpa_flash", "sdpa_cudnn")


def tensors(batch, heads, seq, dim):
    # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    return q, k, v, torch.randn_like(q)


def sync_us(call, n=200) -> float:
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def issue_us(call, n=20) -> float:
    """Host time per call over `n` unsynchronised calls (flash_host_floor.host_us, after its one warm call)."""
    return host_us(call, n)[0]


def kernel_us(call, trace: Path, n=10) -> float:
    """Mean summed kernel time per call (torch.profiler), and a chrome trace of the first 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for _ in range(5):
            call()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    with profile(activities=activities) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / n


def measure(name: str, call, shape, out_dir: Path, prov: dict, q) -> dict:
    for _ in range(20):
        call()
    batch, heads, seq, dim, causal = shape
    row = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal, "variant": name,
           "bench_ms": bench_ms(call, q.device, 100, 300, grad_to_none=[q], min_calls=10),
           "sync_us": sync_us(call), "issue_us": issue_us(call),
           "kernel_us": kernel_us(call, out_dir / "traces" / f"{name}_{batch}x{heads}x{seq}x{dim}_{int(causal)}.json"),
           **prov}
    print({key: row[key] for key in ("seq_len", "head_dim", "causal", "variant", "bench_ms", "sync_us", "issue_us",
                                     "kernel_us")}, flush=True)
    return row


class HostFloor(torch.autograd.Function):
    """What any attention written as a Python autograd.Function pays on the host before its kernels: the Function's
    forward and backward, saving its tensors, and the allocations ours makes (O and L; dQ, dK, dV and D), with no
    kernel launched. Its forward+backward time bounds from below every such Function's at host-bound calls."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(lse, q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # D
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """BxHxNxD with a trailing "c" for causal: "1x16x4096x64c"."""
    causal = text.endswith("c")
    try:
        batch, heads, seq, dim = (int(part) for part in text.rstrip("c").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write BxHxNxD, with a trailing c for causal") from None
    return batch, heads, seq, dim, causal


def rows_for(shape, out_dir: Path, prov: dict, fa2_too: bool = False, floor: bool = False) -> list[dict]:
    batch, heads, seq, dim, causal = shape
    q, k, v, do = tensors(batch, heads, seq, dim)
    rows = []
    for provider in (*PROVIDERS, *(["host_floor"] if floor else [])):
        fn = HostFloor.apply if provider == "host_floor" else get_attention(provider)

        def both(fn=fn):
            fn(q, k, v, causal).backward(do)
            q.grad = k.grad = v.grad = None

        rows.append(measure(provider, both, shape, out_dir, prov, q))
    for provider in ("flash_triton", "sdpa_flash", *(["host_floor"] if floor else [])):
        fn = HostFloor.apply if provider == "host_floor" else get_attention(provider)

        def single_thread(fn=fn):
            with torch.autograd.set_multithreading_enabled(False):
                fn(q, k, v, causal).backward(do)
            q.grad = k.grad = v.grad = None

        rows.append(measure(f"{provider}_no_device_threads", single_thread, shape, out_dir, prov, q))
    if fa2_too:  # ours with both passes forced to FA2, beside whatever "auto" chose above
        fn = get_attention("flash_triton")

        def fa2(fn=fn):
            with use_flash_settings(forward="triton", backward="triton"):
                fn(q, k, v, causal).backward(do)
            q.grad = k.grad = v.grad = None

        rows.append(measure("flash_triton_fa2", fa2, shape, out_dir, prov, q))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES,
                        help="BxHxNxD[c] each (default: the six short points of the 69bcc27 grid)")
    parser.add_argument("--fa2-too", action="store_true", help="also ours with both passes forced to FA2")
    parser.add_argument("--floor", action="store_true",
                        help="also HostFloor: a Python autograd.Function with ours' allocations and no kernels")
    args = parser.parse_args()
    (args.out_dir / "traces").mkdir(parents=True, exist_ok=True)
    prov = provenance("cuda")
    rows = []
    for shape in args.shapes:
        with contextlib.suppress(torch.OutOfMemoryError):
            rows += rows_for(shape, args.out_dir, prov, args.fa2_too, args.floor)
    write_rows(rows, args.out_dir / "short_calls.csv")


if __name__ == "__main__":
    main()
