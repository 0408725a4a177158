"""The Gluon forward kernel against itself as it was at an earlier commit, kernel time beside cuDNN's (issue #26:
d=128 forward at or below 0.9x cuDNN).

    git show BASE:cs336_systems/kernels/flash_gluon.py > BASE_FILE   # on this machine: the device's .git has no history
    python results/diagnosis/flash_gluon_forward_ab.py --base-file BASE_FILE --out FILE.csv [--shapes ...]

This loads BASE_FILE as a second module beside the current `flash_gluon` and times both forward kernels
(torch.profiler device time, mean of 10 calls) in alternating rounds at each shape, with cuDNN's forward kernel; a
row's times are the medians of its rounds. It first checks, on two awkward lengths, that the two kernels' O agree
and that the current one is as close to float64 as the base. Rows go to --out with provenance.

Run for three changes to the softmax of the key loop, each against 996f91e (`flash_gluon_forward_ab/`; none shipped):
row max and row sum as trees (6b57650), the row sums stored to shared memory before the P V wait (d62cce1), and O's
rescale moved after the P V wait (457fc5a). kernels/NOTES.md, "Where the d=128 forward's time goes", has the results.
"""

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

from cs336_systems.kernels import flash_gluon
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_gluon_tile_overhead import kernel_ms  # noqa: E402
from flash_short_calls import parse_shape  # noqa: E402

SHAPES = ["1x16x16384x128", "1x16x16384x128c", "2x32x32768x128c", "2x32x8192x128", "4x32x4096x128c",
          "8x32x1024x128c", "1x16x16384x64c", "4x16x8192x64", "8x16x2048x64"]


def load_base(path: Path):
    spec = importlib.util.spec_from_file_location("flash_gluon_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def errors(base, q, k, v, causal: bool) -> dict:
    """Max |O - O_float64| of both kernels, and max |O_new - O_base|, on these inputs."""
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    new, _ = flash_gluon._forward(q, k, v, causal)
    old, _ = base._forward(q, k, v, causal)
    return {"err_new": (new.double() - ref).abs().max().item(), "err_base": (old.double() - ref).abs().max().item(),
            "new_vs_base": (new.float() - old.float()).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-file", type=Path, required=True, help="flash_gluon.py as it was before the change")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = load_base(args.base_file)
    prov = provenance("cuda")
    rows = []
    torch.manual_seed(0)
    small = [(1, 4, 777, 128, True), (1, 4, 1000, 64, False)]
    for batch, heads, seq, dim, causal in small:  # accuracy on awkward lengths first
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal, "kind": "check",
               **errors(base, q, k, v, causal), **prov}
        print(row, flush=True)
        rows.append(row)
    for batch, heads, seq, dim, causal in args.shapes:
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))  # the model's layout
        shape = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal}
        times = {"new": [], "base": [], "cudnn": []}
        for _ in range(args.rounds):
            times["base"].append(kernel_ms(lambda: base._forward(q, k, v, causal), "flash_fwd_gluon"))
            times["new"].append(kernel_ms(lambda: flash_gluon._forward(q, k, v, causal), "flash_fwd_gluon"))
            times["cudnn"].append(kernel_ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, causal, False), ""))
        med = {name: statistics.median(values) for name, values in times.items()}
        row = {**shape, "kind": "time", "new_ms": med["new"], "base_ms": med["base"], "cudnn_ms": med["cudnn"],
               "new_over_base": med["new"] / med["base"], "new_over_cudnn": med["new"] / med["cudnn"],
               "base_over_cudnn": med["base"] / med["cudnn"],
               "rounds": " ".join(f"{n}:{b:.4f}/{c:.4f}" for n, b, c in zip(times["new"], times["base"],
                                                                           times["cudnn"])), **prov}
        print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}: new {med['new']:.4f} base {med['base']:.4f} "
              f"cuDNN {med['cudnn']:.4f} ms; new/base {row['new_over_base']:.3f}, new/cuDNN "
              f"{row['new_over_cudnn']:.3f}, base/cuDNN {row['base_over_cudnn']:.3f}", flush=True)
        rows.append(row)
        q = k = v = None
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
