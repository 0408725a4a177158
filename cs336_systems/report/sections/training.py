"""End to end (workflow/rules/distributed.smk, rule train_matrix): short training runs by attention
backend and data-parallel wrapper, their speed and whether their loss curves agree."""

from __future__ import annotations

import pandas as pd

from cs336_systems.analysis.ddp import rounds_needed
from cs336_systems.report.appendix import moved
from cs336_systems.report import figures
from cs336_systems.report.ddp_analysis import SPREAD
from cs336_systems.report.section import Context, Deliverable, Figure, Quotes, Section, Table, column_values
from cs336_systems.report.tables import DDP_STEP, TOKENS_ALL_STEPS, timed_steps, train_matrix

# Same seed, same global batch: runs may differ only by float rounding in reductions of another order.
LOSS_AGREEMENT = 1e-3


def render_train_matrix(ctx: Context) -> Section:
    frame = ctx.frame("train_matrix")
    table = ctx.numeric("train_matrix")
    summary = table.data  # positions: a RangeIndex, as the table's rows
    first, ddp = frame.iloc[0], frame[frame["world_size"] > 1]
    per_rank = f"{int(ddp['batch_per_rank'].iloc[0])} sequences per rank; " if len(ddp) else ""
    timed = timed_steps(frame)["step"]
    parts = [f"{first['size']} model, {first['precision']}, context {first['context_length']}, "
             f"{int(first['tokens_per_step'])} tokens per step for every run ({per_rank}the single-GPU run takes "
             f"the whole global batch), {int(frame['step'].max())} steps from the same seed, on "
             f"{first['device_name']}. Speeds (step time, tokens/s) are medians over steps {int(timed.min())}–"
             f"{int(timed.max())}, the second half: the first includes warm-up and, for flash_triton, autotuning."]
    drift = summary.dropna(subset=["max |loss − torch DDP|"])
    if len(drift):
        row = drift["max |loss − torch DDP|"].idxmax()
        worst, gap = summary.loc[row], summary.at[row, "max |loss − torch DDP|"]
        quoted = table.quote("max |loss − torch DDP|", row)
        if gap < LOSS_AGREEMENT:
            parts.append(f"Every run's loss stays within {quoted} of torch DDP's with the same attention backend "
                         f"at every step: our wrappers train the model as torch's does, and data parallelism as a "
                         f"whole matches one GPU on the same global batch.")
        else:
            parts.append(f"The loss curves do not agree: {worst['wrapper']} with {worst['attention']} strays "
                         f"{quoted} from torch DDP's (agreement would be below {LOSS_AGREEMENT}).")
    fastest = set()
    for attention, runs in summary.groupby("attention", sort=False):
        best = runs.loc[runs["tokens/s"].idxmax()]
        fastest.add(best["wrapper"])
        parts.append(f"Tokens/s with {attention} attention: "
                     + ", ".join(f"{summary.at[i, 'wrapper']} {table.quote('tokens/s', i)}" for i in runs.index)
                     + f" (fastest: {best['wrapper']}).")
    q = Quotes(table)
    parts.append(all_steps_paragraph(q))
    checked = parts[1:]
    if len(fastest) > 1:
        parts.append("The fastest wrapper changes with the attention backend, so these short runs of a small model "
                     "do not rank the wrappers. " + xl_ranking(ctx))
    # the first paragraph states the runs' arguments and the last reads the DDP tables; the rest quotes this table
    runs = moved(ctx, "train_matrix", "end to end: every training run", ("attention", "wrapper"))
    return Section([*parts, ctx.figure("train_matrix", "loss curves"), *runs], table,
                   checked, q.derived, wording=(f"{LOSS_AGREEMENT}",))


def _all_steps_change(t: pd.DataFrame) -> pd.Series:
    """Per run, tokens/s over every step relative to the table's (second-half) tokens/s, less one."""
    return column_values(t, TOKENS_ALL_STEPS) / column_values(t, "tokens/s") - 1


def all_steps_paragraph(q: Quotes) -> str:
    """How much the speeds depend on leaving out the first half of the steps, and whether the fastest wrapper of
    each backend does."""
    change = _all_steps_change(q.frame)
    worst = change.abs().idxmax()
    most = q.derive(lambda t: 100 * _all_steps_change(t).abs().max(), ".0f", "largest |all-step tokens/s change|, %")
    data = q.table.data
    same = all(runs["tokens/s"].idxmax() == runs[TOKENS_ALL_STEPS].idxmax()
               for _, runs in data.groupby("attention", sort=False))
    return (f"Medians over every step instead ('{TOKENS_ALL_STEPS}') move a run's tokens/s by up to {most}% "
            f"({data.at[worst, 'wrapper']} with {data.at[worst, 'attention']} attention: "
            f"{q.cell(TOKENS_ALL_STEPS, worst)} against {q.cell('tokens/s', worst)}); the fastest wrapper of "
            + ("each backend is the same either way." if same else "some backend changes with them."))


DDP_RUNS = {"ddp_naive": "2.2", "ddp_individual": "2.3 (a)", "ddp_bucketed": "2.3 bucketed"}


def xl_ranking(ctx: Context) -> str:
    """Whether the two-GPU xl runs of 2.2–2.3 rank the wrappers: their rounds against the rounds needed to separate
    configs 5% apart (rule ddp_spread's run), and torch DDP's mean step in each of their runs (a config every run has)."""
    spread = ctx.frame(SPREAD)
    runs = {name: ctx.frame(name) for name in DDP_RUNS if (ctx.results / "tables" / f"{name}.json").exists()}
    runs = {name: frame for name, frame in runs.items() if frame is not None}
    if spread is None or not runs:
        return "Whether the xl measurements of 2.2–2.3 rank them needs their runs and the run of rule ddp_spread."
    need = rounds_needed(spread)["rounds"]
    rounds = sorted({int(frame["rounds"].max()) for frame in runs.values()})
    if min(rounds) >= need:
        return (f"The xl measurements of 2.2–2.3 rank them: each run has at least the {need} interleaved rounds "
                "needed to separate configs 5% apart.")
    steps = {}
    for precision in ("bf16", "fp32"):
        steps = {name: ctx.numeric(name).quote(DDP_STEP, precision=precision, config="torch_ddp")
                 for name in runs if ctx.numeric(name).has(precision=precision, config="torch_ddp")}
        if len(steps) > 1:
            break
    same = (f" The same config differs from run to run: torch DDP's {precision} mean step is "
            + ", ".join(f"{step} ms ({DDP_RUNS[name]})" for name, step in steps.items()) + "."
            if len(steps) > 1 else "")
    return (f"Nor do the xl measurements of 2.2–2.3 yet: their runs have {' or '.join(map(str, rounds))} interleaved "
            f"rounds, where {need} are needed to separate configs 5% apart (2.2).{same}")


DELIVERABLES = [
    Deliverable("End to end: training runs by attention backend and wrapper", "train_matrix", render_train_matrix,
                ("train_matrix",),
                tables=(Table("train_matrix", "train_matrix", train_matrix,
                              "Short training runs: attention backend × data-parallel wrapper, same seed and "
                              "global batch"),),
                figures=(Figure("train_matrix", "train_matrix", figures.train_matrix),)),
]
