"""Host time of the Gluon backward's per-call Python, measured on the CPU (no GPU), piece by piece.

    python results/diagnosis/flash_gluon_bwd_host.py [--out FILE.csv] [--runs 3]

As `flash_host_pieces.py` does for the FA2 path and the Gluon forward: CPU tensors, the device check answering as
an H100 would, and the two launches (preprocessing, main kernel) replaced by no-ops, so what is timed is our Python
and the torch calls around the launches (allocations, the dQ scaling), not Triton's launch path, which needs a GPU
(the part FastLauncher shortens is therefore invisible here; its own key and argument list are not). Rows:
- f32_descriptor:   one float32 TMA descriptor (`_float32_descriptor`);
- kernel_launch:    the main kernel's argument tuple (nine descriptors);
- backward_problem: the input checks of one call;
- entry:            `flash_backward_gluon` (checks, allocations, both launches, dQ's scaling);
- dispatched:       `flash_triton.flash_backward` with the backward forced to Gluon (settings, the choice with its
                    checks, the entry as the dispatch calls it);
- launch_main, launch_preprocess (where the module launches through FastLaunchers): one launcher call on its fast
                    path (the layout key, the lookup, the no-op runner): what the launchers add on the CPU;
- entry_checked:    (where the entry takes them) the entry with checked=True and fast_launch given, as the dispatch
                    calls it.
Shape: 1 x 2 x 64, d=128, bf16, causal, the model's layout: small, so that the CPU's own work in the torch calls
(allocations, zeroing dQ's accumulator where a torch call does it, the scaling) stays a few us, as their host cost
on a GPU is. Each row is one run's median over repeats of timeit's per-call us; the printout, each piece's median
over the runs. Run it with the package of
the commit to measure on PYTHONPATH (a copy without .git: set CS336_GIT_COMMIT); kernels/NOTES.md, "Host floor".
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from flash_host_pieces import _NoOpKernel, per_call_us  # noqa: E402 (sets the environment as a GPU run has it)

import torch  # noqa: E402

from cs336_systems.kernels import flash_gluon_bwd as bwd  # noqa: E402
from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.kernels.settings import use_flash_settings  # noqa: E402
from cs336_systems.provenance import provenance  # noqa: E402
from cs336_systems.results import write_rows  # noqa: E402

SHAPE = (1, 2, 64, 128)  # batch, heads, sequence, head dim
# One CPU thread: the torch calls' own work is a few us, and on a shared 2-core box intra-op threads made single
# rows swing by 10x between runs (waiting for a busy core), hiding the host costs this measures.
torch.set_num_threads(1)


def stub_launches():
    """Both launches of the backward do nothing, whichever way the module launches them (the kernels themselves,
    or FastLaunchers holding them); the device check lets CPU tensors through."""
    for name in ("_flash_bwd_gluon_kernel", "_bwd_preprocess_kernel"):
        setattr(bwd, name, _NoOpKernel())
    for name in ("_LAUNCHER", "_PREPROCESS"):
        if hasattr(bwd, name):
            getattr(bwd, name).kernel = _NoOpKernel()
    bwd.device_problem = lambda q: None


def inputs():
    batch, heads, seq, dim = SHAPE
    # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    q, k, v, o, do = (torch.randn(batch, seq, heads, dim, dtype=torch.bfloat16).transpose(1, 2) for _ in range(5))
    return q, k, v, o, do, torch.randn(batch, heads, seq)


def pieces() -> dict[str, float]:
    stub_launches()
    q, k, v, o, do, lse = inputs()
    dq_acc, lse2 = torch.zeros(q.shape, dtype=torch.float32), torch.empty(q.shape[0] * q.shape[1], 64)
    rows = {"f32_descriptor": per_call_us(lambda: bwd._float32_descriptor(lse2, [1, 64]), 5000)}
    rows["kernel_launch"] = per_call_us(
        lambda: bwd.kernel_launch(q, k, v, do, k, v, dq_acc, lse2, lse2, True, 0.1), 2000)
    rows["backward_problem"] = per_call_us(lambda: bwd.backward_problem(q, k, v, o, do, lse), 5000)
    if hasattr(bwd, "_LAUNCHER"):
        args, grid, options = bwd.kernel_launch(q, k, v, do, k, v, dq_acc, lse2, lse2, True, 0.1)
        rows["launch_main"] = per_call_us(lambda: bwd._LAUNCHER(grid, *args, fast_launch=True, **options), 2000)
        pre = (o, do, lse, lse2, lse2, *o.stride(), *do.stride(), SHAPE[1], SHAPE[2], 64)
        if "ACC" in bwd._PREPROCESS.names:  # the preprocessing zeroes dQ's accumulator (since 20d5a66)
            pre = (*pre[:5], dq_acc, *pre[5:13], *dq_acc.stride(), *pre[13:])
        rows["launch_preprocess"] = per_call_us(
            lambda: bwd._PREPROCESS((1, 2), *pre, HEAD_DIM=SHAPE[3], BLOCK=64, fast_launch=True), 2000)
    rows["entry"] = per_call_us(lambda: bwd.flash_backward_gluon(q, k, v, o, do, lse, True), 1000)
    if hasattr(bwd, "_LAUNCHER"):
        rows["entry_checked"] = per_call_us(
            lambda: bwd.flash_backward_gluon(q, k, v, o, do, lse, True, checked=True, fast_launch=True), 1000)
    with use_flash_settings(backward="gluon"):
        rows["dispatched"] = per_call_us(lambda: flash_triton.flash_backward(q, k, v, o, lse, do, True), 1000)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows to this CSV (piece, run, us_per_call, provenance)")
    parser.add_argument("--runs", type=int, default=3, help="times to measure every piece (default 3)")
    options = parser.parse_args()
    prov = provenance("cpu")
    rows = [{"piece": piece, "run": run, "us_per_call": us, **prov}
            for run in range(options.runs) for piece, us in pieces().items()]
    medians = {}
    for row in rows:
        medians.setdefault(row["piece"], []).append(row["us_per_call"])
    for piece, values in medians.items():
        print(f"{piece:20s} {statistics.median(values):9.2f} us (median of {len(values)})")
    if options.out:
        write_rows(rows, options.out)


if __name__ == "__main__":
    main()
