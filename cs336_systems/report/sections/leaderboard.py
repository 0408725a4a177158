"""2026 §9, the leaderboard step itself (rule leaderboard_8b, bench/leaderboard.py): one whole training step of
the 8B model, ours beside the plain-PyTorch anchors of the same run, and the ablations of ours. Every number of
the prose is a cell of the step table or a formula over its cells (section.Quotes); the published leaderboard's
figures and the handout's constants are given facts, declared as wording, and so is the intro's provenance (device,
versions, commits). The continuation (the profiled step) quotes its time table the same way."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, formula_frame

ANCHOR = "torch_plain_sac"  # the strongest plain-PyTorch anchor (issue 24): torchtitan's selective checkpointing
MAIN = ("ours", "torch_plain_sac", "torch_plain_ac")
SWAPPED = "ours-sdpa_attention"  # the ablation that runs SDPA's attention in ours' step
ABLATION_CHANGES = {  # what each ablation switches off (bench/leaderboard.py's docstring)
    "ours-no_fused_ce": "plain CE of the full logits instead of our fused LM head + CE",
    "ours-torch_adamw": "torch's fused AdamW instead of ours",
    SWAPPED: "SDPA attention instead of our FlashAttention",
    "ours-full_ac": "every block fully recomputed instead of selective checkpointing",
    "ours-fp32_moments": "float32 AdamW moments (numerics variant)",
    "ours-selective": "plain selective checkpointing (no block saves its matmul outputs)",
    "ours-whole_batch": "forward and backward over the whole batch at once instead of one sequence at a time",
}
SIZED_CHANGES = {  # ours-keep:N and ours-mm:N, parsed by bench/leaderboard.py
    "ours-keep:": "the first {} blocks kept whole (not checkpointed), the rest selective",
    "ours-mm:": "the first {} blocks also save their matmul outputs (their rerun skips the GEMMs), the rest selective",
}


def _sized(provider: str) -> tuple[str, str] | None:
    """(prefix, N) of a sized ablation's name."""
    return next(((prefix, provider.removeprefix(prefix)) for prefix in SIZED_CHANGES if provider.startswith(prefix)),
                None)


def ablation_change(provider: str) -> str | None:
    """What an ablation of ours changes (None: not an ablation)."""
    sized = _sized(provider)
    if sized:
        return SIZED_CHANGES[sized[0]].format(sized[1])
    return ABLATION_CHANGES.get(provider)


def _is_ablation(providers: pd.Series) -> pd.Series:
    return providers.map(lambda p: ablation_change(str(p)) is not None)


STEP = "step (ms, mean ± std)"
SEQUENCES = "sequences / pass"  # per forward and backward pass; fewer than the batch: gradients accumulated
RATIO = "÷ SAC anchor"
QUOTED = "quoted"  # the merged table's column marking, per batch, the run the prose quotes (config leaderboard_8b.quote)


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
    rows = frame.reset_index(drop=True)
    measured = _step_columns(rows)
    data = pd.DataFrame({
        "run": rows["run_id"].astype(str).str[:6], "provider": rows["provider"], "batch": rows["batch"],
        STEP: rows["step_ms"], "step std (ms)": rows["step_std_ms"],
        **{label: rows[column] for label, (column, _) in measured.items()},
        "checkpoint": rows["checkpoint"], SEQUENCES: rows["microbatch"],
        "params / moments": rows["param_dtype"] + " / " + rows["optimizer_state_dtype"], "status": rows["status"],
        QUOTED: rows[QUOTED].astype(bool)})
    anchor = data[data["provider"] == ANCHOR].set_index(["run", "batch"])[STEP]
    data[RATIO] = [m / anchor.get((run, batch), float("nan")) for m, run, batch in
                   zip(data[STEP], data["run"], data["batch"])]
    oom = {i: "oom" for i, status in enumerate(rows["status"]) if status == "oom"}
    return NumericTable(data, (Col("run"), Col("provider"), Col("batch", "d"), Col(STEP, ",.1f", second="step std (ms)"),
                               *(Col(label, fmt) for label, (_, fmt) in measured.items()), Col("checkpoint"),
                               Col(SEQUENCES, "d"), Col("params / moments"), Col("status"), Col(RATIO, ".3f")),
                        {header: dict(oom) for header in (STEP, *measured)} if oom else {})


def _ablation_runs(table: pd.DataFrame) -> list[str]:
    """The runs with ablation rows, in the order they ran."""
    return list(dict.fromkeys(table.loc[_is_ablation(table["provider"]), "run"]))


def _row(table: pd.DataFrame, provider: str, run: str | None = None, batch: int | None = None) -> int | None:
    """The position of one row of the step table (None if absent): without a run, the quoted run's."""
    chosen = table[(table["provider"] == provider) & ((table["run"] == run) if run else table[QUOTED].astype(bool))
                   & ((table["batch"] == batch) if batch else True)]
    return int(chosen.index[-1]) if len(chosen) else None


def _step(table: pd.DataFrame, provider: str, run: str | None = None, batch: int | None = None) -> float:
    """The mean step of one row of the step table's numbers (NaN for OOM or absent)."""
    row = _row(table, provider, run, batch)
    return float("nan") if row is None else float(table.at[row, STEP])


def ablation_table(frame: pd.DataFrame) -> NumericTable:
    """Every run's ablations: each one's step against `ours` of the same run and batch (what switching that
    optimisation off costs, > 1, or saves, < 1), its peak memory and moments' dtype."""
    steps = step_table(frame)
    numbers = formula_frame(steps)
    chosen = numbers[_is_ablation(numbers["provider"])]
    ours = [_step(numbers, "ours", run, b) for run, b in zip(chosen["run"], chosen["batch"])]
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


# ---- the profiled step (bench/step_profile.py, `--profile`) ------------------------------------------------------

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


def profile_table(frame: pd.DataFrame) -> NumericTable:
    """ms of each category in the profiled step, one column per provider (the largest batch of the quoted run);
    then the same device time summed another way (the categories' check) and the step's wall time."""
    rows = _profiled(frame, "time")
    providers = list(dict.fromkeys(rows["provider"]))
    values = rows.set_index(["category", "provider"])["value"].unstack()  # NaN stays NaN (a sum would make it 0)
    order = [*PROFILE_CATEGORIES, *PROFILE_TOTALS]
    data = pd.DataFrame({"category": order, "batch": int(rows["batch"].max()),
                         **{p: [values.at[c, p] if c in values.index else float("nan") for c in order]
                            for p in providers}})
    return NumericTable(data, (Col("category"), Col("batch", "d"), *(Col(p, ",.1f") for p in providers)))


def memory_table(frame: pd.DataFrame) -> NumericTable:
    """Peak memory of the profiled step split into what holds it (GiB), one row per provider."""
    rows = _profiled(frame, "memory")
    values = rows.set_index(["provider", "category"])["value"].unstack()  # a CPU's NaN peak stays NaN
    providers = list(dict.fromkeys(rows["provider"]))
    data = pd.DataFrame({"provider": providers, "batch": int(rows["batch"].max()),
                         **{part: [values.at[p, part] for p in providers] for part in MEMORY_PARTS}})
    return NumericTable(data, (Col("provider"), Col("batch", "d"), *(Col(part, ",.2f") for part in MEMORY_PARTS)))


def _profile_pointer(ctx: Context) -> str:
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
    text = ("Where the step's time and memory go: after its timed steps each point ran one more step under "
            "`torch.profiler` (`bench/step_profile.py`). Each kernel's device time (on a CPU, each op's self CPU "
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
    checked = [text, *notes]
    parts = [text, ctx.table("leaderboard_8b_profile"), *notes, ctx.table("leaderboard_8b_memory")]
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


def _cell(table: pd.DataFrame, provider: str, column: str, batch: int | None = None, run: str | None = None) -> float:
    row = _row(table, provider, run, batch)
    return float("nan") if row is None else float(table.at[row, column])


def _measured(value: float) -> bool:
    return value == value  # not NaN: a CPU run has no MFU, an OOM row no step


def _ratio_to_anchor(q: Quotes, provider: str, batch: int, run: str | None = None) -> str:
    return q.derive(lambda t: _cell(t, provider, RATIO, batch, run), ".3f", f"{provider} over SAC, batch {batch}")


def _mfu_percent(q: Quotes, provider: str, batch: int) -> str:
    return q.derive(lambda t: 100 * _cell(t, provider, "MFU", batch), ".2f", f"{provider} MFU %, batch {batch}")


def _gap_paragraph(q: Quotes, batches: list[int]) -> str:
    """Ours against the SAC anchor at each batch (the ratio cells), then MFU against the issue's target."""
    parts = []
    t = q.frame
    for b in (b for b in batches if _measured(_cell(t, "ours", RATIO, b))):
        mfu = (f" at {_mfu_percent(q, 'ours', b)}% MFU against its {_mfu_percent(q, ANCHOR, b)}%"
               if _measured(_cell(t, "ours", "MFU", b)) else "")
        slower = "slower" if _cell(t, "ours", RATIO, b) > 1 else "faster"
        parts.append(f"at batch {b} ours takes {_ratio_to_anchor(q, 'ours', b)}× the anchor's mean step "
                     f"({q.cell(STEP, _row(t, 'ours', batch=b))} against {q.cell(STEP, _row(t, ANCHOR, batch=b))} ms, "
                     f"{slower}){mfu}")
    if not parts:
        return "No row of ours with the selective-checkpointing anchor beside it in the same run."
    measured = [b for b in batches if _measured(_cell(t, "ours", RATIO, b))]
    met = [b for b in measured if _cell(t, "ours", RATIO, b) <= 0.9 and _cell(t, "ours", "MFU", b) >= 0.54]
    missed = [b for b in measured if b not in met]
    verdict = ("met." if not missed else "not met yet." if not met else
               f"met at batch {', '.join(map(str, met))}, not yet at batch {', '.join(map(str, missed))}.")
    spreads = "".join(_spread_sentence(q, b) for b in measured)
    return ("Against the strongest plain-PyTorch anchor of the same run (torchtitan's selective checkpointing, "
            "`torch_plain_sac`): " + "; ".join(parts) + ". The issue's target, at most 0.9× the anchor's step and "
            "at least 54% MFU, is " + verdict + spreads + _power_sentence(q))


POWER_LIMIT_W = 700  # the H200's board power limit, as `nvidia-smi -q -d POWER` reports it


def _powered_rows(t: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of the quoted run of the largest batch, where it recorded the GPU's power (the earliest runs
    did not; a CPU has none to record)."""
    if "power (W)" not in t:  # the step table prints the clocks only where some run recorded them
        return t.iloc[:0]
    quoted = t[t[QUOTED].astype(bool)]
    powered = quoted[(quoted["batch"] == quoted["batch"].max()) & quoted["power (W)"].notna() & quoted[STEP].notna()]
    return powered[powered["run"] == powered["run"].iloc[0]] if len(powered) else powered


def _span(q: Quotes, column: str, fmt: str, what: str) -> str:
    """The lowest–highest of `column` over the latest powered run's rows (one number where they print alike)."""
    low = q.derive(lambda t: _powered_rows(t)[column].min(), fmt, f"lowest {what}")
    high = format(_powered_rows(q.frame)[column].max(), fmt)
    return low if high == low else low + "–" + q.derive(lambda t: _powered_rows(t)[column].max(), fmt,
                                                         f"highest {what}")


def _kilojoules(t: pd.DataFrame, provider: str) -> float:
    """One provider's energy per step in the latest powered run: mean step × mean board power (kJ)."""
    rows = _powered_rows(t)
    row = rows[rows["provider"] == provider]
    return float(row[STEP].iloc[0] * row["power (W)"].iloc[0] / 1e6) if len(row) else float("nan")


def _power_sentence(q: Quotes) -> str:
    """Whether the latest run with the GPU's clock and power recorded ran at the board's power limit, and then each
    of ours' and the anchor's energy per step: under the limit the step's time follows its energy."""
    rows = _powered_rows(q.frame)
    if len(rows) < 2 or not {"ours", ANCHOR} <= set(rows["provider"]):
        return ""
    run = rows["run"].iloc[0]
    power = _span(q, "power (W)", ",.0f", "board power (W)")
    bound = rows["power (W)"].min() >= 0.95 * POWER_LIMIT_W
    energy = {p: q.derive(lambda t, p=p: _kilojoules(t, p), ".2f", f"{p} kJ per step") for p in ("ours", ANCHOR)}
    return (f" In run {run} the timed steps of every provider drew {power} W (the board's limit is "
            f"{POWER_LIMIT_W} W) at an SM clock of {_span(q, 'SM clock (MHz)', ',.0f', 'SM clock (MHz)')} MHz"
            + (": the step runs at the power limit, so its time follows the energy it spends. " if bound else
               ", below the power limit. ")
            + f"Mean step × mean power, ours spent {energy['ours']} kJ per step and the anchor {energy[ANCHOR]} kJ.")


def _same_recipe_rows(t: pd.DataFrame, batch: int) -> pd.DataFrame:
    """Ours' measured rows at `batch` in every run of the quoted run's recipe: as many sequences per pass and the same
    checkpoint policy (the probe's choice)."""
    last = _row(t, "ours", batch=batch)
    return t[(t["provider"] == "ours") & (t["batch"] == batch) & (t[SEQUENCES] == t.at[last, SEQUENCES])
             & (t["checkpoint"] == t.at[last, "checkpoint"]) & t[RATIO].notna()]


def _target_met(rows: pd.DataFrame) -> pd.Series:
    return (rows[RATIO] <= 0.9) & (rows["MFU"] >= 0.54)


def _spread_sentence(q: Quotes, batch: int) -> str:
    """How the verdict varies between runs of the same recipe (the anchor's step itself moves by about 1% between
    runs): ours over the anchor, lowest to highest, and in how many runs the target held."""
    rows = _same_recipe_rows(q.frame, batch)
    if len(rows) < 2:
        return ""
    lowest = q.derive(lambda t: _same_recipe_rows(t, batch)[RATIO].min(), ".3f", f"lowest ours over SAC, batch {batch}")
    highest = q.derive(lambda t: _same_recipe_rows(t, batch)[RATIO].max(), ".3f", f"highest ours over SAC, batch {batch}")
    runs = q.derive(lambda t: len(_same_recipe_rows(t, batch)), "d", f"runs of the recipe, batch {batch}")
    met = q.derive(lambda t: int(_target_met(_same_recipe_rows(t, batch)).sum()), "d", f"runs meeting it, batch {batch}")
    held = int(_target_met(rows).sum())
    verdict = ("in every one" if held == len(rows) else f"in {met} of them: the margin is within the runs' spread"
               if held else "in none")
    ours = q.frame[(q.frame["provider"] == "ours") & (q.frame["batch"] == batch)]
    quoted = "latest" if ours[QUOTED].astype(bool).iloc[-1] else "quoted"  # rows in the order the runs ran
    return (f" At batch {batch}, over the {runs} runs of the {quoted} run's recipe (the same checkpoint policy and "
            f"sequences per pass: {', '.join(rows['run'])}), ours took {lowest}–{highest}× the anchor's step; the "
            f"target held {verdict}.")


def _last_run_with(rows: pd.DataFrame, provider: str) -> tuple[str, int] | None:
    """(run, batch) of the ablation rows of `provider` the prose names: the quoted run's, else the latest run's (rows
    are in the order the runs ran)."""
    mine = rows[rows["provider"] == provider]
    mine = mine[mine[QUOTED].astype(bool)] if mine[QUOTED].astype(bool).any() else mine
    return (mine["run"].iloc[-1], int(mine["batch"].iloc[-1])) if len(mine) else None


def _ablation_paragraph(q: Quotes) -> str | None:
    t = q.frame
    runs = _ablation_runs(t)
    if not runs:
        return None
    rows = t[_is_ablation(t["provider"])]
    per_run = []
    for run in runs:
        said = []
        for provider, batch in zip(rows.loc[rows["run"] == run, "provider"], rows.loc[rows["run"] == run, "batch"]):
            if not _measured(_step(t, provider, run, batch)):
                said.append(f"`{provider}` runs out of memory")
                continue
            if not _measured(_step(t, "ours", run, batch)):
                said.append(f"`{provider}` ran without an `ours` row of the same run and batch to compare with")
                continue
            ratio = q.derive(lambda t, p=provider, b=batch, r=run: _step(t, p, r, b) / _step(t, "ours", r, b), ".3f",
                             f"{provider} over ours, run {run}")
            said.append(f"`{provider}` takes {ratio}× ours")
        per_run.append(f"run {run}: " + ", ".join(said))
    text = ("The ablations (each switching one optimisation of ours off, or spending free memory; table below, "
            "step over ours of the same run and batch) — " + "; ".join(per_run) + ".")
    sdpa = _last_run_with(rows, SWAPPED)
    if sdpa:
        run, batch = sdpa
        faster = _step(t, SWAPPED, run, batch) > _step(t, "ours", run, batch)
        text += (f" Ours with SDPA (cuDNN) attention in place of our kernel takes "
                 f"{_ratio_to_anchor(q, SWAPPED, batch, run)}× the anchor's step at batch {batch} "
                 f"(run {run}): " + ("in this run our attention is the faster of the two in the step."
                                    if faster else "in this run our attention is slower than cuDNN's in the step."))
    fp32 = _last_run_with(rows, "ours-fp32_moments")
    if fp32:
        run, batch = fp32
        text += (f" Numerics: float32 AdamW moments beside the bf16 parameters peak at "
                 f"{q.cell('peak (GiB)', _row(t, 'ours-fp32_moments', run, batch))} GiB against ours' "
                 f"{q.cell('peak (GiB)', _row(t, 'ours', run, batch))} GiB (+"
                 + q.derive(lambda t: _cell(t, 'ours-fp32_moments', 'peak (GiB)', batch, run)
                            - _cell(t, 'ours', 'peak (GiB)', batch, run), '.2f', 'fp32 moments extra GiB')
                 + f" GiB, run {run}) for the step time in the table.")
    return text + _memory_sentence(q, rows)


def _memory_sentence(q: Quotes, rows: pd.DataFrame) -> str:
    """The fastest measured variant that spends free memory (ours-keep:N, ours-mm:N), per batch, against the
    anchor of its run."""
    t = q.frame
    sized = rows[rows["provider"].map(lambda p: _sized(str(p)) is not None)]
    comparable = [_measured(_step(t, p, r, b)) and _measured(_step(t, "ours", r, b))
                  for p, r, b in zip(sized["provider"], sized["run"], sized["batch"])]
    sized = sized.loc[pd.Series(comparable, index=sized.index, dtype=bool)]  # with ours in its run
    said = []
    for batch in sorted(set(sized["batch"]), reverse=True):
        mine = sized[sized["batch"] == batch]
        best = mine.loc[mine[STEP].idxmin()]
        provider, run = best["provider"], best["run"]
        against = (f"{_ratio_to_anchor(q, provider, batch, run)}× the anchor's step"
                   if _measured(_cell(t, provider, RATIO, batch, run)) else
                   q.derive(lambda t, p=provider, b=batch, r=run: _step(t, p, r, b) / _step(t, "ours", r, b), ".3f",
                            f"{provider} over ours, run {run}") + "× ours' step (no anchor in its run)")
        said.append(f"at batch {batch}, `{provider}` (peak {q.cell('peak (GiB)', _row(t, provider, run, batch))} GiB) "
                    f"takes {against}")
    if not said:
        return ""
    return (" Spending the memory selective checkpointing leaves free, the fastest measured variant: "
            + "; ".join(said) + ".")


def _auto_sentence(q: Quotes, frame: pd.DataFrame) -> str:
    """Whether the runs' `ours` chose its matmul-saving blocks itself (bench/leaderboard.py, `AUTO`): which rows
    chose is read from the results (`matmul_blocks`), what they chose is their step-table cells."""
    ours = frame[(frame["provider"] == "ours") & (frame["status"] == "ok")]
    # a run of ours without `AUTO` (e.g. only the anchors and sized ablations) writes no matmul_blocks column
    chosen = ours.dropna(subset=["matmul_blocks"]) if "matmul_blocks" in ours.columns else ours.iloc[:0]
    if not len(chosen):
        return (" In these runs `ours` used plain selective checkpointing; it now chooses how many blocks save "
                "their matmul outputs itself, from a plain selective probe's peak (`probe_matmul_blocks`), which "
                "no run has measured yet.")
    rows = [_row(q.frame, "ours", str(run)[:6], int(batch)) for run, batch in zip(chosen["run_id"], chosen["batch"])]
    return " `ours` chose its checkpointing itself from a plain selective probe's peak: " + "; ".join(
        f"{q.cell('checkpoint', row)} at batch {q.cell('batch', row)} (run {q.cell('run', row)})" for row in rows) + "."


def _accumulation_words(timed: pd.DataFrame) -> str:
    """Whether any run's `ours` accumulated gradients over passes of fewer sequences than its batch."""
    ours = timed[timed["provider"] == "ours"]
    accumulated = ours[ours["microbatch"] < ours["batch"]]
    if not len(accumulated):
        return ""
    runs = ", ".join(dict.fromkeys(accumulated["run_id"].astype(str).str[:6]))
    return (f", and in run {runs} forward and backward over fewer sequences at a time than the batch (column "
            "'sequences / pass'), the gradients accumulated, so that a pass holds only its sequences' activations")


NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])")  # a number as a reader of the prose sees one


def _provenance_words(first: pd.Series, commits: list[str]) -> tuple[str, ...]:
    """The numbers the intro prints that are provenance, not measurements (the device's name, the torch and Triton
    versions, the commits, the context length of the size): words of the sentence, declared as such."""
    names = [str(first[c]) for c in ("device_name", "torch_version", "triton_version", "context_length")] + commits
    # a commit is a word whole too: a reader (and the checker) sees 4e34639 as a number in scientific notation
    return tuple(number for name in names for number in NUMBER.findall(name)) + tuple(commits)


def _peak_tflops(device: str) -> float:
    """The device's dense bf16 datasheet peak in TFLOP/s, the MFU denominator (`timing.peak_flops`; NaN: none)."""
    from cs336_systems.timing import peak_flops  # here, not above: timing imports torch, which a report job need not

    return peak_flops(device, "bf16") / 1e12


def _peak_words(device: str) -> str:
    peak = _peak_tflops(device)
    if not _measured(peak):
        return ("MFU divides TFLOP/s by the device's dense bf16 datasheet peak (`timing.PEAK_FLOPS`), which is not "
                "known for this device.")
    return f"MFU divides TFLOP/s by {peak:g} TFLOP/s, the {device}'s dense bf16 datasheet peak (`timing.PEAK_FLOPS`)."


def _check_sentence(checks: pd.DataFrame | None) -> str:
    """What the runs' correctness checks gave (results/leaderboard_8b_check.csv; none where no run ran one)."""
    if checks is None or not len(checks):
        return ""
    failed = checks[checks["status"] != "check_ok"]
    said = ("every provider checked passed (`check_ok`) in every run" if not len(failed) else
            "; ".join(f"`{p}` {s} in run {str(r)[:6]}" for p, s, r in
                      zip(failed["provider"], failed["status"], failed["run_id"])) + "; the others passed")
    return ("Before the timings of each run, the correctness check at a scaled-down config with the same code paths "
            "compared each provider's loss and every gradient with a float32 reference (`results/leaderboard_8b_check.csv`): "
            + said + ".")


def render_leaderboard(ctx: Context) -> Section:
    frame = ctx.frame("leaderboard_8b")
    table = ctx.numeric("leaderboard_8b")
    q = Quotes(table)
    timed = frame
    first = frame.iloc[0]
    intro = (f"Answers the 2026 handout, section 9 (issue 24's step). {first['device_name']}, torch "
             f"{first['torch_version']}, Triton {first['triton_version']}; runs (run: commit) "
             + ", ".join(f"{str(r)[:6]}: {str(c)[:7]}" for r, c in
                         dict(zip(timed["run_id"], timed["git_commit"])).items()) + "; "
             f"model size `{first['size']}`, context {first['context_length']}, one device; each run's providers built "
             "and timed one after another in one process (`python -m cs336_systems.bench.leaderboard`, rule "
             "`leaderboard_8b`; from commit 7b9d7c8 on with expandable allocator segments for every provider, column "
             "`cuda_alloc_conf`). `ours` is our TransformerLM with our FlashAttention (on this GPU the Gluon "
             "kernels: the forward in every run; the backward in the runs of 7b9d7c8 (its lockstep schedule) and from "
             "a886410 on (the ping-pong schedule at head dim 128, kernels/flash/DECISIONS.md), FA2's Triton backward "
             "in those of 4857650), fused LM head + "
             "cross-entropy and fused AdamW, selective checkpointing and per-block compile" + _accumulation_words(timed)
             + "; `torch_plain_sac` and "
             "`torch_plain_ac` are plain PyTorch (SDPA, chunked checkpointed LM head + CE, torch's fused AdamW) with "
             "selective and with full per-block checkpointing. "
             + _check_sentence(ctx.frame("leaderboard_8b_check")) + _auto_sentence(q, frame))
    batches = sorted(set(q.frame.loc[q.frame["provider"] == "ours", "batch"]), reverse=True)
    gap = _gap_paragraph(q, batches)
    flops = ("FLOPs per step are counted as the leaderboard counts them (`model.accounting.leaderboard_flops`): "
             "6 × the non-embedding matmul parameters (the blocks' projections and MLP and the LM head) × tokens, "
             "plus 6 × layers × tokens × context × d_model for causal attention; recomputation is not counted, "
             f"so checkpointing costs time, not FLOPs. {_peak_words(first['device_name'])} The published leaderboard, as issue 24 quotes the 2026 handout's: the class's "
             "best entry took 3,837 ms on two B200s, about 27% of their dense bf16 peak, and the naive baseline "
             "10,000 ms; " + (f"ours reaches {_mfu_percent(q, 'ours', batches[0])}% MFU on one {first['device_name']} "
                              f"at batch {batches[0]}." if batches and _measured(_cell(q.frame, "ours", "MFU", batches[0]))
                              else "this device measures no MFU."))
    checked = [gap, flops]
    ablation = _ablation_paragraph(q)
    if ablation:
        checked.append(ablation)
    parts = [intro, checked[0], ctx.table("leaderboard_8b"), flops]
    if ablation:
        parts += [ablation, ctx.table("leaderboard_8b_ablations")]
    pointer = _profile_pointer(ctx)
    parts.append(pointer)
    checked += [intro, pointer]  # after the gap paragraph, which tests find first
    peak = _peak_tflops(first["device_name"])
    wording = ("9", "0.9", "54", "6", *((f"{peak:g}",) if _measured(peak) else ()), str(POWER_LIMIT_W), "3,837", "27", "10,000", "24", "2026",
               "128",  # the head dim the ping-pong backward ships at (kernels/flash/DECISIONS.md)
               "4857650")  # a commit the intro's kernel history names (given, whether or not these runs hold it)
    kept = tuple(sized[1] for sized in map(_sized, set(q.frame["provider"])) if sized)
    runs = tuple(dict.fromkeys(q.frame["run"]))
    provenance = _provenance_words(first, [str(c)[:7] for c in timed["git_commit"]])
    return Section(parts, table, checked, q.derived,
                   wording=wording + tuple(str(b) for b in batches) + kept + runs + provenance)


DELIVERABLES = [
    Deliverable("2026 §9 leaderboard: the 8B training step on one H200", "leaderboard_8b", render_leaderboard,
                ("leaderboard_8b",),
                tables=(Table("leaderboard_8b", "leaderboard_8b", step_table,
                              "One training step per provider per run; mean ± std over the timed steps; "
                              "ratio of means to the selective-checkpointing anchor of the same run and batch"),
                        Table("leaderboard_8b_ablations", "leaderboard_8b", ablation_table,
                              "Ablations of ours (every run's, each beside ours of its run and batch): mean step over ours' of the same run"))),
    # the profiled step (`--profile`, the rule's second output): its own section, pending until a run records it
    Deliverable("2026 §9 leaderboard, continued: where the 8B step's time and memory go", "leaderboard_8b",
                render_profile, ("leaderboard_8b_profile",),
                tables=(Table("leaderboard_8b_profile", "leaderboard_8b_profile", profile_table,
                              "One profiled step per provider (largest batch of the run): device time by category "
                              "(ms), the same time summed another way, and the step's wall time"),
                        Table("leaderboard_8b_memory", "leaderboard_8b_profile", memory_table,
                              "Peak memory of the profiled step by what holds it (GiB)"))),
]
