"""Registers and spills of our FlashAttention-2 Triton kernels per tile config, compiled without a GPU.

Triton compiles for a named GPU architecture on any machine, and its wheel ships NVIDIA's ptxas; with
`ptxas -v` on the generated PTX we read what each config costs a thread: registers, the stack frame,
and the bytes spilled to local memory (which lives in DRAM behind the L1). A config that spills runs
its inner loop through memory, so this table explains timings, for example why our float32 kernels
were slow with IEEE dots (which keep their operands in registers) and the tiles chosen for 16-bit
inputs, and which float32 tiles fit in shared memory.

    python -m cs336_systems.bench.kernel_resources --arch 90 --dtypes bf16 fp32 --head-dims 64 128 \
        --out results/flash_resources.csv

The launch is modelled as the benchmarks make it: causal, lengths that fill the tiles, contiguous
inputs (unit stride in the head dim, the other strides multiples of 16).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

# The kernels by their names in kernels/flash/fa2.TUNED_KERNELS and tuning.TILINGS, spelled out here
# because those modules import Triton, which must wait for `use_compiler`.
KERNELS = ("forward", "backward_dkdv", "backward_dq")
POINTER_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
FLOAT32_TENSORS = {"L", "DELTA"}  # the logsumexp and rowsum(dO * O) are float32 whatever the inputs


def use_compiler() -> None:
    """Compiling needs Triton's JIT, not the interpreter that TRITON_INTERPRET=1 (inherited from a CPU
    test session or smoke-scale job) would switch on. Triton reads the switch when it and the kernels
    are imported, so this must come before either is."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"


def flash_module():
    """kernels/flash/fa2.py, its kernels defined for compiling."""
    import triton

    from cs336_systems.kernels.flash import fa2

    if fa2.INTERPRET or triton.knobs.runtime.interpret:
        raise RuntimeError("Triton and the kernels were imported under TRITON_INTERPRET=1 in this process; compile "
                           "them in a process of their own: python -m cs336_systems.bench.kernel_resources")
    return fa2


def _jit_function(kernel):
    """The JIT function under the autotuner and heuristics wrappers."""
    import triton

    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _dot_precision(dtype: str, float32_dot: str | None = None) -> str:
    """The kernels' PRECISION for this input dtype (16-bit inputs ignore it); float32 inputs use
    float32_dot, or the setting in force (kernels/flash/settings.py)."""
    from cs336_systems.kernels.flash.settings import flash_settings

    return (float32_dot or flash_settings().float32_dot) if dtype == "fp32" else "tf32"


def _source(kernel, dtype: str, head_dim: int, blocks: dict[str, int], float32_dot: str | None = None):
    import triton

    fn = _jit_function(kernel)
    constants = {"IS_CAUSAL": True, "PRECISION": _dot_precision(dtype, float32_dot), "BLOCK_D": head_dim,
                 "EVEN_M": True, "EVEN_N": True, "EVEN_D": True, **blocks}
    if "TMA" in fn.arg_names:  # the forward's pointer-load path (the tensor-descriptor one needs a device)
        constants["TMA"] = False
    signature, divisible = {}, []
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.startswith("stride") and name.endswith("d"):  # unit stride along the head dim
            signature[name], constants[name] = "constexpr", 1
        elif name in TENSORS | FLOAT32_TENSORS:
            signature[name] = "*fp32" if name in FLOAT32_TENSORS else POINTER_DTYPES[dtype]
            divisible.append(index)
        elif name in ("qk_scale", "sm_scale"):
            signature[name] = "fp32"
        else:  # other strides, sizes: multiples of 16 at the benchmarked shapes, as Triton specializes them
            signature[name] = "i32"
            divisible.append(index)
    names = fn.arg_names
    return triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in divisible})


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes that `ptxas -v` reports for the PTX's one kernel."""
    from triton import knobs

    # The ptxas Triton itself compiles with, whose version set the PTX's `.version`: on the GPU machines that is
    # not the one in Triton's wheel (CUDA 12.8's ptxas there refused the PTX 9.0 Triton wrote: "Unsupported
    # .version 9.0", exit 255, on an H100 and an H200).
    ptxas = knobs.nvidia.ptxas.path
    arch = re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        done = subprocess.run([str(ptxas), "-v", "--gpu-name", arch, source.name, "-o", os.devnull],
                              capture_output=True, text=True)
    report = done.stdout + done.stderr
    if done.returncode != 0:  # ptxas says why on stderr
        raise RuntimeError(f"ptxas -v exited {done.returncode}: {report.strip()[-400:]}")
    numbers = {"registers": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
               "spill_store_bytes": r"(\d+) bytes spill stores", "spill_load_bytes": r"(\d+) bytes spill loads"}
    found = {key: re.search(pattern, report) for key, pattern in numbers.items()}
    missing = [key for key, match in found.items() if match is None]
    if missing:
        raise RuntimeError(f"ptxas -v did not report {', '.join(missing)}:\n{report}")
    return {key: int(match.group(1)) for key, match in found.items()}


def measure(kernel_name: str, dtype: str, head_dim: int, tile: tuple[int, int, int, int], arch: int,
            float32_dot: str | None = None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = flash_module().TUNED_KERNELS[kernel_name]
    from cs336_systems.kernels.flash.tuning import TILINGS

    outer_name, inner_name = TILINGS[kernel_name].outer, TILINGS[kernel_name].inner
    outer, inner, warps, stages = tile
    row = {"kernel": kernel_name, "dtype": dtype, "dot": _dot_precision(dtype, float32_dot), "head_dim": head_dim,
           "outer": outer, "inner": inner,
           "warps": warps, "stages": stages, "arch": f"sm_{arch}"}
    try:
        compiled = triton.compile(_source(kernel, dtype, head_dim, {outer_name: outer, inner_name: inner}, float32_dot),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        usage = ptxas_usage(compiled.asm["ptx"])
    except Exception as error:  # a config the compiler rejects is a row, not the end of the table
        return {**row, "status": "error", "error": f"{type(error).__name__}: {error}"[:300]}
    return {**row, **usage, "shared_bytes": compiled.metadata.shared, "status": "ok"}


def tiles_for(kernel_name: str, dtype: str) -> list[tuple[int, int, int, int]]:
    """The kernel's tiles as the autotuner sees them for this dtype (long sequences): its own pruning
    of the tile list plus the float32-only tiles."""
    flash_module()  # the check that Triton compiles in this process
    from cs336_systems.kernels.flash.tuning import TILINGS, prune_configs, tile_configs

    tiling = TILINGS[kernel_name]
    outer, inner = tiling.outer, tiling.inner
    configs = tile_configs(tiling.tiles, outer, inner)
    kept = prune_configs(configs, {}, PRECISION=_dot_precision(dtype), SEQ_KEY_Q=2**16, SEQ_KEY_K=2**16)
    return [(c.kwargs[outer], c.kwargs[inner], c.num_warps, c.num_stages) for c in kept]


def parse_tile(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"tile {text!r} is not 'outer,inner,warps,stages' (e.g. 64,32,4,2)")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 and H200)")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
                        help="kernels to compile: forward, backward_dkdv, backward_dq")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(POINTER_DTYPES),
                        help="input dtypes")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[16, 32, 64, 128],
                        help="head dims (16, 32, 64, 128)")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=None,
                        help="tiles to compile instead of each kernel's autotuning list, as outer,inner,warps,stages")
    parser.add_argument("--float32-dots", nargs="+", default=None, choices=["tf32x3", "ieee"],
                        help="float32 dot precisions to compile (default: the float32_dot setting, "
                             "CS336_FLASH_FLOAT32_DOT)")
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    use_compiler()
    if args.arch < 70:  # Triton's NVIDIA backend compiles for Volta (sm_70) and later
        parser.error(f"--arch {args.arch}: give a compute capability x 10 of at least 70 (90: H100)")
    for d in args.head_dims:
        if d not in (16, 32, 64, 128):
            parser.error(f"--head-dims {d}: the kernels take head dims 16, 32, 64 and 128")
    rows = []
    for kernel_name in args.kernels:
        for dtype in args.dtypes:
            for dot in (args.float32_dots or [None]) if dtype == "fp32" else [None]:
                for head_dim in args.head_dims:
                    for tile in args.tiles or tiles_for(kernel_name, dtype):
                        row = measure(kernel_name, dtype, head_dim, tile, args.arch, dot)
                        rows.append(row)
                        shown = (f"{row['registers']} registers, {row['spill_store_bytes']} B spilled"
                                 if row["status"] == "ok" else row["error"])
                        print(f"{kernel_name} {dtype} ({row['dot']}) d={head_dim} tile={tile}: {shown}",
                              file=sys.stderr, flush=True)
    prov = provenance("cpu")
    write_rows([{**row, **prov} for row in rows], args.out)


if __name__ == "__main__":
    main()
