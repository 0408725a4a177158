"""Does SDPA's cuDNN backward give the right gradients when dO's strides differ from O's? (issue #26)

    python results/diagnosis/sdpa_cudnn_grad_strides.py --out FILE.csv [--shapes 1x16x512x64c ...]

`flash_compiled_dynamic.py` (H200, f677cae) found SDPA cuDNN's eager dQ, dK and dV off float64 by 4-9 (bf16
inputs of unit variance, where every other backend is off by ~0.01) at all three points it checked, while the
same backend compiled was right. There q, k, v are made as (batch, seq, heads, dim) and viewed as (batch, heads,
seq, dim); the check's dO is laid out as q, the timing's is contiguous. torch's cuDNN path stopped making dO's
strides match O's when cuDNN 9.5.1 was said to accept any dO layout (pytorch PR #141147).

Per point and dO layout this checks each backend's O, dQ, dK and dV against float64 (largest |error|, and the
norm of the error over the reference's), each backward the first of a fresh forward's graph, and times the
forward+backward (do_bench, median):
- `contiguous`: dO contiguous, (batch, heads, seq, dim): the grid's;
- `like_q`: dO made as (batch, seq, heads, dim) and viewed as q is: what a model that transposes O back gives;
- `like_out`: dO with O's own strides (`torch.empty_like(O)`).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_short_calls import parse_shape  # noqa: E402

from cs336_systems.model.attention import get_attention, naive_attention  # noqa: E402
from cs336_systems.provenance import provenance  # noqa: E402
from cs336_systems.results import write_rows  # noqa: E402
from cs336_systems.timing import bench_ms  # noqa: E402

BACKENDS = ("sdpa_cudnn", "sdpa_flash", "flash_triton")
LAYOUTS = ("like_q", "contiguous", "like_out")


def grad_output(layout: str, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    batch, heads, seq, dim = out.shape
    if layout == "contiguous":
        do = torch.empty(batch, heads, seq, dim, device=out.device, dtype=out.dtype)
    elif layout == "like_q":
        do = torch.empty(batch, seq, heads, dim, device=out.device, dtype=out.dtype).transpose(1, 2)
    else:
        do = torch.empty_like(out)
    return do.normal_(generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+",
                        default=[parse_shape(s) for s in ("1x16x512x64c", "2x32x2048x128c", "1x16x4096x128")])
    args = parser.parse_args()
    device = torch.device("cuda")
    prov = provenance(device)
    rows = []
    for batch, heads, seq, dim, causal in args.shapes:
        generator = torch.Generator(device).manual_seed(seq * dim + batch)
        q, k, v = (torch.empty(batch, seq, heads, dim, device=device, dtype=torch.bfloat16)
                   .normal_(generator=generator).transpose(1, 2).requires_grad_() for _ in range(3))
        reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out = naive_attention(*reference, causal)
        for backend in BACKENDS:
            fn = get_attention(backend)
            for layout in LAYOUTS:
                out = fn(q, k, v, causal)  # a fresh graph: each backward is its graph's first and only one
                do = grad_output(layout, out, generator)
                grads = torch.autograd.grad(out, (q, k, v), do)
                want = (ref_out, *torch.autograd.grad(ref_out, reference, do.double(), retain_graph=True))
                row = {"benchmark": "sdpa_cudnn_grad_strides", "backend": backend, "do_layout": layout,
                       "batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                       "out_strides": str(tuple(out.stride())), "do_strides": str(tuple(do.stride()))}
                for name, got, ref in zip(("O", "dQ", "dK", "dV"), (out, *grads), want):
                    error = got.double() - ref.detach()
                    row[f"{name}_max_err"] = error.abs().max().item()
                    row[f"{name}_rel_err"] = (error.norm() / ref.detach().norm()).item()

                def both(fn=fn, do=do):
                    fn(q, k, v, causal).backward(do)

                row["forward_backward_ms"] = bench_ms(both, device, 25, 100, grad_to_none=[q, k, v], min_calls=4)
                rows.append({**row, **prov})
                print(f"b{batch} h{heads} n{seq} d{dim}{'c' if causal else ''} {backend:12s} dO {layout:10s} "
                      + " ".join(f"{n}={row[f'{n}_rel_err']:.2e}" for n in ("O", "dQ", "dK", "dV"))
                      + f" fb={row['forward_backward_ms']:.3f} ms", flush=True)
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
