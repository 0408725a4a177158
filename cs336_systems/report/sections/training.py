"""End to end (workflow/rules/distributed.smk, rule train_matrix): short training runs by attention
backend and data-parallel wrapper, their speed and whether their loss curves agree."""

from __future__ import annotations

from cs336_systems.report import figures
from cs336_systems.report.section import Context, Deliverable, Figure, Section, Table
from cs336_systems.report.tables import train_matrix

# Same seed, same global batch: runs may differ only by float rounding in reductions of another order.
LOSS_AGREEMENT = 1e-3


def render_train_matrix(ctx: Context) -> Section:
    frame = ctx.frame("train_matrix")
    table = ctx.numeric("train_matrix")
    summary = table.data  # positions: a RangeIndex, as the table's rows
    first, ddp = frame.iloc[0], frame[frame["world_size"] > 1]
    per_rank = f"{int(ddp['batch_per_rank'].iloc[0])} sequences per rank; " if len(ddp) else ""
    parts = [f"{first['size']} model, {first['precision']}, context {first['context_length']}, "
             f"{int(first['tokens_per_step'])} tokens per step for every run ({per_rank}the single-GPU run takes "
             f"the whole global batch), {int(frame['step'].max())} steps from the same seed, on "
             f"{first['device_name']}."]
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
    if len(fastest) > 1:
        parts.append("The fastest wrapper changes with the attention backend, so these short runs of a small model "
                     "do not rank the wrappers; the xl measurements of 2.2–2.3 do.")
    # the first paragraph states the runs' arguments; the rest quotes the table
    return Section([*parts, ctx.figure("train_matrix", "loss curves"), ctx.table("train_matrix")], table,
                   parts[1:], wording=("2.2", "2.3", f"{LOSS_AGREEMENT}"))


DELIVERABLES = [
    Deliverable("End to end: training runs by attention backend and wrapper", "train_matrix", render_train_matrix,
                ("train_matrix",),
                tables=(Table("train_matrix", "train_matrix", train_matrix,
                              "Short training runs: attention backend × data-parallel wrapper, same seed and "
                              "global batch"),),
                figures=(Figure("train_matrix", "train_matrix", figures.train_matrix),)),
]
