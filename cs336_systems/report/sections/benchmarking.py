"""Handout 1.1.3, 1.1.5 and 1.3.1 (b) (workflow/rules/benchmarking.smk): end-to-end timing of the
Transformer LM, warm-up, mixed precision, torch.compile, the plain-PyTorch baseline and the optimizer step.

A little over 400 lines: the ten deliverables of this part of the handout, each a renderer of a few dozen
lines over one table; splitting them would scatter the helpers they share (`stds`, `_cv`, the scope names)."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.model import forward_flops, get_config, parameter_count
from cs336_systems.report.appendix import appendix, moved, rows_of, statistic
from cs336_systems.report import figures, tables
from cs336_systems.report.section import (Context, Deliverable, Figure, Quotes, Section, Table, column_values,
                                          faster_or_slower)
from cs336_systems.report.profile_tables import kernel_vs_wall
from cs336_systems.report.frame import NumericTable
from cs336_systems.report.tables import (OPTIMIZER_STEP, VERSUS_TORCH, baseline_timing, compile_column, compile_scope,
                                         compile_timing, mixed_precision, phase_table)


def _steps(frame: pd.DataFrame, **where) -> pd.DataFrame:
    rows = frame[(frame["phase"] == "step") & (frame["status"] == "ok")]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return rows


def stds(table: pd.DataFrame, column: str) -> pd.Series:
    """The std of each 'mean ± std' cell of a step-time column (tables.phase_table names it '<column> std';
    NaN where the cell is OOM or a dash)."""
    return table[f"{column} std"].where(table[column].notna())


def _cv(table: pd.DataFrame, columns: list[str]) -> float:
    """The largest std over mean among the cells of `columns`."""
    return max((stds(table, c) / column_values(table, c)).max() for c in columns)


def render_e2e(ctx: Context) -> Section:
    frame = ctx.frame("e2e")
    q = Quotes(ctx.numeric("e2e_timing"))
    sizes = q.frame["size"].astype(str)
    fwd, bwd = "naive forward (ms)", "naive backward (ms)"
    rows = frame[(frame["precision"] == "fp32") & (frame["mode"] == "forward_backward")]
    ms_columns = [c for c in q.table.headers if c.endswith("(ms)")]
    text = (
        f"Batch {int(rows['batch_size'].iloc[0])}, context {int(rows['context_length'].iloc[0])}, "
        f"{int(rows['warmup'].iloc[0])} warm-up and {int(rows['steps'].iloc[0])} measured steps, float32. "
        f"With our naive attention the forward pass takes {q.cell(fwd, 0)} ms for "
        f"{sizes.iloc[0]} and {q.cell(fwd, len(sizes) - 1)} ms for {sizes.iloc[-1]}; the backward pass takes "
        f"{q.derive(lambda t: (column_values(t, bwd) / column_values(t, fwd)).min(), '.2f', 'least backward/forward')}–"
        f"{q.derive(lambda t: (column_values(t, bwd) / column_values(t, fwd)).max(), '.2f', 'largest backward/forward')}× "
        f"the forward time, as expected from its two matrix products per forward one. Once warmed up the steps "
        f"are steady: the standard deviation is at most "
        f"{q.derive(lambda t: 100 * _cv(t, ms_columns), '.1f', 'largest std over mean, %')}% of the mean.")
    ooms = sorted(set(frame.loc[frame["status"] == "oom", "size"]))
    if ooms:
        text += f" Out of memory: {', '.join(ooms)}."
    settings = tuple(str(int(rows[c].iloc[0])) for c in ("batch_size", "context_length", "warmup", "steps"))
    return Section([text, ctx.table("e2e_timing"), ctx.figure("e2e_timing", "timings")], q.table, [text], q.derived,
                   wording=settings)


def render_warmup(ctx: Context) -> Section:
    frame = ctx.frame("e2e_warmup")
    q = Quotes(ctx.numeric("e2e_warmup"))
    table = q.frame
    warmups = sorted(set(frame["warmup"]))
    cold, warm = f"warmup={warmups[0]} step (ms)", f"warmup={warmups[-1]} step (ms)"
    slowdown = column_values(table, cold) / column_values(table, warm)
    worst = slowdown.idxmax()
    size = table.loc[worst, "size"]
    text = (  # the cells as the table prints them, mean ± std
        f"Each point ran in a fresh process. With {warmups[0]} warm-up steps the mean step time of {size} is "
        f"{q.table.cell_text(worst, cold)} ms against {q.table.cell_text(worst, warm)} ms with {warmups[-1]}: "
        f"{q.derive(lambda t: (column_values(t, cold) / column_values(t, warm)).max(), '.2f', 'largest slowdown without warm-up')}× "
        f"the time, the largest ratio of any size.")
    parts, checked = [text], [text]
    first = f"warmup={warmups[0]} 1st step (ms)"
    if first not in q.table.headers:
        parts.append("Which measured steps are slow: pending: rule `e2e_warmup` (its rows now record every measured "
                     "step's time, `samples_ms`; these rows predate that).")
    else:
        paragraph = _warmup_why(q, table, warmups)
        parts.append(paragraph)
        checked.append(paragraph)
    # the body keeps each point's mean step; the first and slowest later steps are in the full table, in the appendix
    means = ("size", *(f"warmup={w} step (ms)" for w in warmups))
    table = [rows_of(q.table, None, means).to_markdown(),
             f"_{statistic(ctx.table('e2e_warmup'))}: mean ± std per point; its first and slowest later steps are in "
             "the full table._", appendix("1.1.3 (c): every point's first and slowest later step", ctx.table("e2e_warmup"))]
    # the warm-up counts of the grid and the 10% threshold are the sentence's, not measurements
    return Section([*parts, *table, ctx.figure("e2e_warmup", "warm-up")], q.table, checked, q.derived,
                   wording=(*map(str, warmups), "10"))


def _warmup_why(q: Quotes, table: pd.DataFrame, warmups: list[int]) -> str:
    """1.1.3(c)'s why, from each point's per-step samples: which steps are slow after 0, 1 and 2 warm-up steps."""
    warm = f"warmup={warmups[-1]} step (ms)"
    cold_first = f"warmup={warmups[0]} 1st step (ms)"

    def over_warm(column: str):
        return lambda t: column_values(t, column) / column_values(t, warm)

    def sizes_where(column: str, slow: bool) -> str:
        above = over_warm(column)(table) > 1.1
        names = table["size"][above if slow else ~above].astype(str).tolist()
        return ", ".join(names) or "no size"

    one = warmups[1]
    text = (
        f"Why: with {warmups[0]} warm-up steps the first measured step takes "
        f"{q.derive(lambda t: over_warm(cold_first)(t).min(), '.2f', 'first cold step over warmed mean, least')}–"
        f"{q.derive(lambda t: over_warm(cold_first)(t).max(), '.2f', 'first cold step over warmed mean, most')}× the "
        f"mean step of {warmups[-1]} warm-up steps (more than 10% above it at: {sizes_where(cold_first, True)}), and "
        f"most later steps of the run are back near that mean. That first step pays what a process's first CUDA work "
        f"costs once: each kernel's code is loaded on its first launch (CUDA loads modules lazily), cuBLAS creates "
        f"its handle and workspace and picks an algorithm for each matrix shape, and the caching allocator gets the "
        f"step's activations and gradients from the driver with cudaMalloc, which synchronises the device, where "
        f"later steps reuse its cached blocks. (These are the known one-time costs; this run does not separate "
        f"them.) After {one} warm-up step the first measured step is no more than 10% above that mean at: "
        f"{sizes_where(f'warmup={one} 1st step (ms)', False)}, so a single step pays nearly all of it.")
    steady = [f"warmup={w} step (ms)" for w in warmups[1:]]

    def spread_over_std(t: pd.DataFrame) -> float:
        means = pd.concat([column_values(t, c) for c in steady], axis=1)
        spread = means.max(axis=1) - means.min(axis=1)
        return (spread / pd.concat([stds(t, c) for c in steady], axis=1).max(axis=1)).max()

    later = [f"warmup={w} slowest later (ms)" for w in warmups]
    slow_everywhere = [w for w, c in zip(warmups, later) if (over_warm(c)(table) > 1.1).any()]
    text += (
        f" What still differs between {', '.join(map(str, warmups[1:]))} warm-up steps are single slow steps, and "
        f"they appear whatever the warm-up (a later step more than 10% above the mean, at some size, after "
        f"{', '.join(map(str, slow_everywhere)) or 'no'} warm-up steps): so they are not warm-up effects but the "
        f"noise of a run (the host scheduling the Python process, other work on the machine, GPU clocks). The "
        f"means with {', '.join(map(str, warmups[1:]))} warm-up steps differ by at most "
        f"{q.derive(spread_over_std, '.2f', 'spread of the warmed means over their largest std, most')}× the "
        f"largest of their standard deviations at any size; more measured steps, or the median, damp them.")
    return text


def render_mixed_precision(ctx: Context) -> Section:
    q = Quotes(ctx.numeric("mixed_precision"))
    table = q.frame
    speedup = column_values(table, "bf16 speed-up").set_axis(table["size"].astype(str)).dropna()

    def cell(size: str) -> str:
        return q.cell("bf16 speed-up", size=size)

    text = (
        f"bf16 autocast speeds the forward+backward step up (fp32 mean step over bf16's, as the table's means) by "
        f"{cell(speedup.index[0])}× for {speedup.index[0]} "
        f"and {cell(speedup.index[-1])}× for {speedup.index[-1]} (range {cell(speedup.idxmin())}–"
        f"{cell(speedup.idxmax())}×); "
        + ("the speed-up grows with size at every step of the table." if speedup.is_monotonic_increasing else
           f"the speed-up does not grow steadily with size (largest for {speedup.idxmax()}).")
    )
    bf16 = ["bf16 forward (ms)", "bf16 backward (ms)"]
    fp32 = ["fp32 forward (ms)", "fp32 backward (ms)"]
    step = column_values(table, bf16[0]) + column_values(table, bf16[1])
    inverted = [(table["size"].iloc[i], table["size"].iloc[j]) for i in range(len(step)) for j in range(i + 1, len(step))
                if step.iloc[i] > step.iloc[j]]
    noise = (f"The bf16 times are also far noisier: their standard deviation reaches "
             f"{q.derive(lambda t: 100 * _cv(t, bf16), '.0f', 'largest bf16 std over mean, %')}% of the mean, "
             f"against {q.derive(lambda t: 100 * _cv(t, fp32), '.0f', 'largest fp32 std over mean, %')}% in fp32")
    noise += (", and a smaller model's bf16 step is slower than a larger one's ("
              + ", ".join(f"{a} over {b}" for a, b in inverted) + ")." if inverted else ".")
    noise += (" A bf16 step that takes longer than a larger model's, and varies this much from step to step, is not "
              "paced by the GPU's arithmetic: the next section compares its kernel time with its wall time."
              if inverted else "")
    return Section([text, noise, ctx.table("mixed_precision")], q.table, [text, noise], q.derived)


def render_host_bound(ctx: Context) -> Section:
    q = Quotes(ctx.numeric("kernel_vs_wall"))
    table = q.frame
    ok = table[table["status"] == "ok"]
    share = column_values(ok, "kernel share of step").set_axis(ok["size"].astype(str))
    bound = share[share < 0.5]
    parts = [
        f"Eager {table['precision'].iloc[0]} training steps at context {q.cell('context', 0)}, profiled (kernel "
        f"time) and timed by the harness in the same process (wall time, unprofiled). The GPU is busy with kernels "
        + ", ".join(q.cell("kernel share of step", i) for i in ok.index) + " of the step's wall time ("
        + ", ".join(share.index) + ")."]
    if len(bound):
        parts[0] += (f" Below one half ({', '.join(bound.index)}) the step is host-bound: the GPU waits for Python and "
                     f"the kernel launches, so the step time follows the number of kernels launched (which grows "
                     f"with the layers) and the host's speed at that moment, not the FLOPs; this is why such steps "
                     f"vary from step to step and can be slower than a larger model's.")
    else:
        parts[0] += " Every size keeps the GPU busy at least half of the step: the kernels, not the host, set the pace."
    ooms = table[table["status"] != "ok"]
    if len(ooms):
        parts.append("Out of memory: " + ", ".join(ooms["size"].astype(str)) + ".")
    # size names are words, not measurements: the "2" the number pattern reads in "2.7B"
    moved_table = moved(ctx, "kernel_vs_wall", "kernel time against wall time: every size", ("size", "status"))
    return Section([*parts, *moved_table], q.table, parts, q.derived, wording=("2",))


def render_accumulation(ctx: Context) -> str:
    frame = ctx.frame("mixed_precision")
    acc = frame[frame["kind"] == "accumulation"].set_index("item")
    lines = [f"- `{item}`: {row['value']:.6g} ({row['dtype']}), error {row['abs_error']:.2g}"
             for item, row in acc.iterrows()]
    worst, best = acc["abs_error"].idxmax(), acc["abs_error"].idxmin()
    text = (f"Adding 0.01 a thousand times should give 10. The float16 accumulator ({worst}) is off by "
            f"{acc.loc[worst, 'abs_error']:.3g}: once the sum is large, float16's 10-bit mantissa cannot represent "
            f"sum + 0.01 and each addition rounds. A float32 accumulator fed float16 terms is off by "
            f"{acc.loc['fp32 += fp16', 'abs_error']:.3g}: the terms themselves carry float16's rounding of 0.01 "
            f"(upcast explicitly or by type promotion, the same), which summed 1000 times is the whole error. "
            f"float32 throughout ({best}) is off by only {acc.loc[best, 'abs_error']:.2g}. Hence mixed precision "
            f"keeps accumulations in float32.")
    return "\n".join([text, "", *lines])


def render_toy_dtypes(ctx: Context) -> str:
    frame = ctx.frame("mixed_precision")
    dtypes = frame[frame["kind"] == "dtype"]
    device = dtypes["device_type"].iloc[0]
    lines = [f"- {item}: `{dtype}`" for item, dtype in zip(dtypes["item"], dtypes["dtype"])]
    ln = dict(zip(dtypes["item"], dtypes["dtype"]))["layer norm output"]
    text = (f"Observed by running the model under `torch.autocast(device_type='{device}', dtype=torch.float16)` "
            f"(forward hooks on fc1 and the layer norm):")
    explanation = (
        f"(b) Layer normalisation computes a mean and a variance — reductions over the features — and divides "
        f"by √(var + ε): sums of squares overflow float16's range (max 65504) and small variances lose their "
        f"few significant bits, so autocast runs it in float32 on CUDA (here its output is `{ln}` on {device}). "
        f"bfloat16 has float32's exponent range, so overflow is no longer the problem, but with a 7-bit "
        f"mantissa the reductions are still imprecise; autocast keeps layer norm (and softmax, losses) in float32 "
        f"for bfloat16 too, and our RMSNorm upcasts to float32 explicitly.")
    return "\n".join([text, "", *lines, "", explanation])


def recompile_limited(log: str) -> set[tuple[str, str]]:
    """(size, mode) of compiled points that finished after torch.compile hit its recompile limit in the
    run (dynamo then falls back to eager), read off the rule's log: progress lines come after each point."""
    hit, affected = False, set()
    for line in log.splitlines():
        hit = hit or "recompile_limit" in line
        match = re.match(r"\[\d+/\d+\] (\S+) (\S+) \S+ \S+ compile=True", line)
        if hit and match:
            affected.add((match[1], match[2]))
    return affected


def render_compile(ctx: Context) -> Section:
    frame = ctx.frame("e2e_compile")
    q = Quotes(ctx.numeric("compile_timing"))
    rows = _steps(frame)
    # one log per size (compile_timing_size); older runs wrote a single compile_timing log
    logs = [ctx.log("compile_timing"), *(ctx.log(f"compile/{size}") for size in frame["size"].unique())]
    affected = set().union(*(recompile_limited(log) for log in logs))
    rows = rows[[(size, mode) not in affected for size, mode in zip(rows["size"], rows["mode"])]]
    rows = rows.assign(scope=compile_scope)
    from cs336_systems.bench.e2e import COMPILE_SCOPES  # here, not above: bench.e2e costs a report process ~1 s

    scopes = [s for s in COMPILE_SCOPES if s != "none" and s in set(frame.assign(scope=compile_scope)["scope"])]
    blocks = compile_column("speed-up", "blocks", scopes)

    def kept(t: pd.DataFrame) -> pd.Series:  # the table's rows that ran without hitting the recompile limit
        return pd.Series([(size, mode) not in affected for size, mode in zip(t["size"], t["mode"])], index=t.index)

    def speedup(t: pd.DataFrame) -> pd.Series:
        return column_values(t, blocks, kept).dropna()

    lead = (f"Compiling each Transformer block with torch.compile changes the step time by "
            f"{q.derive(lambda t: speedup(t).min(), '.2f', 'least block-compiled speed-up')}–"
            f"{q.derive(lambda t: speedup(t).max(), '.2f', 'largest block-compiled speed-up')}× "
            f"(eager median over compiled median, the table's '{blocks}'; median "
            f"{q.derive(lambda t: speedup(t).median(), '.2f', 'median block-compiled speed-up')}×): "
            f"the compiler fuses the elementwise work (RMSNorm, RoPE, SiLU gating, softmax and masking) into few "
            f"kernels, while the matrix products, which dominate large models, stay cuBLAS calls.")
    checked = [lead]
    if affected:
        checked.append(
            f"Left out above: {', '.join(f'{s} {m}' for s, m in sorted(affected))}. The run's log shows torch.compile "
            f"hitting its recompile limit before these points, so their 'compiled' time is partly eager (the "
            f"table still lists them). The harness now resets the compiler before every point.")
    ooms = frame[frame["status"] == "oom"]
    if len(ooms):
        cases = sorted({(size, mode) for size, mode in zip(ooms["size"], ooms["mode"])})
        checked.append(f"Out of memory on the {frame['device_name'].iloc[0]}: "
                       f"{', '.join(f'{s} {m}' for s, m in cases)} (eager and/or compiled, as the table shows).")
    commits = rows.set_index(["size", "attention", "mode", "scope"])["git_commit"].str[:7]
    for scope in ("model", "model-cudagraphs"):
        if scope in scopes:
            checked += _versus_blocks(q, scope, scopes, kept, commits)
    parts = list(checked)
    per_layer, flop_growth = _compiled_forward_per_layer(q, frame, scopes, kept)
    if per_layer:
        parts.append(per_layer)
        checked.append(per_layer)
    trend = _speedup_by_size(q, blocks, kept)
    if trend:
        parts.append(trend)
        checked.append(trend)
    parts.append(_compile_gaps(frame, q.frame, scopes))
    # the FLOPs per layer are the model's (its config), not a measurement
    return Section([*parts, ctx.table("compile_timing"), ctx.figure("compile_timing", "compile")], q.table, checked,
                   q.derived, wording=flop_growth)


def size_trend(values: pd.Series) -> str:
    """How a series ordered by model size moves: 'falls' or 'grows' only where every step goes that way."""
    steps = values.diff().dropna()
    if (steps < 0).all():
        return "falls with size"
    if (steps > 0).all():
        return "grows with size"
    return "no steady trend with size"


def _speedup_by_size(q: Quotes, blocks: str, kept) -> str:
    """The block-compiled speed-up at every size, per mode, and which way it moves with size in this run: a trend
    is named only where every size continues it."""
    sentences, trends = [], []
    for mode in sorted(set(q.frame["mode"])):
        rows = q.frame[(q.frame["mode"] == mode) & kept(q.frame)]
        values = column_values(rows, blocks).dropna()
        if len(values) < 2:
            continue
        trends.append(size_trend(values))
        sentences.append(f"{mode} ({trends[-1]}): "
                         + ", ".join(f"{q.cell(blocks, i)}× ({rows.at[i, 'size']})" for i in values.index))
    if not sentences:
        return ""
    text = "The block-compiled speed-up by size, smallest first, " + "; ".join(sentences) + "."
    if "falls with size" in trends:
        return text + (" Where it falls with size, what compilation removes (the separate elementwise kernels and "
                       "their launches) is a larger part of a small model's eager step than of a large one's; the "
                       "eager bf16 steps' kernel time against their wall time is in `1.1.5 (c), continued`.")
    return text + " This run does not show the speed-up shrinking as the model grows."


def _compile_gaps(frame: pd.DataFrame, table: pd.DataFrame, scopes: list[str]) -> str:
    """The compile table's dashes: the (size, mode, scope) points with no row in the results, each with the
    command that measures it (a point that ran out of memory has its OOM row and says so in its cell)."""
    steps = frame[frame["phase"].eq("step") | frame["status"].ne("ok")].assign(scope=compile_scope)
    ran = set(zip(steps["size"], steps["attention"], steps["mode"], steps["scope"]))
    missing = [(str(size), attention, mode, scope) for size, attention, mode in
               zip(table["size"], table["attention"], table["mode"]) for scope in scopes
               if (str(size), attention, mode, scope) not in ran]
    if not missing:
        return "Every cell of the table was measured."
    precision = frame["precision"].iloc[0]
    optimizer = frame.loc[frame["mode"] == "train_step", "optimizer"].dropna()
    lines = [f"- {size} {mode}, {scope}: `python -m cs336_systems.bench.e2e --device cuda --sizes {size} --modes "
             f"{mode} --precisions {precision} --attention {attention} --compile-scopes {scope}"
             + (f" --optimizers {optimizer.iloc[0]}" if mode == "train_step" and len(optimizer) else "")
             + f" --out results/raw/compile/{size}_{mode}_{scope}.csv`"
             for size, attention, mode, scope in missing]
    return ("Not measured (a dash in the table), each with the command that measures it on a GPU; its rows go into "
            "results/e2e_compile.csv with `python -m cs336_systems.bench.merge`:\n\n"
            + "\n".join(lines))


WEIGHT_NAMES = {"float32": "float32 weights", "bf16-master": "bf16 weights and float32 masters"}


def render_baseline(ctx: Context) -> Section:
    frame = ctx.frame("e2e_baseline")
    q = Quotes(ctx.numeric("baseline_timing"))
    table = q.frame
    ok = table[table["median (ms)"].notna()]
    parts = [f"Our model and the plain-PyTorch baseline (`cs336_systems/bench/plain_model.py`: the same function "
             f"and parameter count written as a competent PyTorch user would: one fused QKV projection, `nn.RMSNorm`, "
             f"RoPE computed in the compute dtype, `F.scaled_dot_product_attention` (cuDNN's fused attention on this "
             f"GPU), compiled the same way, trained with torch.optim.AdamW(fused=True)) timed one after the other in "
             f"one process "
             f"on the {frame['device_name'].iloc[0]}: batch {int(frame['batch_size'].iloc[0])}, context "
             f"{int(frame['context_length'].iloc[0])}, {frame['precision'].iloc[0]} autocast, full training steps"
             + (f", the whole grid run {q.cell('rounds', table['rounds'].idxmax())} times interleaved (every point once "
                "per round; each median is over the measured steps of all rounds)." if table["rounds"].max() > 1 else
                ".")]
    if (ok["weights"] == "bf16-master").any():
        parts[0] += (" With bf16 weights and float32 masters, ours keeps its matmul weights in bf16 and float32 "
                     "copies in its AdamW, which updates each copy and rounds it into the weight, so autocast casts "
                     "no weight; a CPU test checks that logits, loss and gradients equal autocast's over float32 "
                     "weights.")
    for (size, scope), rows in ok.groupby(["size", "compiled"], observed=True, sort=False):
        ours, plain = rows[rows["model"] == "ours"], rows[rows["model"] == "plain"]
        if not len(ours) or not len(plain):
            continue
        baseline = plain.index[0]
        each = [f"with {WEIGHT_NAMES[row['weights']]} {q.cell('median (ms)', i)} ms (MFU {q.cell('MFU', i)}; "
                f"{q.cell('÷ plain', i)}× the baseline's time, {faster_or_slower(row['÷ plain'])})"
                for i, row in ours.iterrows()]
        first = ours.iloc[0]
        parts.append(
            f"{size}, {COMPILE_SCOPE_NAMES.get(scope, 'eager')}: the baseline takes {q.cell('median (ms)', baseline)} "
            f"ms per step (median; MFU {q.cell('MFU', baseline)}); ours ({first['attention']} attention, "
            f"{OPTIMIZER_NAMES.get(first['optimizer'], first['optimizer'])}) " + ", ".join(each) + ".")
    ooms = table[table["median (ms)"].isna()]
    if len(ooms):
        parts.append("Out of memory: " + ", ".join(f"{r['size']} {r['model']}" for _, r in ooms.iterrows()) + ".")
    settings = tuple(str(int(frame[c].iloc[0])) for c in ("batch_size", "context_length"))
    return Section([*parts, ctx.table("baseline_timing")], q.table, parts, q.derived, wording=settings)


def _versus_blocks(q: Quotes, scope: str, scopes: list[str], kept, commits: pd.Series) -> list[str]:
    """Another compile scope's step time over the block-compiled one's, per row of the table: the ratio of
    the two speed-up columns (both over the same eager median)."""
    blocks, other = compile_column("speed-up", "blocks", scopes), compile_column("speed-up", scope, scopes)

    def times(t: pd.DataFrame) -> pd.Series:
        pair = pd.DataFrame({"blocks": column_values(t, blocks, kept), "other": column_values(t, other, kept),
                             "size": t["size"].astype(str), "attention": t["attention"], "mode": t["mode"]}).dropna()
        return (pair["blocks"] / pair["other"]).set_axis(pd.MultiIndex.from_frame(pair[["size", "attention", "mode"]]))

    versus = times(q.frame)
    if not len(versus):
        return []
    runs = {(commits.get((*key, "blocks")), commits.get((*key, scope))) for key in versus.index}
    note = ("" if all(a == b for a, b in runs) else
            " These pairs come from different runs (block-compiled at " + ", ".join(sorted({a for a, _ in runs}))
            + f", {scope} at " + ", ".join(sorted({b for _, b in runs})) + "): the ratio carries the difference "
            "between the two runs as well.")
    return [f"With the {COMPILE_SCOPE_NAMES[scope]} instead, the step takes "
            f"{q.derive(lambda t: times(t).min(), '.2f', f'least {scope} time over block-compiled')}–"
            f"{q.derive(lambda t: times(t).max(), '.2f', f'largest {scope} time over block-compiled')}× the time "
            f"of the block-compiled one ('{blocks}' over '{other}'; median "
            f"{q.derive(lambda t: times(t).median(), '.2f', f'median {scope} time over block-compiled')}×; "
            + ", ".join(f"{size} {mode}" for size, _, mode in sorted(versus.index)) + f").{note}"]


def _compiled_forward_per_layer(q: Quotes, frame: pd.DataFrame, scopes: list[str],
                                kept) -> tuple[str, tuple[str, ...]]:
    """Block-compiled forward time per layer by size (the table's median ÷ the model's layers), set against the
    matrix FLOPs per layer: a time per layer that stays nearly flat while the work per layer grows points to a
    cost that does not scale with it. Also the FLOP growth as printed (a model constant, not a cell)."""
    column = compile_column("compiled", "blocks", scopes) + " (ms)"
    if column not in q.table.headers:
        return "", ()

    def forward(t: pd.DataFrame) -> pd.DataFrame:  # one forward row per size that ran block-compiled
        rows = t[(t["mode"] == "forward") & kept(t) & t[column].notna()]
        return rows.drop_duplicates("size")

    sizes = [str(s) for s in forward(q.frame)["size"]]
    if len(sizes) < 2:
        return "", ()
    layers = {size: get_config(size).num_layers for size in sizes}

    def per_layer(t: pd.DataFrame) -> pd.Series:
        rows = forward(t)
        return (column_values(rows, column) / rows["size"].astype(str).map(layers)).set_axis(rows["size"].astype(str))

    point = frame[(frame["mode"] == "forward")].iloc[0]  # the grid's batch and context, the same for every size
    flops = pd.Series({size: forward_flops(get_config(size), int(point["batch_size"]), int(point["context_length"]))
                       / layers[size] for size in sizes})
    growth = f"{flops.max() / flops.min():.1f}"
    text = ("Compiled forward time per layer (the table's block-compiled median ÷ layers): "
            + ", ".join(f"{size} {q.derive(lambda t, s=size: per_layer(t)[s], '.2f', f'{size} ms per layer')} ms"
                        for size in sizes)
            + f"; the matrix FLOPs per layer grow {growth}× over the same sizes.")
    spread = per_layer(q.frame).max() / per_layer(q.frame).min()
    if spread < flops.max() / flops.min() / 3:
        text += (f" The time per layer varies only "
                 f"{q.derive(lambda t: per_layer(t).max() / per_layer(t).min(), '.1f', 'largest over least ms per layer')}"
                 f"× between sizes, so a cost per layer that does not scale with the work weighs heavily up to the "
                 f"larger sizes; our hypothesis, not yet profiled, is host work per compiled block (guards, the "
                 f"generated Python, kernel launches).")
    return text, (growth,)


COMPILE_SCOPE_NAMES = {"blocks": "each block compiled", "model": "whole model compiled",
                       "model-cudagraphs": "whole model compiled with CUDA graphs"}
OPTIMIZER_NAMES = {"foreach": "our multi-tensor AdamW", "fused": "our fused Triton AdamW",
                   "torch_fused": "torch's fused AdamW"}


def render_optimizer(ctx: Context) -> Section:
    frame = ctx.frame("optimizer")
    q = Quotes(ctx.numeric("optimizer"))
    intro = (f"Each row times the optimizer phase of an eager {frame['precision'].iloc[0]} training step "
             f"(the parameters, gradients and AdamW state are fp32 in every case) on the "
             f"{frame['device_name'].iloc[0]}; times are medians over the measured steps. `foreach` is our AdamW "
             f"with one multi-tensor operation per step of the formula, about 20 passes over memory; `fused` is our "
             f"AdamW with one Triton kernel per tensor (`kernels/adamw_triton.py`), 7 passes; `torch_fused` is "
             f"torch.optim.AdamW(fused=True).")
    checked = [p for p in (_fused_over_foreach(q), _ours_over_torch(q)) if p]
    ooms = [str(size) for i, size in enumerate(q.frame["size"]) if q.table.status.get(OPTIMIZER_STEP, {}).get(i)]
    if ooms:
        checked.append(f"Out of memory: {', '.join(dict.fromkeys(ooms))} (a training step of that size needs more "
                       f"than the device has).")
    table = moved(ctx, "optimizer", "the optimizer step: every variant and size", ("size", "optimizer"))
    return Section([intro, *checked, *table], q.table, checked, q.derived)


def _optimizer_steps(t: pd.DataFrame, optimizer: str) -> pd.Series:
    """One optimizer's step time (the table's median) by size, NaN where it did not run."""
    rows = t[t["optimizer"] == optimizer]
    return column_values(rows, OPTIMIZER_STEP).set_axis(rows["size"].astype(str))


def _foreach_over_fused(t: pd.DataFrame) -> pd.Series:
    return (_optimizer_steps(t, "foreach") / _optimizer_steps(t, "fused")).dropna()


def _fused_over_foreach(q: Quotes) -> str:
    """How much faster our fused kernel makes the step than our multi-tensor AdamW, at the largest size
    both ran and over all sizes."""
    ratio = _foreach_over_fused(q.frame)
    if not len(ratio):
        return ""
    largest = ratio.index[-1]  # the table's rows are in size order
    way = "faster" if ratio[largest] > 1 else "foreach's speed: slower"  # (a CPU run interprets the Triton kernel)
    return (f"The fused kernel takes the step from {q.cell(OPTIMIZER_STEP, size=largest, optimizer='foreach')} to "
            f"{q.cell(OPTIMIZER_STEP, size=largest, optimizer='fused')} ms for the {largest} model ("
            f"{q.derive(lambda t: _foreach_over_fused(t)[largest], '.2f', f'{largest} foreach over fused')}× {way}; "
            f"{q.derive(lambda t: _foreach_over_fused(t).min(), '.2f', 'least foreach over fused')}–"
            f"{q.derive(lambda t: _foreach_over_fused(t).max(), '.2f', 'largest foreach over fused')}× over all "
            f"sizes).")


def _ours_over_torch(q: Quotes) -> str:
    """Our fused AdamW's step over torch's fused one, the table's '÷ torch_fused' cells of our rows."""
    ours = q.frame[(q.frame["optimizer"] == "fused") & q.frame[VERSUS_TORCH].notna()]
    if not len(ours):
        return ""

    def ratios(t: pd.DataFrame) -> pd.Series:
        return column_values(t, VERSUS_TORCH, lambda f: f["optimizer"] == "fused").dropna()

    return (f"Ours over torch's fused AdamW: {q.derive(lambda t: ratios(t).min(), '.2f', 'least ours over torch')}–"
            f"{q.derive(lambda t: ratios(t).max(), '.2f', 'largest ours over torch')}× ("
            + ", ".join(f"{size} {q.cell(VERSUS_TORCH, i)}×" for i, size in ours["size"].items()) + ").")


BASELINE = Table("baseline_timing", "e2e_baseline", baseline_timing,
                 "Our model against the plain-PyTorch baseline, same run: training step ms (median over the measured "
                 "steps of every round), MFU from it, and the median over the baseline's")
HOST_BOUND = Table("kernel_vs_wall", "profile_bf16", kernel_vs_wall,
                   "Eager steps: kernel time per phase (PyTorch profiler) against the harness's synchronized wall "
                   "time of the same phase in the same process; kernel share = kernel time ÷ wall time of the step")
E2E = Table("e2e_timing", "e2e", tables.e2e_timing,
            "Forward and backward time per step (mean ± std over measured steps), fp32")
WARMUP = Table("e2e_warmup", "e2e_warmup", tables.e2e_warmup,
               "Forward+backward step time by number of warm-up steps, fp32")
MIXED = Table("mixed_precision", "e2e", mixed_precision,
              "Forward and backward time per step (mean ± std over measured steps), fp32 versus bf16 autocast; "
              "bf16 speed-up = fp32 mean step ÷ bf16 mean step")
COMPILE = Table("compile_timing", "e2e_compile", compile_timing,
                "Eager versus torch.compile'd model: ms per step, median over the measured steps; speed-up = eager "
                "median ÷ compiled median, for each compiled scope; compiled MFU from the median of the fastest "
                "compiled scope; bf16 autocast")
OPTIMIZER = Table("optimizer", "optimizer", tables.optimizer_timing,
                  "AdamW's step alone, eager training steps: ms per step, median over the measured steps; the "
                  "bandwidth is AdamW's least traffic over that time; ÷ torch_fused = the optimizer step over torch's "
                  "fused AdamW's at the same size")

# ---- the 2026 handout's §2.1 with its own Table 1 (results/*_2026.csv, rows with size_table 2026) ---------------

def e2e_timing_2026(frame: pd.DataFrame) -> NumericTable:
    """2026 §2.1.3 (b): per size, the mean (± std) of each phase of a full training step (forward, backward,
    AdamW step), and the forward-only (inference) and forward+backward runs' phases; OOM where a run did not fit."""
    rows = frame[frame["precision"] == "fp32"]
    runs = {"step": ("train_step", ["forward", "backward", "optimizer"]),
            "fwd+bwd": ("forward_backward", ["forward", "backward"]), "inference": ("forward", ["forward"])}
    table = None
    for label, (mode, phases) in runs.items():
        if mode not in set(rows["mode"]):
            continue
        part = phase_table(rows[rows["mode"] == mode], {label: {}}, phases)
        table = part if table is None else _beside(table, part)
    return table


def _beside(left: NumericTable, right: NumericTable) -> NumericTable:
    """Two per-size tables side by side (the same sizes in the same order: every run has a row per size)."""
    data = left.data.merge(right.data, on="size", how="left", sort=False)
    return NumericTable(data, (*left.columns, *right.columns[1:]), {**left.status, **right.status})


def render_e2e_2026(ctx: Context) -> Section:
    frame = ctx.frame("e2e_2026")
    q = Quotes(ctx.numeric("e2e_timing_2026"))
    ms = [c for c in q.table.headers if c.endswith("(ms)")]
    ran = q.frame.dropna(subset=["step forward (ms)"]) if "step forward (ms)" in q.frame else q.frame.iloc[:0]
    text = (f"The 2026 handout's sizes (its Table 1: xl is d_model 2560, 32 layers, our 2025 2.7B; 10B is 4608, "
            f"50 layers), batch {int(frame['batch_size'].iloc[0])}, context {int(frame['context_length'].iloc[0])}, "
            f"float32, {int(frame['warmup'].iloc[0])} warm-up and {int(frame['steps'].iloc[0])} measured steps, "
            f"mean ± std.")
    if len(ran):
        first, last = ran.index[0], ran.index[-1]
        text += (f" A full step's forward pass takes {q.cell('step forward (ms)', first)} ms for {ran['size'][first]} "
                 f"and {q.cell('step forward (ms)', last)} ms for {ran['size'][last]}, its backward pass "
                 f"{q.cell('step backward (ms)', first)} and {q.cell('step backward (ms)', last)} ms, and the AdamW "
                 f"step {q.cell('step optimizer (ms)', first)} and {q.cell('step optimizer (ms)', last)} ms.")
    cv = 100 * _cv(q.frame, ms)
    text += (f" The standard deviation is at most "
             f"{q.derive(lambda t: 100 * _cv(t, ms), '.1f', 'largest std over mean, %')}% of the mean: the "
             + ("variability across measured steps is small." if cv <= 5 else
                "variability across measured steps is not small at every point (the table's ± says where)."))
    ooms = frame[frame["status"] == "oom"]
    state, numbers = [], []  # the state each size that ran out of memory holds, in GB: numbers of the argument
    if len(ooms):
        for size in dict.fromkeys(ooms["size"]):
            count = parameter_count(get_config(size, edition="2026"))
            said = (f"{count / 1e9:.1f}", f"{8 * count / 1e9:,.0f}", f"{16 * count / 1e9:,.0f}")
            state.append(f"{size}'s {said[0]} billion parameters need {said[1]} GB and {said[2]} GB")
            numbers += said
        text += (" Out of memory: " + ", ".join(f"{r['size']} {r['mode']}" for _, r in ooms.iterrows())
                 + ". In float32 a forward and backward holds 8 bytes per parameter (parameters and gradients) and a "
                 "training step with AdamW 16 (two moments more), before any activation: " + "; ".join(state)
                 + " (a 10B step fits one GPU with bf16 parameters and moments, sharded state over several GPUs, or "
                 "the optimizer state offloaded).")
    settings = tuple(str(int(frame[c].iloc[0])) for c in ("batch_size", "context_length", "warmup", "steps"))
    return Section([text, ctx.table("e2e_timing_2026")], q.table, [text], q.derived,
                   wording=(*settings, "2025", "2026", "1", "2560", "32", "2", "2.7", "10", "4608", "50", "16", "5", "8",
                            *numbers))


def render_mixed_precision_2026(ctx: Context) -> Section:
    frame = ctx.frame("mixed_precision_2026")
    q = Quotes(ctx.numeric("mixed_precision_2026"))
    speedup = "bf16 speed-up"
    ran = q.frame.dropna(subset=[speedup])
    text = (f"Forward and backward passes of the 2026 sizes, float32 against bf16 autocast in one run (naive "
            f"attention, batch {int(frame['batch_size'].iloc[0])}, context {int(frame['context_length'].iloc[0])}).")
    if len(ran):
        text += (f" bf16 makes the step {q.derive(lambda t: t[speedup].min(), '.2f', 'least bf16 speed-up')}–"
                 f"{q.derive(lambda t: t[speedup].max(), '.2f', 'largest bf16 speed-up')}× faster: "
                 f"{q.cell(speedup, ran.index[0])}× at {ran['size'][ran.index[0]]} and "
                 f"{q.cell(speedup, ran.index[-1])}× at {ran['size'][ran.index[-1]]}; the speed-up "
                 f"{size_trend(ran[speedup])}.")
        if size_trend(ran[speedup]) == "grows with size":
            text += " The larger the model, the more of its step is matrix multiplication, which bf16 runs on Tensor Cores."
    ooms = frame[frame["status"] == "oom"]
    if len(ooms):
        text += " Out of memory: " + ", ".join(f"{r['size']} {r['precision']}" for _, r in ooms.iterrows()) + "."
    settings = tuple(str(int(frame[c].iloc[0])) for c in ("batch_size", "context_length"))
    return Section([text, ctx.table("mixed_precision_2026")], q.table, [text], q.derived, wording=(*settings, "2026", "16"))


E2E_2026 = Table("e2e_timing_2026", "e2e_2026", e2e_timing_2026,
                 "2026 §2.1.3 (b): phase times per 2026 size (ms, mean ± std), fp32")
MIXED_2026 = Table("mixed_precision_2026", "mixed_precision_2026", mixed_precision,
                   "2026 §2.1.5 (c): fp32 versus bf16 forward and backward per 2026 size (ms, mean ± std)")

DELIVERABLES = [
    Deliverable("1.1.3 (a) benchmarking_script: the benchmarking script", "e2e_timing",
                lambda ctx: "`python -m cs336_systems.bench.e2e --help` (module `cs336_systems/bench/e2e.py`)."),
    Deliverable("1.1.3 (b) forward and backward timings for every model size", "e2e_timing", render_e2e, ("e2e",),
                tables=(E2E,), figures=(Figure("e2e_timing", "e2e", figures.e2e_timing),)),
    Deliverable("1.1.3 (c) the effect of 0, 1 and 2 warm-up steps", "e2e_warmup", render_warmup, ("e2e_warmup",),
                tables=(WARMUP,), figures=(Figure("e2e_warmup", "e2e_warmup", figures.e2e_warmup),)),
    Deliverable("1.1.5 mixed_precision_accumulation", "mixed_precision", render_accumulation, ("mixed_precision",)),
    Deliverable("1.1.5 (a–b) benchmarking_mixed_precision: ToyModel dtypes and layer norm", "mixed_precision",
                render_toy_dtypes, ("mixed_precision",)),
    Deliverable("1.1.5 (c) fp32 versus bf16 timings for every model size", "e2e_timing", render_mixed_precision,
                ("e2e",), tables=(MIXED,)),
    Deliverable("1.1.5 (c), continued: kernel time against wall time of eager bf16 steps", "profile_bf16",
                render_host_bound, ("profile_bf16",), tables=(HOST_BOUND,)),
    Deliverable("1.3.1 (b) torch_compile: compiled versus vanilla Transformer", "compile_timing", render_compile,
                ("e2e_compile",), tables=(COMPILE,),
                figures=(Figure("compile_timing", "e2e_compile", figures.compile_timing),)),
    Deliverable("1.3.1 (b), continued: our model against a plain-PyTorch baseline in the same run", "e2e_baseline",
                render_baseline, ("e2e_baseline",), tables=(BASELINE,)),
    Deliverable("1.3.1 (b), continued: the optimizer step (our AdamW, multi-tensor and fused, and torch's)",
                "optimizer_timing", render_optimizer, ("optimizer",), tables=(OPTIMIZER,)),
    Deliverable("2026 §2.1.3 (b) benchmarking_script: forward, backward and optimizer step, 2026 Table 1 sizes",
                "e2e_timing_2026", render_e2e_2026, ("e2e_2026",), tables=(E2E_2026,)),
    Deliverable("2026 §2.1.5 (c) benchmarking_mixed_precision: fp32 versus bf16, 2026 Table 1 sizes (10B included)",
                "mixed_precision_2026", render_mixed_precision_2026, ("mixed_precision_2026",), tables=(MIXED_2026,)),
]
