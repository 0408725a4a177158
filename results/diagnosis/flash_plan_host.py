"""Host time of the FA2 path's eager calls, piece by piece, on the CPU with the kernel launches stubbed (branch h-host2).

    python results/diagnosis/flash_plan_host.py --out FILE.csv [--runs 3]

The plan cache (kernels/flash_triton.py, `_Plan`) changes what a repeated call of one signature runs; this times
what a call costs around the launches, with each launch a no-op (as results/diagnosis/flash_host_pieces.py does:
the kernel objects replaced, so FastLauncher's first call "compiles" a no-op runner), on CPU tensors, one thread:
- settings:           one `flash_settings()` read (the environment's five variables);
- check_inputs:       the autograd Function's input check;
- forward_triton:     `flash_forward_triton` (the FA2 launcher: with plans, a hit);
- backward_triton:    `flash_backward_triton` (three launches);
- forward, backward:  `flash_forward` / `flash_backward` (the settings, the dispatch choice, the launcher);
- eager_forward:      `FlashAttentionTriton.apply` under no_grad;
- eager_forward_backward: `FlashAttentionTriton.apply(...).backward(do)` (autograd's engine included).
What it cannot time without a GPU: Triton's runner and the C launch (launch.lean_runner's saving), the CUDA
allocations and launches. Each row is the median over `--runs` runs of the median of timeit repeats, us per call.
It uses only names every commit since the host-floor work has, so the same file times the commit before the plans:
    git archive COMMIT | tar -x -C /tmp/before && PYTHONPATH=/tmp/before python results/diagnosis/flash_plan_host.py
"""

import argparse
import os
import statistics
import subprocess

os.environ.pop("TRITON_INTERPRET", None)  # the kernels as on a GPU: compiled objects, FastLauncher's fast path on
os.environ["CS336_FLASH_TMA"] = "0"  # the TMA check would ask the CUDA device (none here); the GPU takes pointer
# loads below 16384 keys anyway (FlashSettings.tma_min_keys)

import torch  # noqa: E402
import triton  # noqa: E402

from cs336_systems.kernels import common, flash_triton  # noqa: E402
from cs336_systems.kernels.settings import flash_settings  # noqa: E402

from flash_host_pieces import per_call_us, stub_launches  # noqa: E402 (this folder's: the same no-op launches)

SHAPE = (1, 16, 1024, 128)  # batch, heads, sequence, head dim: the H100 profile's shape (FA2 path, causal)


def inputs(grad=False):
    batch, heads, seq, dim = SHAPE
    # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    return [torch.randn(batch, seq, heads, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(grad)
            for _ in range(3)]


def one_run() -> dict[str, float]:
    q, k, v = inputs()
    out, lse = flash_triton.flash_forward(q, k, v, True)
    do = torch.randn_like(out)
    qg, kg, vg = inputs(grad=True)
    apply = flash_triton.FlashAttentionTriton.apply

    def eager_forward():
        with torch.no_grad():
            apply(qg, kg, vg, True)

    def eager_forward_backward():
        apply(qg, kg, vg, True).backward(do)
        qg.grad = kg.grad = vg.grad = None

    return {
        "settings": per_call_us(flash_settings, 20000),
        "check_inputs": per_call_us(lambda: common.check_inputs(q, k, v, "FlashAttentionTriton"), 5000),
        "forward_triton": per_call_us(lambda: flash_triton.flash_forward_triton(q, k, v, True), 2000),
        "backward_triton": per_call_us(lambda: flash_triton.flash_backward_triton(q, k, v, out, lse, do, True), 1000),
        "forward": per_call_us(lambda: flash_triton.flash_forward(q, k, v, True), 2000),
        "backward": per_call_us(lambda: flash_triton.flash_backward(q, k, v, out, lse, do, True), 1000),
        "eager_forward": per_call_us(eager_forward, 1000),
        "eager_forward_backward": per_call_us(eager_forward_backward, 500),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows to this CSV (piece, us_per_call, runs, ...)")
    parser.add_argument("--runs", type=int, default=3, help="runs of every piece; each row is their median")
    parser.add_argument("--commit", help="the commit measured, where the package is not in a git checkout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stub_launches()
    runs = [one_run() for _ in range(args.runs)]
    rows = {piece: statistics.median(run[piece] for run in runs) for piece in runs[0]}
    here = os.path.dirname(os.path.abspath(flash_triton.__file__))
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    for piece, us in rows.items():
        print(f"{piece:28s} {us:9.2f} us")
    if args.out:
        with open(args.out, "w") as file:
            file.write("piece,us_per_call,runs,shape,git_commit,torch_version,triton_version\n")
            file.writelines(f"{piece},{us:.3f},{args.runs},{'x'.join(map(str, SHAPE))},{commit},"
                            f"{torch.__version__},{triton.__version__}\n" for piece, us in rows.items())


if __name__ == "__main__":
    main()
