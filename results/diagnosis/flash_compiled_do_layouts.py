"""Does planning the compiled backward's own dO layout take the compiled call's extra time away? (issue #26,
"compiled <= 1.02x eager")

    python results/diagnosis/flash_compiled_do_layouts.py --out FILE.csv [--rounds 5] [--points 16x32x1024x128 ...]
        [--providers eager compiled ...]

The grid at 2c27aa1 (H200; ours compiled for each point, static shapes) still took a median 1.03x its eager
forward+backward time at its device-bound points. With torch 2.11 on a GPU, AOTAutograd hands a compiled region's
backward a contiguous dO even with static shapes, where the region's output (O, in the model's layout) is not
contiguous (`flash_compiled_do_strides/cuda_2c27aa1.csv`), and our C++ node, whose backward plan had been made for
O's layout, copied that dO back into it. The node now plans the compiled backward's layout too
(`flash_native.plans_grad_layout`). At points where the grid's ratio was highest, this times ours' forward+backward:
- `eager`: the flash_triton backend called as it is, dO in the model's layout (as the grid);
- `compiled_copy`: compiled for the point (static shapes), the node held to its first dO layout, so that it copies
  the compiled backward's dO into O's layout, as at 2c27aa1;
- `compiled`: the same graph, the node planning the compiled backward's layout as the library now does;
- `compiled_tangent_guess`: as `compiled`, but traced with torch's `guess_tangent_strides_as_outputs` on (torch
  2.13's default, off in torch 2.11), so that AOTAutograd expects dO in O's layout and need not copy it. The library
  does not set torch's config; this asks how much of what is left is that copy.
The providers take turns in `--rounds` rounds on the same inputs, the node's plans dropped before each (made again
at its first call, which the warm-up takes). A row: point, provider, median of the rounds' medians (ms), spread
((max - min) / median), ratio to eager's median.
"""

import argparse
import dataclasses
import statistics
from pathlib import Path

import torch
import torch._functorch.config

from cs336_systems.kernels import flash_native, flash_triton
from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

# (batch, heads, seq, head dim, causal): the grid's device-bound points with the largest compiled ÷ eager at 2c27aa1
POINTS = ("16x32x1024x128", "8x32x2048x128c", "16x32x2048x128c", "32x16x2048x64c", "16x32x4096x128c",
          "16x16x8192x64c", "1x16x32768x64c", "8x32x8192x128c")
PROVIDERS = ("eager", "compiled_copy", "compiled", "compiled_tangent_guess")
PLANS_GRAD_LAYOUT = flash_native.plans_grad_layout
NATIVE_PASSES = flash_triton.native_passes


def parse_point(text: str) -> tuple[int, int, int, int, bool]:
    causal = text.endswith("c")
    batch, heads, seq, dim = (int(x) for x in text.removesuffix("c").split("x"))
    return batch, heads, seq, dim, causal


def _first_layout_only(*args):
    passes = NATIVE_PASSES(*args)
    return None if passes is None else dataclasses.replace(passes, backward=passes.backward[:1])


def node_copies(copies: bool) -> None:
    """Hold the node to its first dO layout (copies: True), or let it plan others (the library's behaviour); both
    drop the nodes, so that the next call makes its plan again."""
    flash_triton.native_passes = _first_layout_only if copies else NATIVE_PASSES
    flash_native.plans_grad_layout = (lambda *args: False) if copies else PLANS_GRAD_LAYOUT
    flash_native._NODES.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", nargs="+", default=POINTS)
    parser.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=60)
    args = parser.parse_args()
    device = torch.device("cuda")
    attention = get_attention("flash_triton")
    prov = provenance(device)
    rows = []
    for text in args.points:
        batch, heads, seq, dim, causal = parse_point(text)
        q, k, v, do = (torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        torch._dynamo.reset()
        compiled = torch.compile(attention, dynamic=False)

        def guessed(q, k, v, causal):  # a frame of its own: dynamo caches graphs per code object
            return attention(q, k, v, causal)

        guessed = torch.compile(guessed, dynamic=False)
        if "compiled_tangent_guess" in args.providers:
            node_copies(False)
            with torch._functorch.config.patch(guess_tangent_strides_as_outputs=True):
                guessed(q, k, v, causal).backward(do)  # traced, forward and backward, under the setting
        everything = {"eager": (attention, False), "compiled_copy": (compiled, True), "compiled": (compiled, False),
                      "compiled_tangent_guess": (guessed, False)}
        providers = {name: everything[name] for name in dict.fromkeys(("eager", *args.providers))}
        times: dict[str, list[float]] = {name: [] for name in providers}
        seen: dict[str, set] = {name: set() for name in providers}
        for _ in range(args.rounds):
            for name, (fn, copies) in providers.items():
                node_copies(copies)

                def both(fn=fn):
                    fn(q, k, v, causal).backward(do)

                times[name].append(bench_ms(both, device, args.warmup_ms, args.rep_ms, grad_to_none=[q, k, v],
                                            min_calls=4))
                node = flash_native._NODES.get((flash_native.layout(q, k, v), causal))
                seen[name].add(None if node is None else tuple(map(str, node.grad_layouts)))
        eager = statistics.median(times["eager"])
        for name, ms in times.items():
            median = statistics.median(ms)
            rows.append({"point": text, "provider": name, "median_ms": median, "rounds": args.rounds,
                         "spread": (max(ms) - min(ms)) / median, "over_eager": median / eager,
                         "node_grad_layouts": " | ".join(sorted(map(str, seen[name]))), **prov})
            print(f"{text:18s} {name:14s} {median:9.3f} ms  {median / eager:.3f}x eager  layouts {seen[name]}",
                  flush=True)
        q = k = v = do = None
        torch.cuda.empty_cache()
    node_copies(False)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
