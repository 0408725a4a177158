"""Compile the Gluon FlashAttention backward (`kernels/flash/gluon_bwd.py`) for sm_90 without a GPU and read what
each configuration costs: registers, spills and shared memory. The sibling of `bench.flash_gluon_resources` (the
forward's), with its stand-in driver: the backward's own host code (`gluon_bwd.kernel_launch`: real TMA
descriptors, arguments, launch options) goes through `JITFunction.warmup`, which compiles without launching, and
`ptxas -v` of Triton's wheel reads the result.

    python -m cs336_systems.bench.flash_gluon_bwd_resources --out results/flash_gluon_bwd_resources.csv

With `--sass-check DIR` (a folder holding the Gluon probe's `sass_check.py`) each row also counts the register-A
HGMMAs in the SASS and the register-A hazards among them (the gate: 0).

Run in a process of its own (see bench.flash_gluon_resources).
"""

from __future__ import annotations

import argparse

from cs336_systems.bench.flash_gluon_resources import compiled_row, finish, use_compile_only_driver

# (head dim, causal, dtype, variant): what the launcher ships ("shipped": TILES' tile), then the EXACT kernel the
# GPU tests run ("exact": the shipped tile with P^T = S^T mod 8), bf16.
VARIANTS = {"shipped": False, "exact": True}  # name -> EXACT
CONFIGS = [(d, causal, dtype, "shipped") for d in (64, 128) for causal in (True, False) for dtype in ("bf16", "fp16")]
CONFIGS += [(d, causal, "bf16", "exact") for d in (64, 128) for causal in (True, False)]


def compile_config(head_dim: int, is_causal: bool, dtype: str, variant: str = "shipped", n: int = 1000,
                   sass_check_dir: str | None = None) -> dict:
    """One configuration compiled through the launcher's host code, on CPU stand-in tensors of the model's layout
    ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)), a ragged length; with sass_check_dir, the
    register-A hazard count of its SASS too."""
    import torch

    from cs336_systems.kernels.flash import gluon_bwd

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} ({', '.join(VARIANTS)})")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tile = gluon_bwd.tile_for(head_dim)
    q = torch.empty(2, n, 4, head_dim, dtype=torch_dtype).transpose(1, 2)
    dq_acc = torch.empty(2, 4, n, head_dim, dtype=torch.float32)
    rows = torch.empty(8, gluon_bwd.padded_queries(n, tile), dtype=torch.float32)
    args, grid, options = gluon_bwd.kernel_launch(q, q, q, q, q, q, dq_acc, rows, rows, is_causal, head_dim**-0.5,
                                                  VARIANTS[variant])
    row = {"kernel": "flash_gluon_backward", "head_dim": head_dim, "causal": is_causal, "dtype": dtype,
           "variant": variant, **{k: v for k, v in vars(tile).items() if k != "head_dim"},
           "tile_shared_bytes": tile.shared_bytes()}
    kernel = gluon_bwd.LAUNCHER.kernel
    row = compiled_row(kernel, args, grid, options, row, ptx_counts={"tma_reduce_ops": r"cp\.reduce\.async\.bulk\.tensor"})
    if sass_check_dir and row["status"] == "ok":
        cubin = kernel.warmup(*args, grid=grid, **options).asm["cubin"]  # cached: no recompile
        row.update(register_a_counts(cubin, sass_check_dir))
    return row


def register_a_counts(cubin: bytes, sass_check_dir: str) -> dict:
    """The probe's static SASS check (`sass_check.analyse_cubin`, imported from its folder: it is not part of the
    package): register-A HGMMAs and the hazards among them (ptxas rewriting an A register before the wait)."""
    import importlib.util
    from pathlib import Path

    path = Path(sass_check_dir) / "sass_check.py"
    if not path.is_file():
        raise FileNotFoundError(f"--sass-check {sass_check_dir}: no sass_check.py there")
    spec = importlib.util.spec_from_file_location("sass_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.analyse_cubin(cubin)
    return {"register_a_hgmma": found["register_a_hgmma"], "register_a_hazards": found["register_a_hazards"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=int, default=None, help="only these head dims (64, 128)")
    parser.add_argument("--shipped-only", action="store_true", help="skip the EXACT rows")
    parser.add_argument("--only-first", action="store_true", help="only the first selected configuration (tests)")
    parser.add_argument("--sass-check", default=None, metavar="DIR",
                        help="folder of the Gluon probe's sass_check.py: also count register-A hazards in the SASS")
    parser.add_argument("--out", default=None, help="CSV file for the rows (printed either way)")
    args = parser.parse_args(argv)
    use_compile_only_driver()

    rows = []
    for head_dim, causal, dtype, variant in CONFIGS:
        if (args.head_dims and head_dim not in args.head_dims) or (variant != "shipped" and args.shipped_only):
            continue
        row = compile_config(head_dim, causal, dtype, variant, sass_check_dir=args.sass_check)
        rows.append(row)
        shown = (f"{row['registers']} registers, {row['spill_store_bytes']} B spill stores, "
                 f"{row['spill_load_bytes']} B spill loads, {row['shared_bytes']} B shared, setmaxnreg "
                 f"{row['setmaxnreg']}, {row['tma_reduce_ops']} TMA reduce ops, {row['compile_s']} s"
                 + (f", {row['register_a_hazards']} register-A hazards in {row['register_a_hgmma']} register-A HGMMAs"
                    if "register_a_hazards" in row else "")
                 if row["status"] == "ok" else row["error"])
        print(f"d={head_dim} causal={causal} {dtype} {variant}: {shown}", flush=True)
        if args.only_first:
            break
    finish(rows, args.out)


if __name__ == "__main__":
    main()
