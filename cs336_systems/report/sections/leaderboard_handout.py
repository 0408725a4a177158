"""2026 §9, the leaderboard's own test: ours' 8B step timed as the handout's test times it
(`triton.testing.do_bench(train_step, rep=30_000, warmup=10_000)`, from empty compilation caches; the rows of
results/leaderboard_8b.csv whose `timer` is do_bench, written by rule leaderboard_8b_run after the bench), beside
ours' step in the bench's own run just before it. Every number of the prose is a cell of the table or a formula
over its cells."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Quotes, Section

TIMER = "timer"  # how a row's step was timed: "steps" (the bench's loop; runs older than the column) or "do_bench"
DO_BENCH = "do_bench"
LIMIT_S = 600  # the leaderboard's limit on the whole run from empty caches (handout 2026 §9)
MEAN = "do_bench (ms, mean)"
BENCH = "bench's ours (ms, mean)"
WALL = "run wall (s)"
COMMAND = "snakemake results/leaderboard_8b.csv --forcerun leaderboard_8b_run --cores 1 --resources gpu=1"


def timers(frame: pd.DataFrame) -> pd.Series:
    """Each row's timer, "steps" where the row predates the column."""
    return frame[TIMER].fillna("steps") if TIMER in frame else pd.Series("steps", index=frame.index)


def bench_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows the bench's own loop timed (the step, ablation and runs tables)."""
    return frame[timers(frame) == "steps"]


def _bench_step(frame: pd.DataFrame, row: pd.Series) -> tuple[str, float]:
    """(run, ours' mean step) of the latest bench run before the do_bench row, at its batch and commit."""
    bench = bench_rows(frame)
    before = bench[(bench["provider"] == "ours") & (bench["batch"] == row["batch"]) & (bench["status"] == "ok")
                   & (bench["git_commit"] == row["git_commit"]) & (bench["timestamp"] < row["timestamp"])]
    if not len(before):
        return "—", float("nan")
    last = before.iloc[-1]
    return str(last["run_id"])[:6], float(last["step_ms"])


HANDOUT_COLUMNS = ("run_wall_s", "cold_cache", "mfu", "first_step_s", "n_steps", "step_std_ms")  # do_bench rows' own


def handout_table(frame: pd.DataFrame) -> NumericTable:
    """One row per do_bench run: do_bench's mean and the number of timed repetitions, do_bench's first call
    (compilation included), the whole run's wall time from an empty cache, MFU; beside it ours' step in the bench's
    latest run before it at the same batch and commit, and the ratio of the two."""
    rows = frame[timers(frame) == DO_BENCH].reset_index(drop=True)
    rows = rows.reindex(columns=[*rows.columns, *(c for c in HANDOUT_COLUMNS if c not in rows)])  # none yet: empty
    paired = [_bench_step(frame, row) for _, row in rows.iterrows()]
    data = pd.DataFrame({
        "run": rows["run_id"].astype(str).str[:6], "commit": rows["git_commit"].astype(str).str[:7],
        "batch": rows["batch"], MEAN: rows["step_ms"], "do_bench std (ms)": rows["step_std_ms"],
        "repetitions": rows["n_steps"], "first call (s)": rows["first_step_s"], WALL: rows["run_wall_s"],
        "cold cache": rows["cold_cache"].map(lambda cold: "yes" if bool(cold) else "no"), "MFU": rows["mfu"],
        "bench run": [run for run, _ in paired], BENCH: [step for _, step in paired], "status": rows["status"]})
    data["÷ bench"] = data[MEAN] / data[BENCH]
    return NumericTable(data, (Col("run"), Col("commit"), Col("batch", "d"), Col(MEAN, ",.1f", second="do_bench std (ms)"),
                               Col("repetitions", "d"), Col("first call (s)", ",.1f"), Col(WALL, ",.0f"),
                               Col("cold cache"), Col("MFU", ".3f"), Col("bench run"), Col(BENCH, ",.1f"),
                               Col("÷ bench", ".3f"), Col("status")))


def render_handout(ctx: Context) -> str | Section:
    """The latest do_bench run: its time, against the bench's timing of the same step, and its wall time against
    the leaderboard's limit; a pending line with the command where no run has it yet."""
    frame = ctx.frame("leaderboard_8b")
    lead = ("The leaderboard's own test times ours with `triton.testing.do_bench(train_step, rep=30_000, "
            "warmup=10_000)` around the handout's step, from empty PyTorch and Triton caches "
            "(`python -m cs336_systems.bench.leaderboard --timer do_bench --cold-cache`; rule `leaderboard_8b_run` runs "
            "it after the bench).")
    if frame is None or not (timers(frame) == DO_BENCH).any():
        return f"{lead} Pending: no run has recorded it yet. Command: `{COMMAND}`.\n"
    q = Quotes(ctx.numeric("leaderboard_8b_handout"))
    last = len(q.frame) - 1
    text = (f"In run {q.cell('run', last)} at batch {q.cell('batch', last)}, do_bench's mean over "
            f"{q.cell('repetitions', last)} repetitions is {q.cell(MEAN, last)} ms")
    if q.frame.at[last, BENCH] == q.frame.at[last, BENCH]:
        text += (f", {q.cell('÷ bench', last)}× the {q.cell(BENCH, last)} ms the bench's own loop measured for the "
                 f"same step in run {q.cell('bench run', last)} just before it")
    wall = float(q.frame.at[last, WALL])
    text += (f". The whole run, compilation from empty caches included, took {q.cell(WALL, last)} s, "
             f"{'within' if wall <= LIMIT_S else 'over'} the leaderboard's limit of {LIMIT_S} s.")
    checked = [lead, text]
    return Section([lead, text, ctx.table("leaderboard_8b_handout")], q.table, checked, q.derived,
                   wording=("2026", "9", "30,000", "10,000", "8", str(LIMIT_S)))
