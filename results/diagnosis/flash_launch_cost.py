"""Where a short attention call's host time goes on the GPU machine, launch by launch (issue #26: "never slower
than SDPA flash").

    python results/diagnosis/flash_launch_cost.py --out FILE.csv [--shapes 1x2x128x64 1x16x1024x64c ...]

`flash_short_calls.py --floor` (c5baeaf) put ours' forward+backward 0.1-0.2 ms above `HostFloor` (a Python
Function with ours' allocations and no kernel) with autograd's device threads off, where the same Python with its
launches stubbed costs ~22 us on a CPU (`flash_plan_host.py`): most of the gap is in what a CPU cannot run, the
three FA2 launches. This times, on a GPU, the host cost of each piece of one call, in microseconds of issue time
(calls issued back to back, synchronised only between repeats; the median over repeats of the mean per call):
- `python_call`:      a no-op Python call (the timer's floor);
- `empty_like`:       one allocation as ours makes them;
- `aten_launch`:      one ATen kernel launch (`small.add_(1)`), the CUDA launch as torch's C++ makes it;
- `stream_lookup`:    the current device and stream, as `launch.lean_runner` asks them per launch;
- `fa2_fwd_runner`:   the FA2 forward's launch through its plan's bound runner, as a plan hit makes it (tensors);
- `fa2_fwd_runner_ints`: the same launch with each tensor passed as its data pointer: Triton's C launcher then
                      skips the `data_ptr()` call and the `cuPointerGetAttribute` check it makes per tensor;
- `ours_forward`, `sdpa_flash_forward`: one forward without autograd (ours' `flash_forward`; SDPA's flash op);
- `ours_fb`, `sdpa_flash_fb`, `floor_fb`: forward+backward through autograd (`floor_fb`: flash_short_calls'
                      HostFloor), each also with the device threads off (`_no_device_threads`).
At a shape whose kernels take a few microseconds, issue time is host time (column `host_us`). The calls are then
split (`backward_phases`): the Function's backward is wrapped to note when it starts and ends, and each call's
`.backward()` splits into `to_backward` (from `.backward()` until our backward starts: the hand-off to the device
thread, the GIL), `backward_body` (our Python backward, launches included) and `after_backward` (until `.backward()`
returns: gradient accumulation, the hand-back), each the median over calls, for ours and HostFloor with the device
threads on and off. Rows go to --out with provenance.
"""

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from flash_host_floor import host_us  # this folder is on sys.path as a script's
from flash_short_calls import HostFloor, parse_shape, tensors

from cs336_systems.kernels import flash_triton
from cs336_systems.kernels.launch import layout
from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

SHAPES = [(1, 2, 128, 64, False), (1, 16, 1024, 64, True)]


def issue_us(call, calls: int = 50, repeats: int = 15) -> float:
    """Median over `repeats` of `flash_host_floor.host_us`'s issue time per call over `calls` back-to-back calls."""
    for _ in range(10):
        call()
    return statistics.median(host_us(call, calls)[0] for _ in range(repeats))


def forward_runner(q, k, v, causal):
    """The FA2 forward's bound runner and its trailing arguments, from the plan its first call made."""
    flash_triton.flash_forward_triton(q, k, v, causal)
    plan = flash_triton._FORWARD_PLANS[(layout(q, k, v), causal)]
    bound = plan.launches[0][4]
    if bound is None:
        raise RuntimeError("the FA2 forward's plan has no bound runner (fast_launch off?)")
    return bound


def pieces(shape) -> dict[str, object]:
    batch, heads, seq, dim, causal = shape
    q, k, v, do = tensors(batch, heads, seq, dim)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    small = torch.zeros(16, device="cuda")
    run, tail = forward_runner(qd, kd, vd, causal)
    out, lse = torch.empty_like(qd), torch.empty(qd.shape[:-1], dtype=torch.float32, device="cuda")
    pointers = [t.data_ptr() for t in (qd, kd, vd, out, lse)]
    get_device, get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    flash_op = torch.ops.aten._scaled_dot_product_flash_attention

    def fb(fn, threads: bool):
        def call():
            with torch.autograd.set_multithreading_enabled(threads):
                fn(q, k, v, causal).backward(do)
            q.grad = k.grad = v.grad = None
        return call

    calls = {
        "python_call": lambda: None,
        "empty_like": lambda: torch.empty_like(qd),
        "aten_launch": lambda: small.add_(1),
        "stream_lookup": lambda: get_stream(get_device()),
        "fa2_fwd_runner": lambda: run(qd, kd, vd, out, lse, *tail),
        "fa2_fwd_runner_ints": lambda: run(*pointers, *tail),
        "ours_forward": lambda: flash_triton.flash_forward(qd, kd, vd, causal),
        "sdpa_flash_forward": lambda: flash_op(qd, kd, vd, 0.0, causal),
    }
    for name, fn in (("ours", get_attention("flash_triton")), ("sdpa_flash", get_attention("sdpa_flash")),
                     ("floor", HostFloor.apply)):
        calls[f"{name}_fb"] = fb(fn, True)
        calls[f"{name}_fb_no_device_threads"] = fb(fn, False)
    return calls


def backward_phases(shape, calls: int = 300) -> dict[str, float]:
    """Medians over `calls` forward+backward calls of the three phases of `.backward()` (us), per Function and
    device-thread setting: `{"ours_to_backward": ..., "ours_backward_body": ..., ...}`."""
    batch, heads, seq, dim, causal = shape
    q, k, v, do = tensors(batch, heads, seq, dim)
    phases = {}
    for name, function in (("ours", flash_triton.FlashAttentionTriton), ("floor", HostFloor)):
        inner = function.backward
        marks: list[float] = []

        def timed_backward(ctx, *grads, inner=inner, marks=marks):
            marks.append(time.perf_counter())
            result = inner(ctx, *grads)
            marks.append(time.perf_counter())
            return result

        function.backward = staticmethod(timed_backward)
        try:
            for threads in (True, False):
                samples = {"to_backward": [], "backward_body": [], "after_backward": []}
                with torch.autograd.set_multithreading_enabled(threads):
                    for i in range(calls + 10):
                        out = function.apply(q, k, v, causal)
                        marks.clear()
                        start = time.perf_counter()
                        out.backward(do)
                        end = time.perf_counter()
                        q.grad = k.grad = v.grad = None
                        if i >= 10:  # warm
                            entered, left = marks
                            samples["to_backward"].append(entered - start)
                            samples["backward_body"].append(left - entered)
                            samples["after_backward"].append(end - left)
                        if i % 20 == 0:
                            torch.cuda.synchronize()  # the launch queue never fills
                suffix = "" if threads else "_no_device_threads"
                for phase, values in samples.items():
                    phases[f"{name}_{phase}{suffix}"] = statistics.median(values) * 1e6
        finally:
            function.backward = staticmethod(inner)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES, help="BxHxNxD[c] each")
    args = parser.parse_args()
    prov = provenance("cuda")
    rows = []
    for shape in args.shapes:
        batch, heads, seq, dim, causal = shape
        name = f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}"
        with contextlib.suppress(torch.OutOfMemoryError):
            measured = {piece: issue_us(call) for piece, call in pieces(shape).items()}
            measured.update(backward_phases(shape))
            for piece, us in measured.items():
                print(f"{name}  {piece:40s} {us:8.2f} us", flush=True)
                rows.append({"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                             "piece": piece, "host_us": us, **prov})
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
