"""2026 §9, continued: the profiled 8B step (rule leaderboard_8b with `--profile`, bench/step_profile.py): each
provider's device time by category and its peak memory by what holds it, from the quoted run's largest batch. The
prose quotes the time table: what the categories miss of the total is a formula over its cells."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.appendix import appendix_parts
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Quotes, Section

QUOTED = "quoted"  # the merged table's column marking, per batch, the run the prose quotes (config leaderboard_8b.quote)
SWAPPED = "ours-sdpa_attention"  # the ablation that runs SDPA's attention in ours' step

PROFILE_CATEGORIES = ("attention forward", "attention backward", "GEMM", "loss", "optimizer", "elementwise/norm/rope",
                      "copies", "recompute", "other")  # bench/step_profile.CATEGORIES, in that order
PROFILE_TOTALS = ("profiled ops (total)", "step (wall)")
MEMORY_PARTS = ("peak", "parameters", "gradients", "optimizer state", "activations + workspace")
PROFILE_COMMAND = "snakemake results/leaderboard_8b.csv --forcerun leaderboard_8b_run --cores 1 --resources gpu=1"
PROFILE_FLAGS = ("--profile results/leaderboard_8b_snapshots "
                 "--profile-out 'results/runs/leaderboard_8b_profile/{run_id}.csv'")


def _profiled(frame: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The rows of one kind (time or memory) of the quoted profiled run's largest batch, providers in run order."""
    rows = frame[frame[QUOTED].astype(bool) & (frame["kind"] == kind)]
    return rows[rows["batch"] == rows["batch"].max()]


def profiled_time(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows the time table is built from (Table.rows: its provenance names their run's commit and date)."""
    return _profiled(frame, "time")


def profiled_memory(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows the memory table is built from."""
    return _profiled(frame, "memory")


def profile_table(frame: pd.DataFrame) -> NumericTable:
    """ms of each category in the profiled step, one column per provider (the largest batch of the quoted run);
    then the same device time summed another way (the categories' check) and the step's wall time."""
    rows = profiled_time(frame)
    providers = list(dict.fromkeys(rows["provider"]))
    values = rows.set_index(["category", "provider"])["value"].unstack()  # NaN stays NaN (a sum would make it 0)
    order = [*PROFILE_CATEGORIES, *PROFILE_TOTALS]
    data = pd.DataFrame({"category": order, "batch": int(rows["batch"].max()),
                         **{p: [values.at[c, p] if c in values.index else float("nan") for c in order]
                            for p in providers}})
    return NumericTable(data, (Col("category"), Col("batch", "d"), *(Col(p, ",.1f") for p in providers)))


def memory_table(frame: pd.DataFrame) -> NumericTable:
    """Peak memory of the profiled step split into what holds it (GiB), one row per provider."""
    rows = profiled_memory(frame)
    values = rows.set_index(["provider", "category"])["value"].unstack()  # a CPU's NaN peak stays NaN
    providers = list(dict.fromkeys(rows["provider"]))
    data = pd.DataFrame({"provider": providers, "batch": int(rows["batch"].max()),
                         **{part: [values.at[p, part] for p in providers] for part in MEMORY_PARTS}})
    return NumericTable(data, (Col("provider"), Col("batch", "d"), *(Col(part, ",.2f") for part in MEMORY_PARTS)))


def profile_pointer(ctx: Context) -> str:
    """Where the profile is (the next section), or the pending line with the command that records it."""
    if ctx.frame("leaderboard_8b_profile") is not None:
        return ("The step broken down from a profiler trace, and its peak memory by category: the next section "
                "(`results/leaderboard_8b_profile.csv`).")
    return (f"Pending (needs a GPU run with the profiler): the step broken down from a profiler trace (attention "
                "forward and backward, GEMMs, loss, optimizer, recomputation) and peak memory by category, for ours, "
                f"the anchors and the ablations. Command: `{PROFILE_COMMAND}` (the rule passes `{PROFILE_FLAGS}` to "
                "`python -m cs336_systems.bench.leaderboard`).")


def render_profile(ctx: Context) -> Section:
    """The profiled step of each provider: the method, the time by category and the peak-memory split. The prose
    quotes the time table: what the categories miss of the total is a formula over its cells."""
    q = Quotes(ctx.numeric("leaderboard_8b_profile"))
    lead = ("Where the step's time and memory go: after its timed steps each point ran one more step under "
            "`torch.profiler` (`bench/step_profile.py`); the tables give its device time by category and its peak "
            "memory by what holds it.")
    text = ("Each kernel's device time (on a CPU, each op's self CPU "
            "time) is given to a category by its name, to the phase range whose host interval holds its "
            "launching op, and then by phase: a forward-type kernel (attention forward, or one launched under a "
            "forward-only op such as `aten::linear`) met in the backward is `recompute`, everything in the loss "
            "range (LM head and cross-entropy) is `loss`, everything in the optimizer step is `optimizer`. Inside "
            "compiled blocks Inductor calls the GEMMs directly in both passes, so recomputed GEMMs there stay in "
            "`GEMM`. The loss range is the forward's, so `loss` holds what its ops launch in both passes where "
            "their backward is one op of ours (the fused LM head + cross-entropy), and only the forward for the "
            "plain anchors: their chunked, checkpointed loss recomputes its logits and runs its backward GEMMs in "
            "the backward, where they count as `GEMM`. Compare the anchors' and ours' `loss` and `GEMM` summed, "
            "not apart. CUPTI's overhead records (the host waiting on a full launch queue) are not launching ops "
            "and are left out: they carry the correlation id of the op launching then, and counting them counted "
            "that op's kernels twice. "
            "`profiled ops (total)` is the same time summed another way, which the categories add up to; "
            "`step (wall)` is the profiled step's synchronized host time. Memory: the step's allocator peak, and "
            "parameters, gradients and optimizer state counted from the tensors at the step's end; the rest is "
            "activations and workspace at the peak (a lower bound where some gradients did not exist yet at the "
            "peak). On CUDA the step's allocator snapshot is pickled beside the results (not committed).")
    notes = [n for n in (_unlinked_note(q, ctx.frame("leaderboard_8b_profile")), _attention_note(q)) if n]
    checked = [lead, text, *notes]
    parts = [lead, *appendix_parts("the 8B step's profile: how time and memory are counted", [text]),
             ctx.table("leaderboard_8b_profile"), *notes, ctx.table("leaderboard_8b_memory")]
    return Section(parts, q.table, checked, q.derived)


def _attention_note(q: Quotes) -> str:
    """Where the profiled run has ours beside the ablation with SDPA's attention: ours' attention device time over
    SDPA's, forward, backward and both, in the same step of the same run (formulas over the time table's cells)."""
    ms = _per_category(q.frame)
    if not {"ours", SWAPPED} <= set(ms.columns):
        return ""

    def ratio(categories: tuple[str, ...], what: str) -> str:
        return q.derive(lambda t: (_per_category(t).loc[list(categories), "ours"].sum()
                                   / _per_category(t).loc[list(categories), SWAPPED].sum()), ".3f", what)

    both = ratio(("attention forward", "attention backward"), "ours' attention over SDPA's in the step")
    forward = ratio(("attention forward",), "ours' attention forward over SDPA's in the step")
    backward = ratio(("attention backward",), "ours' attention backward over SDPA's in the step")
    return (f"Ours' attention against SDPA's inside the same step: `{SWAPPED}` is ours with SDPA's attention (cuDNN "
            f"on Hopper) in place of our kernels, profiled in the same run: the same step but for its attention. Ours' "
            f"attention takes {both}× SDPA's device time (forward {forward}×, backward {backward}×).")


def _per_category(times: pd.DataFrame) -> pd.DataFrame:
    """The time table's numbers (its formula_frame) as ms per category (rows) and provider (columns)."""
    return times.set_index("category").drop(columns="batch").astype(float)


def _short_of_total(times: pd.DataFrame) -> pd.Series:
    """Per provider, how much less than `profiled ops (total)` the categories add up to (ms)."""
    ms = _per_category(times)
    return ms.loc["profiled ops (total)"] - ms.loc[list(PROFILE_CATEGORIES)].sum()


def _most_optimizer_time(times: pd.DataFrame) -> float:
    """The largest `optimizer` time of any provider (ms): 0 where the profile dropped our AdamW's kernels."""
    return float(_per_category(times).loc["optimizer"].max())


def _unlinked_note(q: Quotes, frame: pd.DataFrame) -> str:
    """Which providers' profiled steps failed (their error rows), and what the categories miss of the total where
    the profile predates counting the kernels the profiler links to no op (bench/step_profile.unlinked_kernels):
    our AdamW's, so `optimizer` read 0."""
    failed = _profiled(frame, "error")["provider"].tolist()
    note = (f"The profiled steps of {', '.join(f'`{p}`' for p in failed)} failed (the error is in their rows of "
            "the CSV: a SystemError inside the plain model's compiled chunked loss under the profiler), so the "
            "tables have no column for them; their timed rows stand. " if failed else "")
    short = _short_of_total(q.frame)
    total = _per_category(q.frame).loc["profiled ops (total)"]
    note += _overcount_note(q, short, total)
    if not (short > 1e-3 * total).any():
        return note.rstrip()
    least = q.derive(lambda t: _short_of_total(t).min(), ",.1f", "least the categories miss of the total (ms)")
    most = format(short.max(), ",.1f")
    if most != least:
        most = q.derive(lambda t: _short_of_total(t).max(), ",.1f", "most the categories miss of the total (ms)")
    spread = least + (f"–{most}" if most != least else "")
    optimizer = (f" (and `optimizer` reads {q.derive(_most_optimizer_time, 'g', 'most optimizer time (ms)')})"
                 if _most_optimizer_time(q.frame) == 0 else "")
    return note + (f"In this profile the categories add up to {spread} ms less than "
            f"`profiled ops (total)`{optimizer}: the profiler linked our AdamW's Triton kernels, "
            "launched from Python outside any op, to no op, and the categorizing code of this run dropped such "
            "kernels. The code counts them now (by name, in the phase that started last before they ran); the "
            "profile has not been rerun since.")


def _overcount_note(q: Quotes, short: pd.Series, total: pd.Series) -> str:
    """The providers whose categories add up to more than the total (a kernel counted twice): named, with the
    excess, so that no reader takes their categories at face value."""
    over = [p for p in short.index if -short[p] > 1e-3 * total[p]]
    if not over:
        return ""
    excess = ", ".join(f"`{p}` (by " + q.derive(lambda t, p=p: -_short_of_total(t)[p], ",.1f",
                                                 f"{p}: categories over the total (ms)") + " ms)" for p in over)
    others = " (the other columns add up)" if len(over) < len(short) else ""
    return (f"The categories add up to more than `profiled ops (total)` for {excess}: some kernels are counted twice "
            f"in that profiled step{'s' if len(over) > 1 else ''}{others}. Which kernels is not found yet, so the "
            "split by category overstates there; the total and the wall time stand. ")
