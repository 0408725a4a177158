"""In which layout does dO reach our backward operator under torch.compile? (issue #26: "compiled <= 1.02x eager")

    python results/diagnosis/flash_compiled_do_strides.py --out FILE.csv [--device cpu|cuda]

The grid at 48e8f9f (H200) made dO in the model's layout, as q, k and v ((batch, seq, heads, dim) viewed as
(batch, heads, seq, dim)), and there ours compiled took 1.03-1.16x its eager forward+backward time at long,
device-bound points, where the grid at ac2b783 (dO contiguous) had 0.98-1.01x. The suspect: AOTAutograd guesses the
layout of each tangent (the gradient of a compiled region's output) when it traces the backward, and makes the
incoming gradient match at every call. With static shapes it takes the output's own strides
(`torch._functorch.config.guess_tangent_strides_as_outputs`); with symbolic sizes it takes a memory format,
`suggest_memory_format(O)`, contiguous here, and copies any other dO into it. The grid's compiled provider is one
`torch.compile` over all its points, so from the second shape on it runs a dynamic-shape graph.

This records the strides of the dO that our backward receives (`flash_triton.flash_backward`, wrapped; the C++ node
is switched off, CS336_FLASH_NATIVE=0, so that eager and compiled calls both reach it) and O's, for:
- `eager`: the attention backend called as it is;
- `static`: `torch.compile(dynamic=False)`, one shape;
- `dynamic`: `torch.compile(dynamic=True)`;
- `grid`: `torch.compile()` called at another shape first, as the grid's provider (dynamic from the second shape);
- `model_dynamic`: `torch.compile(dynamic=True)` of attention followed by what a model's layer does next (O viewed
  back as (batch, seq, heads x dim)): the region's output is then contiguous, and dO for the attention is made inside
  the graph.
Each call's dO is made as the grid makes it (the model's layout) or, for `model_dynamic`, contiguous in the region's
output shape. Strides only: no timing, so it runs on a CPU (the FA2 kernels under TRITON_INTERPRET=1) as well as a
GPU. Rows: mode, shape, O's strides, the given dO's strides, the strides our backward received, and whether they
differ from O's (the C++ node would then copy dO once more, into the layout its plan was made for).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ["CS336_FLASH_NATIVE"] = "0"
if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.model.attention import get_attention  # noqa: E402
from cs336_systems.provenance import provenance  # noqa: E402
from cs336_systems.results import write_rows  # noqa: E402

RECEIVED: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (dO's strides, O's strides) per backward


def _recording(backward):
    def flash_backward(q, k, v, out, lse, grad_out, is_causal):
        RECEIVED.append((tuple(grad_out.stride()), tuple(out.stride())))
        return backward(q, k, v, out, lse, grad_out, is_causal)

    return flash_backward


def model_like(attention):
    """Attention, then O as a model's next layer reads it: (batch, seq, heads x dim)."""
    def layer(q, k, v, causal):
        out = attention(q, k, v, causal)
        batch, heads, seq, dim = out.shape
        return out.transpose(1, 2).reshape(batch, seq, heads * dim)

    return layer


def inputs(shape, device, dtype):
    batch, heads, seq, dim = shape
    return [torch.randn(batch, seq, heads, dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    flash_triton.flash_backward = _recording(flash_triton.flash_backward)
    attention = get_attention("flash_triton")
    first, shape = (1, 2, 48, 16), (2, 2, 80, 16)  # the grid's second shape differs in batch and length
    modes = {
        "eager": attention,
        "static": torch.compile(attention, dynamic=False),
        "dynamic": torch.compile(attention, dynamic=True),
        "grid": torch.compile(lambda q, k, v, causal: attention(q, k, v, causal)),
        "model_dynamic": torch.compile(model_like(attention), dynamic=True),
    }
    rows = []
    prov = provenance(device)
    for mode, fn in modes.items():
        if mode == "grid":  # its first shape compiles the static graph the second then replaces
            fn(*inputs(first, device, dtype), True).backward(torch.randn(first, device=device, dtype=dtype))
        q, k, v = inputs(shape, device, dtype)
        out = fn(q, k, v, True)
        batch, heads, seq, dim = shape
        do = (torch.randn(batch, seq, heads * dim, device=device, dtype=dtype) if mode == "model_dynamic"
              else torch.randn(batch, seq, heads, dim, device=device, dtype=dtype).transpose(1, 2))
        RECEIVED.clear()
        out.backward(do)
        (received, o_strides), = RECEIVED
        rows.append({"mode": mode, "shape": "x".join(map(str, shape)), "o_strides": str(o_strides),
                     "do_given_strides": str(tuple(do.stride())), "do_received_strides": str(received),
                     "do_as_o": received == o_strides, **prov})
        print(f"{mode:14s} O {o_strides}  dO given {tuple(do.stride())}  dO at our backward {received}"
              f"  {'as O' if received == o_strides else 'NOT as O'}", flush=True)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
