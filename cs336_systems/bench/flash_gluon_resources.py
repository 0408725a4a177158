"""Compile the Gluon FlashAttention forward (`kernels/flash/gluon_fwd.py`) for sm_90 without a GPU and read what each
configuration costs: registers, spills (the gate: 0 B) and shared memory.

Triton compiles for a named architecture on any machine; this module puts a stand-in driver in place of CUDA so
that the kernel's own host code (`gluon_fwd.kernel_launch`: the real TMA descriptors, arguments and launch
options) goes through `JITFunction.warmup`, which compiles without launching, and reads `ptxas -v` with the
ptxas in Triton's wheel (`bench.kernel_resources.ptxas_usage`).

    python -m cs336_systems.bench.flash_gluon_resources --out results/flash_gluon_resources.csv

Run in a process of its own: compiling needs Triton's JIT (not the interpreter that `import cs336_systems`
turns on without a GPU), and the stand-in driver replaces the real one for the rest of the process.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: what `warmup` asks of it while compiling for sm_90."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def use_compile_only_driver(capability: int = 90):
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"
    import triton

    if triton.knobs.runtime.interpret:
        raise RuntimeError("Triton was imported under TRITON_INTERPRET=1 in this process; compile in a process of "
                           "its own: python -m cs336_systems.bench.flash_gluon_resources")
    triton.runtime.driver.set_active(CompileOnlyDriver(capability))


# (head dim, causal, dtype, exact): what the launcher ships (both dtypes, both head dims, causal or not) and the
# EXACT variant the GPU tests run.
CONFIGS = [(d, causal, dtype, False) for d in (128, 64) for causal in (True, False) for dtype in ("bf16", "fp16")]
CONFIGS += [(d, causal, "bf16", True) for d in (64, 128) for causal in (False, True)]


def compile_config(head_dim: int, is_causal: bool, dtype: str, exact: bool, n: int = 1000) -> dict:
    """One configuration compiled through the launcher's host code, on CPU stand-in tensors of the model's layout
    ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)); a ragged length, as lengths do not change
    the code beyond Triton's divisibility specialisation."""
    import torch

    from cs336_systems.kernels.flash import gluon_fwd

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q = torch.empty(2, n, 4, head_dim, dtype=torch_dtype).transpose(1, 2)
    lse = torch.empty(2, 4, n, dtype=torch.float32)
    tile = gluon_fwd.tile_for(head_dim)
    args, grid, options = gluon_fwd.kernel_launch(q, q, q, q, lse, is_causal, exact)
    row = {"kernel": "flash_gluon_forward", "head_dim": head_dim, "causal": is_causal, "dtype": dtype,
           "exact": exact, **{k: v for k, v in vars(tile).items() if k != "head_dim"},
           "tile_shared_bytes": tile.shared_bytes()}
    return compiled_row(gluon_fwd.LAUNCHER.kernel, args, grid, options, row)


def compiled_row(kernel, args, grid, options, row: dict, ptx_counts: dict[str, str] | None = None) -> dict:
    """`row` with what compiling `kernel` for these launch arguments costs: ptxas's registers and spills, shared
    memory, the setmaxnreg of each partition and, per name of `ptx_counts`, how often its regex occurs in the PTX.
    A configuration that fails to compile is a row with its error, not the end of the table."""
    from cs336_systems.bench.kernel_resources import ptxas_usage

    start = time.time()
    try:
        compiled = kernel.warmup(*args, grid=grid, **options)
        usage = ptxas_usage(compiled.asm["ptx"])
    except Exception as error:
        return {**row, "status": "error", "error": f"{type(error).__name__}: {error}"[-1500:]}
    ptx = compiled.asm["ptx"]
    setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    counts = {name: len(re.findall(pattern, ptx)) for name, pattern in (ptx_counts or {}).items()}
    # the named barriers Triton gives ids of its own (immediates; ids in registers are the kernel's own turns)
    fixed_ids = sorted({int(i) for i in re.findall(r"\b(?:bar|barrier)\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)", ptx)})
    return {**row, **usage, "shared_bytes": compiled.metadata.shared,
            "setmaxnreg": " ".join(f"{kind}{regs}" for kind, regs in setmaxnreg), **counts,
            "triton_barrier_ids": " ".join(map(str, fixed_ids)),
            "register_barriers": len(re.findall(r"\bbar\.(?:sync|arrive)\s+%r\d+", ptx)),
            "compile_s": round(time.time() - start, 1), "status": "ok"}


def finish(rows: list[dict], out: str | None) -> None:
    """The compile table's end: its rows to `out` (if given) with this machine's provenance, then exit 1 if a
    configuration failed to compile (its row holds the error)."""
    from cs336_systems.provenance import provenance
    from cs336_systems.results import write_rows

    if out:
        prov = provenance("cpu")
        write_rows([{**row, **prov} for row in rows], out)
    if any(row["status"] != "ok" for row in rows):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=int, default=None, help="only these head dims (64, 128)")
    parser.add_argument("--no-exact", action="store_true", help="skip the EXACT (test-only) variants")
    parser.add_argument("--only-first", action="store_true", help="only the first selected configuration (tests)")
    parser.add_argument("--out", default=None, help="CSV file for the rows (printed either way)")
    args = parser.parse_args(argv)
    use_compile_only_driver()

    rows = []
    for head_dim, causal, dtype, exact in CONFIGS:
        if (args.head_dims and head_dim not in args.head_dims) or (exact and args.no_exact):
            continue
        row = compile_config(head_dim, causal, dtype, exact)
        rows.append(row)
        shown = (f"{row['registers']} registers, {row['spill_store_bytes']} B spill stores, "
                 f"{row['spill_load_bytes']} B spill loads, {row['shared_bytes']} B shared, setmaxnreg "
                 f"{row['setmaxnreg']}, {row['compile_s']} s" if row["status"] == "ok" else row["error"])
        print(f"d={head_dim} causal={causal} {dtype} exact={exact} num_slots={row['num_slots']}: {shown}", flush=True)
        if args.only_first:
            break
    finish(rows, args.out)


if __name__ == "__main__":
    main()
