"""A Gluon attention kernel against itself as it was at an earlier commit, kernel time beside cuDNN's (issue #26).

    git show BASE:cs336_systems/kernels/flash_gluon.py > BASE_FILE   # on this machine: the device's .git has no history
    python results/diagnosis/flash_gluon_ab.py --base-file BASE_FILE --out FILE.csv [--shapes ...]
    (--kernel backward with BASE:cs336_systems/kernels/flash_gluon_bwd.py: the backward kernel instead)

This loads BASE_FILE as a second module beside the current `flash_gluon` (or `flash_gluon_bwd`) and times both
kernels (torch.profiler device time, mean of 10 calls) in alternating rounds at each shape, with cuDNN's forward
kernel (backward: its main backward kernel, `flash_bprop`, against our main kernel); a row's times are the medians
of its rounds, with each sample's mean SM clock (`bench.gpu_clock`: `*_mhz` the median over rounds, `clock_rounds`
each round's; NaN where a sample was shorter than the 50 ms sampling interval) and the ratios in cycles
(`*_cycles`: `bench.gpu_clock.cycle_ratio`, the median of each round's time x clock over the other kernel's), which
at a power-limited shape separate the kernels' cycles from the clock they were given. It first checks, on two awkward
lengths, that the two kernels' outputs agree and that the current one is as close to float64 as the base (the
forward's O and L each), and stops before timing if it is not (--time-anyway: time regardless). Rows go to --out
with provenance.

Run for three changes to the softmax of the key loop, each against 996f91e (`flash_gluon_ab/`; none shipped):
row max and row sum as trees (6b57650), the row sums stored to shared memory before the P V wait (d62cce1), and O's
rescale moved after the P V wait (457fc5a). kernels/NOTES.md, "Where the d=128 forward's time goes", has the results.
With --kernel backward: the backward's L2 row read before S^T's wait (933b23b) against 8c39ab4, and dS^T's fence
after the step's last wait (9ccfe02) against 6f07913. Against db70247: the forward's exp2 partly by a cubic (8f42831),
its conditional rescale (fbb22b5), and the backward's dQ tile in a 32-byte swizzle (a944835, 89e4101; shipped at d=64).
With --whole, every kernel of the two calls is timed (the backward's preprocessing, main kernel and dQ scale-and-cast),
for changes outside the main kernel; with --wall, do_bench's time of each call (the grid's statistic: host time
included), for host changes. Against a6350e8: the group-major and tile-major dQ accumulators (d9d4469, 2459b6e; main
kernel, and --whole), and the dQ accumulator's zero fill moved into the preprocessing (--whole and --wall).
Against 47e2f4e: P's row sums on the tensor cores, P times a tile of ones (c199c07; reverted), and the consumers'
turns by named barriers (3c1d088; shipped at b485adb).
"""

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from cs336_systems.bench.gpu_clock import ClockSampler, cycle_ratio
from cs336_systems.kernels import flash_gluon, flash_gluon_bwd
from cs336_systems.model.attention import attention_scores
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_gluon_tile_overhead import kernel_ms  # noqa: E402
from flash_short_calls import parse_shape  # noqa: E402

SHAPES = ["1x16x16384x128", "1x16x16384x128c", "2x32x32768x128c", "2x32x8192x128", "4x32x4096x128c",
          "8x32x1024x128c", "1x16x16384x64c", "4x16x8192x64", "8x16x2048x64"]


def load_base(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def errors(base, q, k, v, causal: bool, backward: bool) -> dict:
    """Max |out - out_float64| of both kernels, and max |out_new - out_base|, on these inputs (backward: over dQ,
    dK and dV, from our forward's O and L). The forward's L is compared apart (`l_err_*`): the backward reads it,
    and an L as far off as a 16-bit O would pass the O check yet fail the backward's tests. `ok`: the new kernel's
    errors within twice the base's, plus 2e-3 for O and 1e-5 for L."""
    if not backward:
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
        (new_o, new_l), (old_o, old_l) = flash_gluon._forward(q, k, v, causal), base._forward(q, k, v, causal)
        l_errs = {"l_err_new": (new_l.double() - ref_lse).abs().max().item(),
                  "l_err_base": (old_l.double() - ref_lse).abs().max().item()}
        row = {**_max_errors((new_o, ), (old_o, ), (ref, )), **l_errs}
        return {**row, "ok": bool(row["err_new"] <= 2 * row["err_base"] + 2e-3
                                  and row["l_err_new"] <= 2 * row["l_err_base"] + 1e-5)}
    else:
        o, lse = flash_gluon._forward(q, k, v, causal)
        do = torch.randn_like(q)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal).backward(do.double())
        refs = tuple(t.grad for t in leaves)
        new = flash_gluon_bwd._backward(q, k, v, o, do, lse, causal)
        old = base._backward(q, k, v, o, do, lse, causal)
    row = _max_errors(new, old, refs)
    return {**row, "ok": bool(row["err_new"] <= 2 * row["err_base"] + 2e-3)}


def _max_errors(new, old, refs) -> dict:
    return {"err_new": max((n.double() - r).abs().max().item() for n, r in zip(new, refs)),
            "err_base": max((b.double() - r).abs().max().item() for b, r in zip(old, refs)),
            "new_vs_base": max((n.float() - b.float()).abs().max().item() for n, b in zip(new, old))}


def calls(new, base, q, k, v, causal: bool, backward: bool):
    """The timed calls of the two modules (this tree's and the base's) on the same inputs, and cuDNN's counterpart,
    with the kernel names to time."""
    if not backward:
        return (lambda: new._forward(q, k, v, causal), lambda: base._forward(q, k, v, causal), "flash_fwd_gluon",
                lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, causal, False),
                "")
    o, lse = flash_gluon._forward(q, k, v, causal)
    do = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def cudnn():
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(*leaves, None, True, 0.0, causal, False)[0]
        torch.autograd.grad(out, leaves, do)
    return (lambda: new._backward(q, k, v, o, do, lse, causal), lambda: base._backward(q, k, v, o, do, lse, causal),
            "flash_bwd_gluon", cudnn, "flash_bprop")


def _median_of_measured(values: list[float]) -> float:
    """The median of the samples that have a clock (a sample shorter than the sampling interval has none)."""
    measured = [v for v in values if not math.isnan(v)]
    return statistics.median(measured) if measured else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-file", type=Path, required=True,
                        help="flash_gluon.py (--kernel backward: flash_gluon_bwd.py) as it was before the change")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel", choices=("forward", "backward"), default="forward")
    parser.add_argument("--whole", action="store_true",
                        help="time every kernel of our two calls (the backward's preprocessing, main kernel and dQ "
                             "cast), not only the main kernel; cuDNN is then not timed")
    parser.add_argument("--wall", action="store_true",
                        help="time our two calls as the grid does (do_bench: the host's share included), for host "
                             "changes at short calls; cuDNN is then not timed")
    parser.add_argument("--time-anyway", action="store_true", help="time even if a check failed")
    args = parser.parse_args()
    backward = args.kernel == "backward"
    base = load_base(args.base_file, "flash_gluon_bwd_base" if backward else "flash_gluon_base")
    prov = provenance("cuda")
    rows = []
    torch.manual_seed(0)
    small = [(1, 4, 777, 128, True), (1, 4, 1000, 64, False)]
    for batch, heads, seq, dim, causal in small:  # accuracy on awkward lengths first
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal, "kind": "check",
               "kernel": args.kernel, **errors(base, q, k, v, causal, backward), **prov}
        print(row, flush=True)
        rows.append(row)
    failed = [row for row in rows if not row["ok"]]
    if failed and not args.time_anyway:
        write_rows(rows, args.out)
        sys.exit(f"{len(failed)} check(s) failed (the new kernel's errors beyond twice the base's): nothing timed; "
                 "--time-anyway times them regardless")
    for batch, heads, seq, dim, causal in args.shapes:
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))  # the model's layout
        shape = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                 "kernel": args.kernel,
                 "timed": "do_bench" if args.wall else "every kernel" if args.whole else "main kernel"}
        times = {"new": [], "base": [], "cudnn": []}
        new_call, base_call, name, cudnn_call, cudnn_name = calls(flash_gluon_bwd if backward else flash_gluon, base,
                                                                  q, k, v, causal, backward)
        name = "" if args.whole else name  # "": every kernel the call launches
        if args.wall:
            def timer(call, name):
                return bench_ms(call, q.device, 25, 100, min_calls=10)
        else:
            timer = kernel_ms
        samplers = {"base": lambda: timer(base_call, name), "new": lambda: timer(new_call, name),
                    "cudnn": ((lambda: math.nan) if args.whole or args.wall
                              else lambda: kernel_ms(cudnn_call, cudnn_name))}
        windows = {who: [] for who in times}  # each sample's host-time window, for its mean SM clock
        with ClockSampler.for_device(q.device) as clocks:
            for _ in range(args.rounds):
                for who, sample in samplers.items():
                    start = time.time()
                    times[who].append(sample())
                    windows[who].append((start, time.time()))
        mhz = {who: [clocks.window(*w)["sm_clock_mhz"] for w in spans] for who, spans in windows.items()}
        med = {who: statistics.median(values) for who, values in times.items()}
        row = {**shape, "kind": "time", "new_ms": med["new"], "base_ms": med["base"], "cudnn_ms": med["cudnn"],
               "new_over_base": med["new"] / med["base"], "new_over_cudnn": med["new"] / med["cudnn"],
               "base_over_cudnn": med["base"] / med["cudnn"],
               **{f"{who}_mhz": _median_of_measured(values) for who, values in mhz.items()},
               "new_over_base_cycles": cycle_ratio(times["new"], mhz["new"], times["base"], mhz["base"]),
               "new_over_cudnn_cycles": cycle_ratio(times["new"], mhz["new"], times["cudnn"], mhz["cudnn"]),
               "clock_rounds": " ".join(f"{n:.0f}:{b:.0f}/{c:.0f}" for n, b, c in zip(mhz["new"], mhz["base"],
                                                                                     mhz["cudnn"])),
               "rounds": " ".join(f"{n}:{b:.4f}/{c:.4f}" for n, b, c in zip(times["new"], times["base"],
                                                                           times["cudnn"])), **prov}
        print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''} ({shape['timed']}): new {med['new']:.4f} base "
              f"{med['base']:.4f} cuDNN {med['cudnn']:.4f} ms; new/base {row['new_over_base']:.3f}, new/cuDNN "
              f"{row['new_over_cudnn']:.3f}, base/cuDNN {row['base_over_cudnn']:.3f}; SM clock new/base/cuDNN "
              f"{row['new_mhz']:.0f}/{row['base_mhz']:.0f}/{row['cudnn_mhz']:.0f} MHz; in cycles new/base "
              f"{row['new_over_base_cycles']:.3f}, new/cuDNN {row['new_over_cudnn_cycles']:.3f}", flush=True)
        rows.append(row)
        q = k = v = None
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
