"""Is what torch.compile costs a short attention call the cost of the dynamic-shape graph the grid ends up with?
(issue #26: "compiled <= 1.02x eager")

    python results/diagnosis/flash_compiled_dynamic.py --out FILE.csv [--shapes 1x16x512x64c ...] [--rounds 3]

`flash_bench llm-shapes` compiles each provider once (`torch.compile(fn)`) and calls it at every point, so from the
second shape on Dynamo recompiles it with dynamic sizes (`automatic_dynamic_shapes`), and every later point runs the
dynamic graph: its guards and Inductor's wrapper compute sizes and strides at each call. A user who trains at one
shape runs a graph compiled for that shape. SDPA flash and cuDNN are also one function (`sdpa_kernel_attention`
with the kernel bound by `functools.partial`), so they share one code object and so one Dynamo cache. At the 12
short points of `flash_compiled_overhead/`, compiled cost every provider 0.4-0.8 ms more than eager per
forward+backward.

Per point, this times each backend (ours, SDPA flash, SDPA cuDNN, and `floor`: q + k + v, no attention, what a
compiled region costs whatever it holds) in five modes, in interleaved rounds as the grid
does (each round a do_bench of the forward (no_grad) and of the forward+backward):
- `eager`: the backend itself;
- `static`: `torch.compile(dynamic=False)`, compiled afresh for this point (a new function for each point);
- `dynamic`: `torch.compile(dynamic=True)`, compiled once, at the first point;
- `grid`: `torch.compile()` compiled once and called at every point, the grid's own provider (dynamic from the
  second point on);
- `graphs`: `torch.compile(mode="reduce-overhead", dynamic=False)`, compiled afresh for this point: Inductor's CUDA
  graphs replay each pass's kernels without launching them one by one from the host. Before timing, each backend's
  graphs are checked against its eager call on fresh inputs (O and dQ, dK, dV; the largest difference is logged,
  and each one's error against float64).
Each compiled callable wraps the backend in a function with a code object of its own, so that no two share a
Dynamo cache. Rows: the median of the rounds, their spread, and `graphs`: how many graphs Dynamo holds for that
callable's code by the end of the point (a no_grad forward and a forward with gradients are two).
"""

import argparse
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_short_calls import parse_shape  # noqa: E402

from cs336_systems.model.attention import get_attention, naive_attention  # noqa: E402
from cs336_systems.provenance import provenance  # noqa: E402
from cs336_systems.results import write_rows  # noqa: E402
from cs336_systems.timing import bench_ms  # noqa: E402

BACKENDS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "floor")
MODES = ("eager", "static", "dynamic", "grid", "graphs")
# the 12 short causal points of flash_compiled_overhead/ (batch x heads 16 and 64, 512-2048 keys, d 64 and 128)
# less six, and the Gluon point 2 x 32 x 2048 x 128
SHAPES = ["1x16x512x64c", "1x16x2048x64c", "4x16x1024x64c", "1x16x1024x128c", "2x32x1024x128c", "2x32x2048x128c"]


def floor(q, k, v, causal):
    """No attention: the least a compiled region with three inputs that need gradients can cost (one pointwise
    kernel forward; the backward passes the output's gradient on to all three), torch.compile's own floor."""
    return q + k + v


def own_code(fn, name: str):
    """A function that calls `fn`, with a code object of its own (Dynamo keeps its cache on the code object)."""
    def call(q, k, v, causal):
        return fn(q, k, v, causal)

    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)


def cache_entries(compiled) -> int:
    """How many graphs Dynamo holds for the function `compiled` wraps."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(compiled._torchdynamo_orig_callable.__code__))


def graphs_difference(graphs, eager, like: torch.Tensor, causal: bool) -> dict[str, float]:
    """Largest |graphs - eager| of O, dQ, dK and dV over three calls, each on fresh inputs shaped and laid out as
    `like` (a replayed graph reads its inputs through copies into its own buffers), and the largest error of each
    against float64 (`graphs_O_err`, `eager_O_err`, ...)."""
    names = ("O", "dQ", "dK", "dV")
    worst = dict.fromkeys([*names, *(f"{mode}_{n}_err" for mode in ("graphs", "eager") for n in names)], 0.0)
    for _ in range(3):
        q, k, v = (torch.randn_like(like).requires_grad_() for _ in range(3))
        do = torch.randn_like(like)
        results = {}
        for mode, fn in (("graphs", graphs), ("eager", eager), ("float64", naive_attention)):
            inputs = [t.detach().double().requires_grad_() for t in (q, k, v)] if mode == "float64" else (q, k, v)
            out = fn(*inputs, causal)
            grads = torch.autograd.grad(out, inputs, do.to(out.dtype))
            results[mode] = [t.detach().double().clone() for t in (out, *grads)]
        for i, name in enumerate(names):
            worst[name] = max(worst[name], (results["graphs"][i] - results["eager"][i]).abs().max().item())
            for mode in ("graphs", "eager"):
                error = (results[mode][i] - results["float64"][i]).abs().max().item()
                worst[f"{mode}_{name}_err"] = max(worst[f"{mode}_{name}_err"], error)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100, help="per callable and pass, over all rounds")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    device = torch.device("cuda")
    backends = args.backends
    fns = {backend: floor if backend == "floor" else get_attention(backend) for backend in backends}
    once = {(backend, mode): torch.compile(own_code(fns[backend], f"{backend}_{mode}"), dynamic=mode == "dynamic")
            for backend in backends for mode in ("dynamic", "grid")}
    prov = provenance(device)
    rows = []
    for batch, heads, seq, dim, causal in args.shapes:
        calls = {}
        for backend in backends:  # static: a new function per point, so a graph of this point's shape
            calls[(backend, "eager")] = fns[backend]
            calls[(backend, "static")] = torch.compile(own_code(fns[backend], f"{backend}_static_{seq}_{dim}_{batch}"),
                                                       dynamic=False)
            calls[(backend, "dynamic")] = once[(backend, "dynamic")]
            calls[(backend, "grid")] = once[(backend, "grid")]
            calls[(backend, "graphs")] = torch.compile(
                own_code(fns[backend], f"{backend}_graphs_{seq}_{dim}_{batch}"), mode="reduce-overhead", dynamic=False)
        q, k, v = (torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                   .requires_grad_() for _ in range(3))
        do = torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16)
        for backend in (b for b in backends if b != "floor"):  # the floor computes no attention to check
            worst = graphs_difference(calls[(backend, "graphs")], fns[backend], q, causal)
            print(f"b{batch} h{heads} n{seq} d{dim} {backend:12s} graphs against eager, max |difference| over three "
                  "calls on fresh inputs: " + " ".join(f"{name}={value:.3g}" for name, value in worst.items()),
                  flush=True)
        times = {key: {"forward": [], "forward_backward": []} for key in calls}
        for _ in range(args.rounds):
            for key, fn in calls.items():
                def forward(fn=fn):
                    with torch.no_grad():
                        fn(q, k, v, causal)

                def both(fn=fn):
                    fn(q, k, v, causal).backward(do)

                for name, call in (("forward", forward), ("forward_backward", both)):
                    times[key][name].append(bench_ms(call, device, args.warmup_ms, args.rep_ms / args.rounds,
                                                     grad_to_none=[q, k, v], min_calls=4))
        for (backend, mode), passes in times.items():
            for name, ms in passes.items():
                median = statistics.median(ms)
                rows.append({"benchmark": "flash_compiled_dynamic", "backend": backend, "mode": mode,
                             "batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                             "pass": name, "median_ms": median, "spread": (max(ms) - min(ms)) / median,
                             "rounds": args.rounds,
                             "graphs": 0 if mode == "eager" else cache_entries(calls[(backend, mode)]), **prov})
                print(f"b{batch} h{heads} n{seq} d{dim} {backend:12s} {mode:8s} {name:16s} {median:.3f} ms "
                      f"graphs={rows[-1]['graphs']}", flush=True)
        q = k = v = do = None
        write_rows(rows, args.out)  # after every point: a run cut short keeps the points it finished


if __name__ == "__main__":
    main()
