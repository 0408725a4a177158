"""Compile the Gluon FlashAttention backward (`kernels/flash_gluon_bwd.py`) for sm_90 without a GPU and read what
each configuration costs: registers, spills (the gate: 0 B) and shared memory. The sibling of
`bench.flash_gluon_resources` (the forward's), with its stand-in driver: the backward's own host code
(`flash_gluon_bwd.kernel_launch`: real TMA descriptors, arguments, launch options) goes through
`JITFunction.warmup`, which compiles without launching, and `ptxas -v` of Triton's wheel reads the result.

    python -m cs336_systems.bench.flash_gluon_bwd_resources --out results/diagnosis/flash_gluon_stage2/resources.csv

With `--sass-check DIR` (the folder of the Gluon probe's `sass_check.py`, e.g. /work/shared/probes/gluon-hopper) each
row also counts the register-A HGMMAs in the SASS and the register-A hazards among them (the gate: 0).

Run in a process of its own (see bench.flash_gluon_resources).
"""

from __future__ import annotations

import argparse

from cs336_systems.bench.flash_gluon_resources import compiled_row, finish, use_compile_only_driver

# (head dim, causal, dtype, variant): what the launcher ships, then (bf16) the alternative dQ scheme, for the record:
# "shipped" is TILES' tile; "split_dq" / "per_consumer_dq" force that dQ scheme (flash_gluon_bwd.BwdTile.split_dq);
# "exact" is the shipped tile with EXACT (P^T = S^T mod 8), which the GPU tests run; the schedules of the v2 work
# (BwdTile.defer_dq, dq_buffers) each with its EXACT twin: VARIANTS
# Every variant but the shipped one names its whole schedule (from the lockstep one), so that it means the same
# whichever schedule TILES ships.
LOCKSTEP = {"defer_dq": False, "pingpong": False, "dq_buffers": 1}
VARIANTS = {  # name -> (BwdTile fields changed from TILES', EXACT)
    "shipped": ({}, False),
    "exact": ({}, True),
    "lockstep": (LOCKSTEP, False),
    "split_dq": ({**LOCKSTEP, "split_dq": True}, False),
    "per_consumer_dq": ({**LOCKSTEP, "split_dq": False}, False),
    "deferred_dq": ({**LOCKSTEP, "defer_dq": True}, False),
    "deferred_exact": ({**LOCKSTEP, "defer_dq": True}, True),
    "dq2": ({**LOCKSTEP, "dq_buffers": 2}, False),
    "dq2_exact": ({**LOCKSTEP, "dq_buffers": 2}, True),
    "deferred_dq2": ({**LOCKSTEP, "defer_dq": True, "dq_buffers": 2}, False),
    "deferred_dq2_exact": ({**LOCKSTEP, "defer_dq": True, "dq_buffers": 2}, True),
    "pingpong": ({**LOCKSTEP, "defer_dq": True, "pingpong": True}, False),
    "pingpong_exact": ({**LOCKSTEP, "defer_dq": True, "pingpong": True}, True),
}
# The d=64 candidates of issue #26's tile search (results/diagnosis/flash_gluon_d64.py times them), lockstep:
# "m{block_m}_s{num_slots}_{split|percons}", block_m 64 or 128 (queries per step) x Q/dO ring depth 2-4 x dQ scheme;
# "m{block_m}_s{num_slots}_deferred" the deferred schedule (split dQ only). BwdTile refuses what does not fit sm_90's
# shared memory (block_m 128 with more than 2 slots): d64_tile_variants leaves those out and says why.
def _d64_name(block_m: int, num_slots: int, split_dq: bool | None) -> str:
    scheme = "deferred" if split_dq is None else ("split" if split_dq else "percons")
    return f"m{block_m}_s{num_slots}_{scheme}"


D64_CANDIDATES = {_d64_name(bm, slots, split): {**LOCKSTEP, "block_m": bm, "num_slots": slots,
                                                 "split_dq": split is not False, "defer_dq": split is None}
                  for bm in (64, 128) for slots in (2, 3, 4) for split in (True, False, None)}
for _name, _fields in D64_CANDIDATES.items():
    VARIANTS[_name] = (_fields, False)
    VARIANTS[_name + "_exact"] = (_fields, True)


def d64_tile_variants() -> tuple[list[str], dict[str, str]]:
    """The d=64 candidates BwdTile takes, and why it refuses the others (name -> its ValueError)."""
    from dataclasses import replace

    from cs336_systems.kernels import flash_gluon_bwd as bwd

    taken, refused = [], {}
    for name, fields in D64_CANDIDATES.items():
        try:
            replace(bwd.tile_for(64), **fields)
        except ValueError as error:
            refused[name] = str(error)
        else:
            taken.append(name)
    return taken, refused


CONFIGS = [(d, causal, dtype, "shipped") for d in (64, 128) for causal in (True, False) for dtype in ("bf16", "fp16")]
CONFIGS += [(d, causal, "bf16", "lockstep") for d in (64, 128) for causal in (True, False)]  # what d=128 shipped before
CONFIGS += [(d, causal, "bf16", "per_consumer_dq") for d in (64, 128) for causal in (True, False)]
CONFIGS += [(d, causal, "bf16", "exact") for d in (64, 128) for causal in (True, False)]  # the GPU tests' EXACT
for _variant, _exact_twin in (("deferred_dq", "deferred_exact"), ("dq2", "dq2_exact"),
                              ("deferred_dq2", "deferred_dq2_exact"), ("pingpong", "pingpong_exact")):  # every dtype, then the EXACT twin in bf16
    CONFIGS += [(d, causal, dtype, _variant) for d in (64, 128) for causal in (True, False)
                for dtype in ("bf16", "fp16")]
    CONFIGS += [(d, causal, "bf16", _exact_twin) for d in (64, 128) for causal in (True, False)]


def variant_tile(head_dim: int, variant: str):
    """The tile of a variant name (see CONFIGS)."""
    from dataclasses import replace

    from cs336_systems.kernels import flash_gluon_bwd as bwd

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} ({', '.join(VARIANTS)})")
    return replace(bwd.tile_for(head_dim), **VARIANTS[variant][0])


def compile_config(head_dim: int, is_causal: bool, dtype: str, variant: str = "shipped", n: int = 1000,
                   sass_check_dir: str | None = None) -> dict:
    """One configuration compiled through the launcher's host code, on CPU stand-in tensors of the model's layout
    ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)), a ragged length; with sass_check_dir, the
    register-A hazard count of its SASS too."""
    import torch

    from cs336_systems.kernels import flash_gluon_bwd as bwd

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tile = variant_tile(head_dim, variant)
    q = torch.empty(2, n, 4, head_dim, dtype=torch_dtype).transpose(1, 2)
    dq_acc = torch.empty(2, 4, n, head_dim, dtype=torch.float32)
    rows = torch.empty(8, bwd.padded_queries(n, tile), dtype=torch.float32)
    args, grid, options = bwd.kernel_launch(q, q, q, q, q, q, dq_acc, rows, rows, is_causal, head_dim**-0.5,
                                            tile, VARIANTS[variant][1])
    row = {"kernel": "flash_gluon_backward", "head_dim": head_dim, "causal": is_causal, "dtype": dtype,
           "variant": variant, **{k: v for k, v in vars(tile).items() if k != "head_dim"},
           "tile_shared_bytes": tile.shared_bytes()}
    row = compiled_row(bwd._flash_bwd_gluon_kernel, args, grid, options, row,
                       ptx_counts={"tma_reduce_ops": r"cp\.reduce\.async\.bulk\.tensor"})
    if sass_check_dir and row["status"] == "ok":
        cubin = bwd._flash_bwd_gluon_kernel.warmup(*args, grid=grid, **options).asm["cubin"]  # cached: no recompile
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
    parser.add_argument("--shipped-only", action="store_true", help="skip the alternative dQ scheme's rows")
    parser.add_argument("--only-first", action="store_true", help="only the first selected configuration (tests)")
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"only these variants ({', '.join(VARIANTS)})")
    parser.add_argument("--d64-tiles", action="store_true",
                        help="the d=64 tile candidates (D64_CANDIDATES that BwdTile takes, each with its EXACT twin), "
                        "bf16, causal or not, instead of CONFIGS")
    parser.add_argument("--sass-check", default=None, metavar="DIR",
                        help="folder of the Gluon probe's sass_check.py: also count register-A hazards in the SASS")
    parser.add_argument("--out", default=None, help="CSV file for the rows (printed either way)")
    args = parser.parse_args(argv)
    use_compile_only_driver()

    configs = CONFIGS
    if args.d64_tiles:
        taken, refused = d64_tile_variants()
        for name, why in refused.items():
            print(f"d=64 {name}: refused by BwdTile: {why}", flush=True)
        configs = [(64, causal, "bf16", variant + suffix) for variant in taken for suffix in ("", "_exact")
                   for causal in (True, False)]
    rows = []
    for head_dim, causal, dtype, variant in configs:
        if ((args.head_dims and head_dim not in args.head_dims) or (variant != "shipped" and args.shipped_only)
                or (args.variants and variant not in args.variants)):
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
