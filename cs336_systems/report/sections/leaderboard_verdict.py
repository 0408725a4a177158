"""2026 §9, the leaderboard step's verdict (rule leaderboard_8b_verdict, issue 59): five or more runs of one commit,
each timing ours and the SAC anchor, summarised by the median and range over the runs (the verdict table) and
judged against the target on the medians (the paragraph the section prints)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Quotes
from cs336_systems.report.sections.leaderboard_steps import (ANCHOR, COMMIT, HANDOUT_BATCH, RATIO, STEP, TARGET_MFU,
                                                             TARGET_RATIO, TIMED, step_table)

VERDICT_RUNS, VERDICT_STEPS = 5, 5  # issue 59: a verdict needs five runs of one commit, five timed steps each


def verdict_runs(t: pd.DataFrame, batch: int) -> pd.DataFrame:
    """The runs a verdict at `batch` rests on: one row per run that timed ours and the SAC anchor over at least
    VERDICT_STEPS steps (ours' and the anchor's mean step, ours over the anchor, ours' MFU), of the commit with the
    most such runs (the latest of those on a tie), in the order they ran."""
    timed = t[(t["batch"] == batch) & t[STEP].notna() & (t[TIMED] >= VERDICT_STEPS)]
    ours = timed[timed["provider"] == "ours"].drop_duplicates("run", keep="last").set_index("run")
    anchor = timed[timed["provider"] == ANCHOR].drop_duplicates("run", keep="last").set_index("run")[STEP]
    ours = ours[ours.index.isin(anchor.index)]
    runs = pd.DataFrame({COMMIT: ours[COMMIT], "ours": ours[STEP], "anchor": anchor.reindex(ours.index),
                         RATIO: ours[RATIO], "MFU": ours["MFU"]})
    if not len(runs):
        return runs
    counts, last = runs[COMMIT].value_counts(), {c: i for i, c in enumerate(runs[COMMIT])}
    return runs[runs[COMMIT] == max(counts.index, key=lambda c: (counts[c], last[c]))]


VERDICT_STATISTICS = ("median", "min", "max")


def verdicts(steps: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """Each batch of ours in the step table's data (largest first) that has a verdict, VERDICT_RUNS runs of one
    commit, with those runs (`verdict_runs`)."""
    batches = sorted(set(steps.loc[steps["provider"] == "ours", "batch"]), reverse=True)
    runs = {b: verdict_runs(steps, b) for b in batches}
    return {b: r for b, r in runs.items() if len(r) >= VERDICT_RUNS}


def verdict_batches(steps: pd.DataFrame) -> list[int]:
    """The batches that have a verdict (`verdicts`), largest first."""
    return list(verdicts(steps))


def verdict_table(frame: pd.DataFrame) -> NumericTable:
    """Per batch with a verdict (VERDICT_RUNS runs of one commit, `verdict_runs`): the median, least and largest over
    the runs of ours' mean step, the anchor's, their ratio and ours' MFU (each column on its own: the ratio's median
    is the median of the runs' ratios), the number of runs and their commit. No rows before a verdict."""
    steps = step_table(frame).data
    out = []
    for batch, runs in verdicts(steps).items():
        for pick in VERDICT_STATISTICS:
            out.append({"batch": batch, "statistic": pick, "runs": len(runs), COMMIT: runs[COMMIT].iloc[0],
                        "ours (ms)": getattr(runs["ours"], pick)(), "anchor (ms)": getattr(runs["anchor"], pick)(),
                        RATIO: getattr(runs[RATIO], pick)(), "MFU": getattr(runs["MFU"], pick)()})
    columns = ["batch", "statistic", "runs", COMMIT, "ours (ms)", "anchor (ms)", RATIO, "MFU"]
    return NumericTable(pd.DataFrame(out, columns=columns),
                        (Col("batch", "d"), Col("statistic"), Col("runs", "d"), Col(COMMIT), Col("ours (ms)", ",.1f"),
                         Col("anchor (ms)", ",.1f"), Col(RATIO, ".3f"), Col("MFU", ".3f")))


def verdict_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of `frame` (a results file's) that the verdict table summarises: ours' and the anchor's in each
    verdict run, at its batch."""
    steps = step_table(frame).data
    runs = {(run, batch) for batch, batch_runs in verdicts(steps).items() for run in batch_runs.index}
    measured = pd.Series([key in runs for key in zip(frame["run_id"].astype(str).str[:6], frame["batch"])],
                         index=frame.index, dtype=bool)
    return frame[measured & frame["provider"].isin(["ours", ANCHOR])]


def verdict_median_at_leaderboard_batch(table: pd.DataFrame) -> int | None:
    """The verdict table's median row at the leaderboard's batch (the front page's headlines); None before a
    verdict."""
    rows = table.index[(table["batch"] == HANDOUT_BATCH) & (table["statistic"] == "median")]
    return int(rows[0]) if len(rows) else None


def _meets(runs: pd.DataFrame) -> pd.Series:
    """Per row: at most the target ratio to the anchor, and at least the target MFU where MFU is measured."""
    return (runs[RATIO] <= TARGET_RATIO) & (runs["MFU"].isna() | (runs["MFU"] >= TARGET_MFU))


def verdict_paragraph(q: Quotes, batch: int) -> str:
    """The verdict at `batch` from repeated runs of one commit: the median and range over the runs of ours' mean step,
    the anchor's and their ratio (and ours' MFU), the target judged on the medians; or what it still awaits."""
    runs = verdict_runs(q.frame, batch)
    count = q.derive(lambda t: len(verdict_runs(t, batch)), "d", f"verdict runs, batch {batch}")
    if len(runs) < VERDICT_RUNS:
        most = f"; the most so far is {count}, at commit {runs[COMMIT].iloc[-1]}" if len(runs) else ""
        return (f"The verdict at batch {batch} waits for {VERDICT_RUNS} runs of one commit, each timing ours and the "
                f"anchor over at least {VERDICT_STEPS} steps{most}. Rule `leaderboard_8b_verdict` makes them: "
                "`snakemake results/leaderboard_8b.csv --forcerun leaderboard_8b_verdict --cores 1 --resources gpu=1`.")

    def spread(column: str, fmt: str, what: str, scale: float = 1) -> str:
        median, low, high = (q.derive(lambda t, pick=pick: scale * getattr(verdict_runs(t, batch)[column], pick)(),
                                      fmt, f"{pick} {what} over the verdict runs, batch {batch}")
                             for pick in ("median", "min", "max"))
        return f"{median} (range {low}–{high})"

    mfu = runs["MFU"].notna().all()  # a CPU measures none: the target is then the ratio alone
    met = bool(_meets(runs.median(numeric_only=True).to_frame().T).iloc[0])
    each = int(_meets(runs).sum())
    held = q.derive(lambda t: int(_meets(verdict_runs(t, batch)).sum()), "d",
                    f"verdict runs meeting the target, batch {batch}")
    return (f"The verdict at batch {batch}, from {count} runs of commit {runs[COMMIT].iloc[0]} (each its own process, "
            "ours and the anchor timed one after the other; medians over the runs of each point's mean step): ours "
            f"{spread('ours', ',.1f', 'ours step')} ms, the anchor {spread('anchor', ',.1f', 'anchor step')} ms, ours ÷ "
            f"anchor {spread(RATIO, '.3f', 'ours over SAC')}"
            + (f", ours' MFU {spread('MFU', '.2f', 'ours MFU %', 100)}%" if mfu else "")
            + f". On the medians the issue's target (at most {TARGET_RATIO:g}× the anchor's step"
            + (f" and at least {100 * TARGET_MFU:g}% MFU" if mfu else "") + f") is {'met' if met else 'missed'}; "
            + ("every run met it." if each == len(runs) else "no run met it." if not each else
               f"{held} of the {count} runs met it, so the margin is within the runs' spread."))
