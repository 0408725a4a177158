"""Ours through the C++ autograd node against the Python Function and SDPA at short calls (issue #26: "never
slower than SDPA flash").

    python results/diagnosis/flash_native_node.py --out FILE.csv [--shapes 1x16x512x64c ...] [--rounds N]
    (builds kernels/csrc/flash_node.cpp on first use: a C++ compiler, the CUDA headers and ninja. The GPU machine has
    the first two; for ninja, `pip download ninja` into .whl here and carry .whl, then there
    `python3 -m pip install -q --no-index --find-links .whl ninja` with the venv's scripts directory on PATH.)

kernels/flash_native.py is the node that "The floor of a C++ autograd node at short calls" (kernels/NOTES.md)
measured the floor of. Per point, in alternating rounds (do_bench median of forward+backward, as flash_llm_shapes
times it; gradients set to None between calls): ours as the `flash_triton` backend runs it (the C++ node, checked
on the point's first call), ours as the Python Function (`FlashAttentionTriton.apply`: the same kernels, the
backend's path before the node), SDPA flash and SDPA cuDNN. Rows go to --out with provenance.
"""

import argparse
import sys
from pathlib import Path

from cs336_systems.kernels.flash_triton import FlashAttentionTriton
from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_cpp_floor import SHAPES, alternating_rounds, forward_backward_calls  # noqa: E402  (SHAPES: the 13
# points ours lost in the f634041 grid)
from flash_short_calls import parse_shape, tensors  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prov = provenance("cuda")
    providers = {"ours": get_attention("flash_triton"), "ours_python": FlashAttentionTriton.apply,
                 "sdpa_flash": get_attention("sdpa_flash"), "sdpa_cudnn": get_attention("sdpa_cudnn")}
    rows = []
    for shape in args.shapes:
        batch, heads, seq, dim, causal = shape
        q, k, v, do = tensors(batch, heads, seq, dim)
        for _ in range(2):  # the first call plans the layout; the second must take the node
            out = providers["ours"](q, k, v, causal)
            out.backward(do)
        if "FlashNode" not in out.grad_fn.name():
            raise SystemExit(f"{shape}: the backend did not take the C++ node ({out.grad_fn.name()})")

        calls = forward_backward_calls(providers, q, k, v, do, causal)
        times, med = alternating_rounds(calls, q, k, v, args.rounds)
        for name in calls:
            rows.append({"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                         "variant": name, "bench_ms": med[name], "over_sdpa_flash": med[name] / med["sdpa_flash"],
                         "over_sdpa_cudnn": med[name] / med["sdpa_cudnn"],
                         "rounds": " ".join(f"{t:.4f}" for t in times[name]), **prov})
        print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}: " + ", ".join(f"{n} {m:.4f}" for n, m in
                                                                                  med.items()), flush=True)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
