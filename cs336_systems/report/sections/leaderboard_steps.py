"""2026 §9, the leaderboard step's tables (rule leaderboard_8b): the step table (one row per provider per run), the
runs table (its provenance, once per run) and the ablation table, with the lookups the prose and the verdict
quote them by (`row_of`, `step_of`, `cell_of`: the quoted run's row unless a run is named)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import formula_frame
from cs336_systems.report.sections.leaderboard_handout import bench_rows
from cs336_systems.report.sections.leaderboard_profile import QUOTED, SWAPPED

ANCHOR = "torch_plain_sac"  # the strongest plain-PyTorch anchor (issue 24): torchtitan's selective checkpointing
ABLATION_CHANGES = {  # what each ablation switches off (bench/leaderboard.py's docstring)
    "ours-no_fused_ce": "plain CE of the full logits instead of our fused LM head + CE",
    "ours-torch_adamw": "torch's fused AdamW instead of ours",
    SWAPPED: "SDPA attention instead of our FlashAttention",
    "ours-full_ac": "every block fully recomputed instead of selective checkpointing",
    "ours-fp32_moments": "float32 AdamW moments (numerics variant)",
    "ours-selective": "plain selective checkpointing (no block saves its matmul outputs)",
    "ours-whole_batch": "forward and backward over the whole batch at once instead of one sequence at a time",
    "ours-state_on_host": "AdamW's state in pinned host memory between steps, fetched back during the last backward",
}
SIZED_CHANGES = {  # ours-keep:N and ours-mm:N, parsed by bench/leaderboard.py
    "ours-keep:": "the first {} blocks kept whole (not checkpointed), the rest selective",
    "ours-mm:": "the first {} blocks also save their matmul outputs (their rerun skips the GEMMs), the rest selective",
}


def sized_ablation(provider: str) -> tuple[str, str] | None:
    """(prefix, N) of a sized ablation's name."""
    return next(((prefix, provider.removeprefix(prefix)) for prefix in SIZED_CHANGES if provider.startswith(prefix)),
                None)


def ablation_change(provider: str) -> str | None:
    """What an ablation of ours changes (None: not an ablation)."""
    sized = sized_ablation(provider)
    if sized:
        return SIZED_CHANGES[sized[0]].format(sized[1])
    return ABLATION_CHANGES.get(provider)


def is_ablation(providers: pd.Series) -> pd.Series:
    return providers.map(lambda p: ablation_change(str(p)) is not None)


STEP = "step (ms, mean ± std)"
SEQUENCES = "sequences / pass"  # per forward and backward pass; fewer than the batch: gradients accumulated
RATIO = "÷ SAC anchor"
TARGET_RATIO, TARGET_MFU = 0.9, 0.54  # issue 24's target: at most 0.9x the SAC anchor's step, at least 54% MFU
HANDOUT_BATCH = 2  # the batch the leaderboard times (handout §9)
# Kept in the step table's data, not printed (the runs table prints them once per run): the prose counts commits and
# states each point's statistic from them.
COMMIT, WARMUP, TIMED = "commit", "warm-up steps", "timed steps"
# The step table's numeric columns: results column and format (OOM rows print OOM in each). One statistic per
# table: the mean (with its std) is what the ratios, MFU and prose use, so the table shows no median beside it.
MEASURED = {"MFU": ("mfu", ".3f"), "TFLOP/s": ("tflops", ",.1f"),
            "peak (GiB)": ("peak_mem_gib", ",.2f"), "first step (s)": ("first_step_s", ",.1f")}
# The timed steps' mean SM clock and board power (bench.gpu_clock): recorded by the later runs only, so shown only
# once some row has them (the runs before print '—').
CLOCKS = {"SM clock (MHz)": ("sm_clock_mhz", ",.0f"), "power (W)": ("power_w", ",.0f")}


def _step_columns(rows: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """The step table's measured columns: MEASURED, and CLOCKS' where some row has them."""
    return {**MEASURED, **{label: (column, fmt) for label, (column, fmt) in CLOCKS.items()
                           if column in rows and rows[column].notna().any()}}


def step_table(frame: pd.DataFrame) -> NumericTable:
    """One row per provider per run: step mean ± std, MFU, TFLOP/s, peak memory, first step, (once recorded) SM
    clock and board power, checkpointing, dtypes, status, and the step's mean over the SAC anchor's of the same run
    and batch. A measurement this device does not make (MFU on a CPU) prints '—'; an out-of-memory row prints OOM.
    Rows in the order the runs ran (the merge sorts them by timestamp); the data keeps `quoted` (not printed)."""
    rows = bench_rows(frame).reset_index(drop=True)
    measured = _step_columns(rows)
    data = pd.DataFrame({
        "run": rows["run_id"].astype(str).str[:6], "provider": rows["provider"], "batch": rows["batch"],
        STEP: rows["step_ms"], "step std (ms)": rows["step_std_ms"],
        **{label: rows[column] for label, (column, _) in measured.items()},
        "checkpoint": rows["checkpoint"], SEQUENCES: rows["microbatch"],
        "params / moments": rows["param_dtype"] + " / " + rows["optimizer_state_dtype"], "status": rows["status"],
        QUOTED: rows[QUOTED].astype(bool), COMMIT: rows["git_commit"].astype(str).str[:7],
        WARMUP: rows["warmup"], TIMED: rows["n_steps"]})
    anchor = data[data["provider"] == ANCHOR].set_index(["run", "batch"])[STEP]
    data[RATIO] = [m / anchor.get((run, batch), float("nan")) for m, run, batch in
                   zip(data[STEP], data["run"], data["batch"])]
    oom = {i: "oom" for i, status in enumerate(rows["status"]) if status == "oom"}
    return NumericTable(data, (Col("run"), Col("provider"), Col("batch", "d"), Col(STEP, ",.1f", second="step std (ms)"),
                               *(Col(label, fmt) for label, (_, fmt) in measured.items()), Col("checkpoint"),
                               Col(SEQUENCES, "d"), Col("params / moments"), Col("status"), Col(RATIO, ".3f")),
                        {header: dict(oom) for header in (STEP, *measured)} if oom else {})


def runs_table(frame: pd.DataFrame) -> NumericTable:
    """One row per run and batch, in the order they ran: its commit and date, the providers it timed, its warm-up
    and timed steps, ours' checkpointing and sequences per pass, the allocator setting, and whether the prose
    quotes it. The step table's provenance, printed once per run."""
    rows = bench_rows(frame).reset_index(drop=True)
    ours = rows[rows["provider"] == "ours"].set_index(["run_id", "batch"])
    runs = rows.groupby(["run_id", "batch"], sort=False)
    keys = list(dict.fromkeys(zip(rows["run_id"], rows["batch"])))  # in the order they ran
    first = runs.first()

    def of_ours(column: str, default):
        return [ours.at[key, column] if key in ours.index else default for key in keys]

    timed = rows[rows["status"] == "ok"].groupby(["run_id", "batch"], sort=False)
    data = pd.DataFrame({
        "run": [str(r)[:6] for r, _ in keys], COMMIT: [str(first.at[k, "git_commit"])[:7] for k in keys],
        "date": [str(first.at[k, "timestamp"])[:10] for k in keys], "batch": [b for _, b in keys],
        "providers": [int(runs.size()[k]) for k in keys],
        WARMUP: [timed["warmup"].max().get(k, float("nan")) for k in keys],
        TIMED: [timed["n_steps"].max().get(k, float("nan")) for k in keys],
        "ours' checkpoint": of_ours("checkpoint", "—"), SEQUENCES: of_ours("microbatch", float("nan")),
        "allocator": [str(first.at[k, "cuda_alloc_conf"]) if pd.notna(first.at[k, "cuda_alloc_conf"]) else "default"
                      for k in keys],
        QUOTED: ["yes" if bool(first.at[k, QUOTED]) else "" for k in keys]})
    return NumericTable(data, (Col("run"), Col(COMMIT), Col("date"), Col("batch", "d"), Col("providers", "d"),
                               Col(WARMUP, ".0f"), Col(TIMED, ".0f"), Col("ours' checkpoint"), Col(SEQUENCES, ".0f"),
                               Col("allocator"), Col(QUOTED)))


def ablation_runs(table: pd.DataFrame) -> list[str]:
    """The runs with ablation rows, in the order they ran."""
    return list(dict.fromkeys(table.loc[is_ablation(table["provider"]), "run"]))


def row_of(table: pd.DataFrame, provider: str, run: str | None = None, batch: int | None = None) -> int | None:
    """The position of one row of the step table (None if absent): without a run, the quoted run's."""
    chosen = table[(table["provider"] == provider) & ((table["run"] == run) if run else table[QUOTED].astype(bool))
                   & ((table["batch"] == batch) if batch else True)]
    return int(chosen.index[-1]) if len(chosen) else None


def step_of(table: pd.DataFrame, provider: str, run: str | None = None, batch: int | None = None) -> float:
    """The mean step of one row of the step table's numbers (NaN for OOM or absent)."""
    row = row_of(table, provider, run, batch)
    return float("nan") if row is None else float(table.at[row, STEP])


def ablation_table(frame: pd.DataFrame) -> NumericTable:
    """Every run's ablations: each one's step against `ours` of the same run and batch (what switching that
    optimisation off costs, > 1, or saves, < 1), its peak memory and moments' dtype."""
    steps = step_table(frame)
    numbers = formula_frame(steps)
    chosen = numbers[is_ablation(numbers["provider"])]
    ours = [step_of(numbers, "ours", run, b) for run, b in zip(chosen["run"], chosen["batch"])]
    data = pd.DataFrame({
        "run": chosen["run"].to_numpy(), "ablation": chosen["provider"].to_numpy(),
        "changes": chosen["provider"].map(ablation_change).to_numpy(),
        "batch": chosen["batch"].to_numpy(), STEP: chosen[STEP].to_numpy(),
        "step std (ms)": chosen["step std (ms)"].to_numpy(), "ours (ms, mean)": ours,
        "÷ ours": chosen[STEP].to_numpy() / ours, "peak (GiB)": chosen["peak (GiB)"].to_numpy(),
        "params / moments": chosen["params / moments"].to_numpy(), "status": chosen["status"].to_numpy()})
    oom = {i: "oom" for i, status in enumerate(data["status"]) if status == "oom"}
    return NumericTable(data, (Col("run"), Col("ablation"), Col("changes"), Col("batch", "d"),
                               Col(STEP, ",.1f", second="step std (ms)"), Col("ours (ms, mean)", ",.1f"),
                               Col("÷ ours", ".3f"), Col("peak (GiB)", ",.2f"), Col("params / moments"), Col("status")),
                        {STEP: dict(oom), "peak (GiB)": dict(oom)} if oom else {})


def cell_of(table: pd.DataFrame, provider: str, column: str, batch: int | None = None, run: str | None = None) -> float:
    row = row_of(table, provider, run, batch)
    return float("nan") if row is None else float(table.at[row, column])


def is_measured(value: float) -> bool:
    return value == value  # not NaN: a CPU run has no MFU, an OOM row no step


def quoted_ours_at_leaderboard_batch(table: pd.DataFrame) -> int:
    """The step table's row of ours at the leaderboard's batch in the quoted run (the front page's headlines); a
    ValueError where the table has none."""
    row = row_of(table, "ours", batch=HANDOUT_BATCH)
    if row is None:
        raise ValueError(f"the 8B step table has no quoted row of ours at batch {HANDOUT_BATCH}")
    return row
