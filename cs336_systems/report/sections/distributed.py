"""Handout 2.1–2.4 and the 2026 handout's sections 7 and 8 (workflow/rules/distributed.smk): all-reduce,
naive, flat, overlapped and bucketed DDP, their profiler traces and the communication accounting; our FSDP
against torch's FSDP2, its model-state accounting and exposed communication; the analysis of parallelism
strategies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from cs336_systems.analysis.ddp import allreduce_burst_cost, allreduce_cost
from cs336_systems.report import figures, tables
from cs336_systems.report.appendix import appendix, appendix_parts
from cs336_systems.report.ddp_analysis import (RERUN_NAMED, TIMING_NOTE, bucket_counts, bucket_model,
                                               fp32_overlap_causes, gradient_tensors, rounds_paragraph,
                                               setup_as_in_naive, timing_method, timing_note)
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import (Context, Deliverable, Figure, Quotes, Section, Table, column_values,
                                          shared_cell)
from cs336_systems.report.sections.leaderboard import NUMBER
from cs336_systems.report.tables import ALLREDUCE_SIZE as SIZE
from cs336_systems.report.tables import DDP_STEP

if TYPE_CHECKING:  # the report's table and figure jobs run without torch; distributed/ needs it
    from cs336_systems.distributed.parallelize import DataParallelSpec


def render_allreduce(ctx: Context) -> Section:
    table = ctx.numeric("allreduce")
    data = table.data  # a RangeIndex: a row's label is its position in the table

    def cell(header: str, row: int) -> str:
        return table.quote(header, row)

    largest = data[data[SIZE] == data[SIZE].max()]
    parts = []
    for backend, rows in largest.groupby("backend"):
        rows = rows.sort_values("processes")
        parts.append(f"{backend}: {cell(SIZE, rows.index[0])} MiB all-reduced in "
                     + ", ".join(f"{cell('median (ms)', i)} ms with {cell('processes', i)} processes "
                                 f"({cell('busbw (GB/s)', i)} GB/s bus bandwidth)" for i in rows.index))
    smallest = data[data[SIZE] == data[SIZE].min()]
    checked = ["Times are medians over the timed iterations (table and figure); sizes are MiB (2²⁰ bytes, as the "
               "bench allocates them), bandwidths GB/s (10⁹ bytes per second). " + "; ".join(parts) + ".", (
        "At the smallest size the time is latency: "
        + ", ".join(f"{data.at[i, 'backend']} × {cell('processes', i)}: {cell('median (ms)', i)} ms"
                    for i in smallest.index)
        + ". Large messages are bandwidth-bound: bus bandwidth (what each link carries in a ring, "
        "2(n−1)/n of the data) is the figure to compare across process counts.")]
    gaps = missing_world_sizes(data)
    if gaps:
        checked.append(gaps)
    return Section([*checked, ctx.table("allreduce"), ctx.figure("allreduce", "all-reduce")], table, checked,
                   wording=("2", "1"))


def missing_world_sizes(table: pd.DataFrame) -> str:
    """The gap: process counts measured with some backend but not with NCCL, and the command that fills it."""
    by_backend = {b: set(rows["processes"]) for b, rows in table.groupby("backend")}
    wanted = set().union(*by_backend.values()) - by_backend.get("nccl", set())
    if not wanted:
        return ""
    counts = sorted(int(n) for n in wanted)
    names = " and ".join(str(n) for n in counts)
    return (f"Gap: NCCL with {names} processes is not measured (no machine with that many GPUs was lent). To fill it "
            f"on a node with {max(counts)} GPUs: set `allreduce.nccl_world_sizes` in config.yaml to "
            f"`{[int(n) for n in sorted(by_backend.get('nccl', set()) | wanted)]}` and run "
            f"`snakemake results/allreduce.csv --forcerun allreduce --cores 1 --resources gpu={max(counts)}`.")


def ddp_specs(frame: pd.DataFrame) -> dict[str, DataParallelSpec]:
    """Each config of a DDP results file as the spec its rows' dp_kind, bucket_mb and optimizer_sharding
    columns hold (the benchmark writes them from the spec it parsed: DataParallelSpec.to_columns)."""
    from cs336_systems.distributed.parallelize import DataParallelSpec

    specs = {}
    for row in frame.drop_duplicates("config").itertuples():
        bucket = None if pd.isna(row.bucket_mb) else float(row.bucket_mb)
        sharding = "none" if pd.isna(row.optimizer_sharding) else row.optimizer_sharding
        specs[row.config] = DataParallelSpec(row.dp_kind, bucket, sharding)
    return specs


def _ddp_steps(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == "ok"].set_index(["precision", "config"])


def _measured(table: NumericTable, precision: str, config: str) -> bool:
    """Whether the config ran (its step is a number, not a status such as OOM)."""
    return table.has(precision=precision, config=config) and pd.notna(
        table.value(DDP_STEP, precision=precision, config=config))


def _ddp_summary(frame: pd.DataFrame, table: NumericTable, configs: list[str], ctx: Context | None = None) -> list[str]:
    """The setup paragraph (from the rows' arguments), then one line per precision quoting the table's
    mean steps, communication waits and step-to-step deviations."""
    rounds = int(frame["rounds"].max()) if "rounds" in frame and frame["rounds"].notna().any() else 1
    lines = []
    for precision in sorted(set(frame["precision"])):
        cells = [f"{config} {table.quote(DDP_STEP, precision=precision, config=config)} ms (communication wait "
                 f"{table.quote('communication wait (ms)', precision=precision, config=config)} ms)"
                 for config in configs if _measured(table, precision, config)]
        ran = [i for i in range(len(table)) if table.data.at[i, "precision"] == precision
               and pd.notna(table.value(DDP_STEP, i))]
        if ran:
            widest = max(ran, key=lambda i: table.data.at[i, "step std (ms)"])
            cells_text = "; ".join(cells) + (f". Step-to-step standard deviation up to "
                                             f"{table.quote_second(DDP_STEP, widest)} ms.")
            lines.append(f"{precision}: " + cells_text)
    first = frame.iloc[0]
    repeats = (f"{rounds} interleaved rounds (every config once per round) of {first['warmup']} warm-up and "
               f"{first['steps']} measured steps; every time is a mean over all measured steps of all rounds"
               if rounds > 1 else
               f"{first['warmup']} warm-up and {first['steps']} measured steps; every time is a mean")
    repeats += (" (the step's with its standard deviation): the parts are means too, so forward+backward, "
                "communication wait and optimizer add up to the step, in the table, its figure and the text")
    baselines = [c for c in ("none", "torch_ddp") if c in set(frame["config"])]
    setup = (ctx and setup_as_in_naive(ctx, frame)) or (
             f"Setup: {first['world_size']} ranks ({first['backend']}), model {first['size']}"
             f"{_ddp_compile_and_adamw(first)}, batch {first['batch_per_rank']} per rank, context "
             f"{first['context_length']}, {repeats}. "
             f"'Communication wait' is the time from the end of backward until the gradients are synchronised "
             f"(torch DDP synchronises inside backward, so its wait is part of its forward+backward time). "
             f"{timing_method(frame)} The baselines of this table ({', '.join(baselines) or 'none'}) ran in the "
             f"same run, interleaved with the other configs, and the text compares configs only within this table.")
    return [setup, *lines]


# How the DDP rows' `adamw` column reads in the text (rows measured before the column existed used `foreach`).
ADAMW_WORDS = {"foreach": "our multi-tensor AdamW", "fused": "our AdamW with one Triton kernel per tensor",
               "torch_fused": "torch's fused AdamW"}


def _ddp_compile_and_adamw(row: pd.Series) -> str:
    compiled = row.get("compile", "none")
    adamw = row.get("adamw", "foreach")
    adamw = "foreach" if pd.isna(adamw) else adamw
    blocks = (" with each Transformer block compiled (torch.compile)" if compiled == "blocks"
              else " (eager, not compiled)")
    return f"{blocks}, every optimizer (plain, sharded, ZeRO) updating with {ADAMW_WORDS[adamw]}"



def render_ddp_naive(ctx: Context) -> Section:
    frame = ctx.frame("ddp_naive")
    table = ctx.numeric("ddp_naive")
    parts = _ddp_summary(frame, table, ["none", "naive", "flat", "torch_ddp"])
    checked = parts[1:]
    parts += appendix_parts(TIMING_NOTE, [timing_note(frame)])
    cost = allreduce_cost(ctx.frame("allreduce"))
    ok = frame[frame["status"] == "ok"]
    if cost is not None and len(ok):
        o, w = cost
        grad_bytes, tensors = ok["grad_mib"].iloc[0] * 2**20, gradient_tensors(ok["size"].iloc[0])
        waits = "; ".join(
            f"{p}: naive {table.quote('communication wait (ms)', precision=p, config='naive')} ms, flat "
            f"{table.quote('communication wait (ms)', precision=p, config='flat')} ms"
            for p in sorted(set(ok["precision"])) if _measured(table, p, "naive") and _measured(table, p, "flat"))
        text = (
            f"The gradients are {tensors} tensors, {grad_bytes / 2**30:.2f} GiB in float32. The all-reduce times of "
            f"2.1 fit t = o + bytes/w with o = {o * 1e6:.0f} µs and w = {w / 1e9:.0f} GB/s: one all-reduce of all "
            f"gradients should take {(o + grad_bytes / w) * 1e3:.1f} ms, and {tensors} separate ones "
            f"{(tensors * o + grad_bytes / w) * 1e3:.1f} ms if each paid o in full. Measured waits: {waits}. "
            f"Flat DDP also copies every gradient into one buffer and back, which the prediction leaves out.")
        burst = allreduce_burst_cost(ctx.frame("allreduce"))
        if burst is None:
            text += (" Each call's o was timed alone (latency included); naive DDP issues its all-reduces back to back, "
                     "so consecutive calls overlap their latency and the prediction overstates: the per-call cost of "
                     "a burst of back-to-back all-reduces is pending (`snakemake results/allreduce.csv --forcerun allreduce "
                     "--cores 1 --resources gpu=2`, burst rows).")
        else:
            ob, wb = burst
            text += (f" Fitted instead to bursts of back-to-back all-reduces (time per call, as naive DDP issues them): "
                     f"o = {ob * 1e6:.1f} µs, w = {wb / 1e9:.0f} GB/s, so {tensors} calls should take "
                     f"{(tensors * ob + grad_bytes / wb) * 1e3:.1f} ms.")
        parts += appendix_parts("naive_ddp_benchmarking: the wait the all-reduce fit of 2.1 predicts", [text])
    q = Quotes(table)
    shares = {p: table.value("comm share", precision=p, config="naive") for p in sorted(set(ok["precision"]))
              if _measured(table, p, "naive")}
    if shares:
        text = "Communication is " + ", ".join(
            f"{table.quote('comm share', precision=p, config='naive')} of naive DDP's mean step in {p}" for p in shares)
        if shares.get("bf16", 0) > shares.get("fp32", 1):
            text += (": the faster the computation, the larger the share of the step that waits for gradients, "
                     "and the more overlapping communication with backward (2.3) could hide")
        parts.append(text + "." + overlap_in_this_table(table, q, max(shares, key=shares.get)))
        checked.append(parts[-1])
    hidden = fp32_overlap_question(table, q)
    if hidden:
        parts += [hidden, appendix("why torch DDP hides almost nothing in fp32", fp32_overlap_causes())]
        checked.append(hidden)
    parts += appendix_parts("naive_ddp_benchmarking: how many rounds", [rounds_paragraph(ctx, frame)])
    return Section([*parts, ctx.table("ddp_naive")], table, checked, q.derived, wording=("2.3",))


def overlap_in_this_table(table: NumericTable, q: Quotes, precision: str) -> str:
    """Whether torch DDP, which overlaps its all-reduces with backward, hid naive DDP's wait in this table: how
    much longer its forward+backward is than none's (its wait is inside it), against naive's wait."""
    if not all(_measured(table, precision, c) for c in ("none", "naive", "torch_ddp")):
        return ""
    fb, wait = "forward+backward (ms)", "communication wait (ms)"

    def extra(t: pd.DataFrame) -> float:
        return _cell(t, precision, "torch_ddp", fb) - _cell(t, precision, "none", fb)

    added = extra(q.frame)
    naive_wait = table.value(wait, precision=precision, config="naive")
    torch_step, naive_step = (table.quote(DDP_STEP, precision=precision, config=c) for c in ("torch_ddp", "naive"))
    text = (f" In this table torch DDP, which overlaps, takes {torch_step} ms per {precision} step against naive's "
            f"{naive_step} ms, "
            f"and its forward+backward (which holds its communication) is "
            f"{q.derive(extra, '.1f', f'{precision} torch DDP forward+backward over none')} ms longer than none's, "
            f"against naive's wait of {table.quote(wait, precision=precision, config='naive')} ms: ")
    if added >= naive_wait / 2:
        return text + ("overlapping hid at most half of that wait here. Whether the rest is a slower backward or "
                       "all-reduces still running when backward ends is what the traces of 2.3 (b) and the rerun of "
                       "the timing note (appendix) tell apart.")
    return text + "overlapping hid most of that wait here."


def _cell(table: pd.DataFrame, precision: str, config: str, column: str) -> float:
    return column_values(table, column, lambda t: (t["precision"] == precision) & (t["config"] == config)).iloc[0]


def fp32_overlap_question(table: NumericTable, q: Quotes) -> str:
    """Why torch DDP hides (almost) no communication in fp32: the numbers of this run, the candidate
    explanations, and which measurement tells them apart."""
    if not all(_measured(table, "fp32", c) for c in ("none", "naive", "torch_ddp")):
        return ""
    fb = "forward+backward (ms)"
    extra = q.derive(lambda t: _cell(t, "fp32", "torch_ddp", fb) - _cell(t, "fp32", "none", fb), ".1f",
                     "fp32 torch DDP's forward+backward over none's")

    def cell(config: str, column: str = DDP_STEP) -> str:
        return table.quote(column, precision="fp32", config=config)

    return (
        f"Why does torch DDP hide almost nothing in fp32? Its mean step takes {cell('torch_ddp')} ms "
        f"against naive DDP's {cell('naive')} ms (which overlaps nothing) and "
        f"{cell('none')} ms without communication; its forward+backward is {extra} ms longer "
        f"than none's, about naive's communication wait ({cell('naive', 'communication wait (ms)')} "
        f"ms), although the backward is long enough to hide it; which of four candidate causes it is waits for "
        f"{RERUN_NAMED}.")


def render_ddp_individual(ctx: Context) -> Section:
    frame = ctx.frame("ddp_individual")
    table = ctx.numeric("ddp_individual")
    q = Quotes(table)

    def over_torch(precision: str, config: str):
        return q.derive(lambda t: _cell(t, precision, config, DDP_STEP) / _cell(t, precision, "torch_ddp", DDP_STEP),
                        ".2f", f"{precision} {config} over torch DDP (means)")

    parts = _ddp_summary(frame, table, ["individual", "naive", "torch_ddp"], ctx)
    checked, other_ways = parts[1:], []
    for precision in sorted(set(frame["precision"])):
        if not all(_measured(table, precision, c) for c in ("individual", "naive", "torch_ddp")):
            continue
        ours, naive = ({column: table.quote(column, precision=precision, config=c) for column in
                        ("communication wait (ms)", "forward+backward (ms)")} for c in ("individual", "naive"))
        change = q.derive(lambda t, p=precision: _cell(t, p, "individual", "forward+backward (ms)")
                          - _cell(t, p, "naive", "forward+backward (ms)"), "+.1f", f"{precision} overlap's change")
        checked.append(
            f"{precision}: overlapped-individual takes {over_torch(precision, 'individual')}× "
            f"torch DDP's mean step. Its communication wait is {ours['communication wait (ms)']} ms against naive's "
            f"{naive['communication wait (ms)']} ms, but its forward+backward takes "
            f"{ours['forward+backward (ms)']} ms against naive's {naive['forward+backward (ms)']} ms (which "
            f"communicates nothing during backward): overlapping one all-reduce per gradient with the backward pass "
            f"changes it by {change} ms" + ("." if "timer" in frame else
                                            " (in these rows forward+backward also holds the communication still "
                                            "running when backward ended, so this is not yet the cost of overlapping "
                                            "alone: see naive DDP's timing note in the appendix).")
            )
        variants = [(c, label) for c, label in VARIANTS_OF_INDIVIDUAL if _measured(table, precision, c)]
        if variants:  # the same all-reduces issued other ways, for the appendix
            other_ways.append(f"{precision}, in the same run: " + "; ".join(
                f"{label}: step {table.quote(DDP_STEP, precision=precision, config=c)} ms "
                f"({over_torch(precision, c)}× torch DDP's), forward+backward "
                f"{table.quote('forward+backward (ms)', precision=precision, config=c)} ms" for c, label in variants)
                + ".")
    waiting = [] if "timer" in frame else [
        "What the rerun with compute-stream events will tell (it replaces the conclusions above on overlap): for "
        "each variant, forward+backward as the compute stream ran it and the exposed wait after it, beside `none` "
        "of the same run. If overlapping hides the communication, individual's forward+backward stays near none's "
        "and its wait is only the last gradients' all-reduces; if the all-reduces slow the backward (SMs and memory "
        "bandwidth shared with NCCL, or the host's time per collective call in a host-bound step), forward+backward "
        "grows by about the communication time; if they are queued behind each other, the wait grows instead. The "
        "traces of 2.3(b) (compute-kernel time in backward, exposed communication, host time per collective) say "
        "which of the causes it is."]
    waiting = [appendix("ddp_overlap_individual_parameters: what the rerun will tell", text) for text in waiting]
    variants = appendix_parts("ddp_overlap_individual_parameters: the same all-reduces issued other ways",
                              other_ways) if other_ways else []
    return Section([parts[0], *checked, *variants, *waiting, ctx.table("ddp_individual")], table,
                   [*checked, *other_ways], q.derived,
                   wording=("1",))  # torch DDP's 1 MiB buckets, named in a variant's label


# Configs that tell where overlapped-individual's time goes: the same all-reduces issued from another
# thread, and torch's C++ reducer at (about) the same granularity.
VARIANTS_OF_INDIVIDUAL = (
    ("individual-thread", "the same all-reduces issued from a worker thread instead of by each gradient hook "
                          "on autograd's thread (individual-thread)"),
    ("torch_ddp:1", "torch DDP with 1 MiB buckets, its C++ reducer issuing about one all-reduce per gradient "
                    "(torch_ddp:1)"),
)



def render_ddp_bucketed(ctx: Context) -> Section:
    frame = ctx.frame("ddp_bucketed")
    table = ctx.numeric("ddp_bucketed")
    q = Quotes(table)
    configs = list(dict.fromkeys(frame["config"]))
    ok = frame[frame["status"] == "ok"]
    model_bytes = ok["grad_mib"].iloc[0] * 2**20 if len(ok) else 0.0
    parts = _ddp_summary(frame, table, configs, ctx)
    checked = parts[1:]
    ranges = _ddp_steps(frame)[["step_round_median_min_ms", "step_round_median_max_ms"]]

    # One statistic throughout, the table's: the mean step time.
    def means(t: pd.DataFrame) -> pd.Series:
        return column_values(t, DDP_STEP).set_axis(pd.MultiIndex.from_frame(t[["precision", "config"]]))

    steps = means(q.frame).dropna()
    best_mb = {}
    specs = ddp_specs(frame)
    for precision in sorted(set(frame["precision"])):
        bucketed = {c: steps[(precision, c)] for c in configs
                    if c in specs and specs[c].kind == "bucketed" and (precision, c) in steps}
        if bucketed and (precision, "torch_ddp") in steps:
            best = min(bucketed, key=bucketed.get)
            best_mb[precision] = specs[best].bucket_mb
            ratio = q.derive(lambda t, p=precision, b=best: means(t)[(p, b)] / means(t)[(p, "torch_ddp")],
                             ".2f", f"{precision} best bucketed over torch DDP (means)")
            text = (f"{precision}: the best bucket size is {best_mb[precision]:g} MiB, its mean step "
                    f"{ratio}× torch DDP's.")
            a, b = ranges.loc[(precision, best)], ranges.loc[(precision, "torch_ddp")]
            if frame["rounds"].max() > 1 and not (a.iloc[0] > b.iloc[1] or a.iloc[1] < b.iloc[0]):
                # the rounds' spread, from the results rows: a noise check, not a number of the table
                text += " Their step times overlap from round to round: this run does not separate them."
            parts.append(text)
            checked.append(text)
    expectation, counts = small_buckets_paragraph(frame, table, q, specs)
    if expectation:
        parts.append(expectation)
        checked.append(expectation)
    parts.append(appendix("ddp_bucketed_benchmarking: the bucket-size model",
                          bucket_model(ctx.frame("allreduce"), model_bytes, best_mb)))
    # the bucket counts are the model's (plan_buckets on its parameter shapes), not measurements
    return Section([*parts, ctx.table("ddp_bucketed"), ctx.figure("ddp_bucketed", "buckets")], table, checked,
                   q.derived, wording=tuple(str(n) for n in counts))


def small_buckets_paragraph(frame: pd.DataFrame, table: NumericTable, q: Quotes,
                            specs: dict[str, DataParallelSpec]) -> tuple[str, list[int]]:
    """2.3 bucketed (a): the results against expectations, for bf16, where the bucket size matters; and
    the bucket counts it quotes."""
    have = {(p, c) for p, c in zip(table.data["precision"], table.data["config"]) if _measured(table, p, c)}
    sized = sorted((specs[c].bucket_mb, c) for p, c in have if p == "bf16" and specs[c].kind == "bucketed")
    if len(sized) < 2:
        return "", []
    (large_mb, large) = sized[-1]
    smalls = sized[:2] if len(sized) > 2 else sized[:1]  # the two smallest sizes (the handout's 1 and 10 MB)
    small_mb, small = smalls[0]
    step, fb = DDP_STEP, "forward+backward (ms)"
    counts = bucket_counts(frame["size"].iloc[0], [mb for mb, _ in smalls] + [large_mb])

    def slower(config: str, column: str) -> str:
        return q.derive(lambda t: _cell(t, "bf16", config, column) - _cell(t, "bf16", large, column), "+.1f",
                        f"bf16 {config} over {large}, {column}")

    measured = " and ".join(f"{c} {table.quote(step, precision='bf16', config=c)} ms (step {slower(c, step)} ms, "
                            f"forward+backward {slower(c, fb)} ms)" for _, c in smalls)
    text = ("Expectations against results (bf16): smaller buckets start communicating earlier in backward, so "
            "less is left after it, but cost one call each; if each call costs only its o of the bucket-size model "
            "(appendix) and "
            "the GPU is free to overlap, "
            + " or ".join(f"{counts[mb]} buckets of {mb:g} MiB" for mb, _ in smalls)
            + f" should cost little more than {counts[large_mb]} of {large_mb:g} MiB (the model below). Measured "
            f"against {large}'s {table.quote(step, precision='bf16', config=large)} ms: {measured}. The cost is on the host: "
            f"the bf16 step is limited by the CPU issuing kernels (earlier traces: the GPU busy in well under half "
            f"of the backward range), and each bucket adds host work on autograd's thread: a copy of each gradient "
            f"into the bucket's buffer, the buffer's allocation (buckets let go of it after each step) and the "
            f"collective call itself, which in a host-bound backward delays every kernel after it.")
    if ("bf16", "individual") in have:
        versus = q.derive(lambda t: _cell(t, "bf16", small, step) - _cell(t, "bf16", "individual", step), "+.1f",
                          f"bf16 {small} against per-parameter")
        text += (f" Against per-parameter all-reduces in the same run (individual, "
                 f"{table.quote(step, precision='bf16', config='individual')} ms, the same number of calls but no copies): "
                 f"{versus} ms.")
    else:
        text += (" The comparison with per-parameter all-reduces (no copies, about as many calls) needs both in one "
                 f"run: pending ({RERUN_NAMED}, the bucket sweep now includes `individual`), with the trace's host time "
                 f"per collective for bucketed:1 against individual.")
    return text, list(counts.values())


def render_traces(ctx: Context) -> str:
    frame = ctx.frame("ddp_overlap")
    parts = ["Each figure is drawn from a PyTorch-profiler trace of one training step on rank 0 (the handout asks "
             "for Nsight screenshots; Nsight Systems cannot make reports on our machines): the backward range, "
             "compute work and gradient communication on one time axis. The trace's own measure of exposed "
             "communication is the communication time during which no compute kernel runs; the bench's is the "
             "compute stream's wait for the gradients after backward (2.2, 2.3 tables)."]
    for _, row in frame.iterrows():
        host = ""
        if "collectives_in_backward" in row and pd.notna(row["collectives_in_backward"]):
            busy = (f"GPU kernels cover {row['gpu_busy_in_backward']:.0%} of the {row['backward_ms']:.1f} ms "
                    f"backward range." if pd.notna(row["gpu_busy_in_backward"])
                    else f"the backward range takes {row['backward_ms']:.1f} ms.")
            if row["collectives_in_backward"] == 0 and row["overlap_with_backward"] > 0:
                # communication kernels ran during backward, so some thread issued them unseen
                host = (" No collective call appears on the threads this trace records (they were issued from a "
                        f"worker thread the profiler did not record) although its kernels ran during backward; {busy}")
            else:
                host = (f" The host launched {int(row['collectives_in_backward'])} collectives during the backward "
                        f"range and spent {row['host_collective_ms_in_backward']:.1f} ms inside those calls; {busy}")
        exposed = ""
        if "exposed_communication_ms" in row and pd.notna(row["exposed_communication_ms"]):
            exposed = (f" Exposed (no compute kernel running): {row['exposed_communication_ms']:.1f} ms in the step, "
                       f"{row['exposed_in_backward_ms']:.1f} ms of it in backward.")
        if "compute_kernel_ms_in_backward" in row and pd.notna(row["compute_kernel_ms_in_backward"]):
            exposed += (f" Compute kernels in backward sum to {row['compute_kernel_ms_in_backward']:.1f} ms; "
                        f"{row['comm_after_backward_ms']:.1f} ms of communication runs after backward.")
        if row["communication_ms"] == 0:
            parts.append(f"`{row['trace']}`: no communication (the compute baseline).{host}")
        else:
            parts.append(f"`{row['trace']}`: {row['communication_ms']:.1f} ms of communication, "
                         f"{row['overlap_with_backward']:.0%} of it during the backward pass.{exposed}{host}")
        parts.append(ctx.figure(f"ddp_traces/{row['trace']}", row["trace"]))
    if "compute_kernel_ms_in_backward" not in frame:
        parts.append("These traces predate the per-variant columns (exposed communication, compute-kernel time in "
                     "backward, communication after backward, host time per collective) and cover only naive and "
                     "individual in bf16; traces of none, naive, individual, bucketed (1 and 500 MiB) and torch DDP in "
                     f"bf16 and fp32, which answer 2.2's fp32 question, are pending: {RERUN_NAMED}.")
    return "\n\n".join(parts)


def render_accounting(ctx: Context) -> str:
    path = ctx.results / "communication_accounting.md"
    return path.read_text() if path.exists() else "pending: rule `communication_accounting`\n"


# ---- 2026 §7: FSDP ------------------------------------------------------------------------------------
FSDP_MS = {"step (ms, mean)": "step_ms", "forward+backward (ms)": "forward_backward_ms",
           "communication wait (ms)": "communication_ms", "optimizer (ms)": "optimizer_ms"}
# memory: what is allocated once the model is built and wrapped, and each phase's own peak (init included)
FSDP_MIB = {"allocated after init (MiB)": "mem_after_init_mib", "peak during init (MiB)": "peak_after_init_mib",
            "peak fwd+bwd (MiB)": "peak_before_step_mib", "peak optimizer step (MiB)": "peak_after_step_mib"}


FSDP_SETTINGS = {"world_size": "ranks", "batch_per_rank": "batch per rank", "context_length": "context"}


def fsdp_table(frame: pd.DataFrame) -> NumericTable:
    """Per size, precision and wrapper: the step and its parts (means, as the DDP tables: the parts add up
    to the step) and each phase's peak memory."""
    rows = frame.sort_values(["size", "precision", "config"])
    ok = rows["status"].eq("ok")
    data = pd.DataFrame({"size": rows["size"], "precision": rows["precision"], "config": rows["config"],
                         "status": rows["status"],
                         **{label: rows[column].where(ok) for label, column in {**FSDP_MS, **FSDP_MIB}.items()},
                         # the run's setting, which the prose states from these cells
                         **{label: rows[column] for column, label in FSDP_SETTINGS.items()}})
    return NumericTable(data, (Col("size"), Col("precision"), Col("config"), Col("status"),
                               *(Col(c, ".1f") for c in FSDP_MS), *(Col(c, ",.0f") for c in FSDP_MIB),
                               *(Col(c, "d") for c in FSDP_SETTINGS.values())))


def render_fsdp(ctx: Context) -> Section:
    frame = ctx.frame("fsdp")
    table = ctx.numeric("fsdp")
    q = Quotes(table)
    first = frame.iloc[0]
    said = {h: shared_cell(table, h) for h in FSDP_SETTINGS.values()}
    setting = (f"{said['ranks']} ranks, batch {said['batch per rank']} per rank, context {said['context']}"
               if None not in said.values() else "each row's ranks, batch per rank and context (the table's columns)")
    intro = (f"Answers the 2026 handout, section 7 (fsdp). `cs336_systems.distributed.FSDP` against torch's FSDP2 "
             f"(`fully_shard` per block, same mixed-precision policy), our bucketed DDP and our ZeRO-1 in one run per "
             f"size: {setting}, {first['backend']}, {first['adamw']} AdamW, eager, on {first['device_name']}. "
             "Times are means over the measured steps (the parts add up to the step); peaks are each phase's own "
             "(the peak counter is reset before forward+backward and before the step).")
    step, peaks = "step (ms, mean)", ("peak fwd+bwd (MiB)", "peak optimizer step (MiB)")
    t = q.frame
    checked = []
    for size, precision in dict.fromkeys(zip(t["size"], t["precision"])):
        keys = {"size": size, "precision": precision}
        if not all(table.has(**keys, config=c) and pd.notna(table.value(step, **keys, config=c))
                   for c in ("fsdp", "torch_fsdp2")):
            continue

        def peak(config: str) -> str:  # the larger of the phase peaks, as its cell prints it
            return table.quote(max(peaks, key=lambda h: table.value(h, **keys, config=config)), **keys, config=config)

        ratio = q.derive(lambda t, k=keys: _fsdp_cell(t, k, "fsdp", step) / _fsdp_cell(t, k, "torch_fsdp2", step),
                         ".2f", f"{size} {precision} ours over FSDP2")
        measured = all(pd.notna(table.value(h, **keys, config=c)) for h in peaks for c in ("fsdp", "torch_fsdp2"))
        memory = (f"peak {peak('fsdp')} MiB against {peak('torch_fsdp2')} MiB; {_allocated_after_init(table, keys)}"
                  if measured else "memory is measured on CUDA only")
        checked.append(f"{size}, {precision}: ours {table.quote(step, **keys, config='fsdp')} ms per step against "
                       f"torch FSDP2's {table.quote(step, **keys, config='torch_fsdp2')} ms ({ratio}×); {memory}.")
    # the handout's numbering, ZeRO-1's stage and the device's name (a CPU's names its cores) are words of the
    # sentence
    return Section([intro, *checked, ctx.table("fsdp")], table, [intro, *checked], q.derived,
                   wording=("2026", "7", "1", *NUMBER.findall(str(first["device_name"]))))


def _allocated_after_init(table: NumericTable, keys: dict) -> str:
    """What each wrapper holds once built (the table's 'allocated after init'), the unsharded DDP beside FSDP."""
    init = "allocated after init (MiB)"
    configs = [c for c in ("fsdp", "torch_fsdp2") if table.has(**keys, config=c)]
    configs += [c for c in table.data.loc[(table.data["size"] == keys["size"])
                                          & (table.data["precision"] == keys["precision"]), "config"]
                if c not in configs and "+" not in c]  # DDP without optimizer-state sharding
    names = {"fsdp": "ours", "torch_fsdp2": "FSDP2"}
    return "allocated after init " + ", ".join(
        f"{table.quote(init, **keys, config=c)} MiB ({names.get(c, c)})" for c in configs
        if pd.notna(table.value(init, **keys, config=c)))


def _fsdp_cell(t: pd.DataFrame, keys: dict, config: str, column: str) -> float:
    chosen = t[(t["size"] == keys["size"]) & (t["precision"] == keys["precision"]) & (t["config"] == config)]
    return float(chosen[column].iloc[0])


# parallelism_render imports sympy (~0.8 s), which only these three functions need: imported in them, so that the
# report's other table and figure jobs do not pay it
def fsdp_accounting_table(frame: pd.DataFrame) -> NumericTable:
    from cs336_systems.report.parallelism_render import fsdp_accounting_of_runs

    return fsdp_accounting_of_runs(frame)


def render_fsdp_accounting_section(ctx: Context) -> Section:
    from cs336_systems.report.parallelism_render import fsdp_accounting_section

    return fsdp_accounting_section(ctx.numeric("fsdp_accounting"), ctx.frame("sharding"), ctx.table("fsdp_accounting"))


# the overlap table's columns: what report/traces.py writes per trace (ms of kernel time on rank 0's GPU, and the
# share of the backward range in which some GPU kernel ran)
FSDP_OVERLAP = {"communication (ms)": "communication_ms", "exposed in forward (ms)": "exposed_in_forward_ms",
                "exposed in backward (ms)": "exposed_in_backward_ms",
                "exposed in step (ms)": "exposed_communication_ms"}
FSDP_BUSY = {"backward (ms)": "backward_ms", "GPU busy in backward": "gpu_busy_in_backward"}
# A backward in which the GPU runs kernels less than this share of the time is host-bound: the GPU mostly waits for
# the host to launch work, so communication with no compute kernel beside it is not time the compute waited for.
HOST_BOUND_BUSY = 0.5


def fsdp_overlap_table(frame: pd.DataFrame) -> NumericTable:
    """One row per traced wrapper: its communication kernels' time and the part of it during which no compute
    kernel ran (exposed), in the forward, in the backward and over the whole step; the backward range and the
    share of it in which the GPU ran any kernel (which says whether exposed time is time the compute waited)."""
    rows = frame.sort_values("trace")
    data = pd.DataFrame({"trace": rows["trace"],
                         **{label: rows[column] for label, column in {**FSDP_OVERLAP, **FSDP_BUSY}.items()}})
    return NumericTable(data, (Col("trace"), *(Col(c, ".1f") for c in FSDP_OVERLAP), Col("backward (ms)", ".1f"),
                               Col("GPU busy in backward", ".0%")))


def _communicates(table: NumericTable, trace: str) -> bool:
    communication = table.value("communication (ms)", trace=trace)
    return pd.notna(communication) and communication > 0


def _fsdp_overlap_line(q: Quotes, trace: str) -> str:
    """One trace's line: its cells, or that it communicated nothing (the no-data-parallelism baseline)."""
    if not _communicates(q.table, trace):
        return f"- {trace}: no communication kernels."
    forward, backward, step = (q.cell(h, trace=trace) for h in list(FSDP_OVERLAP)[1:])
    busy = ("" if pd.isna(q.table.value("GPU busy in backward", trace=trace)) else
            f"; GPU kernels run in {q.cell('GPU busy in backward', trace=trace)} of its "
            f"{q.cell('backward (ms)', trace=trace)} ms backward")
    return (f"- {trace}: {q.cell('communication (ms)', trace=trace)} ms of communication, {forward} ms exposed in "
            f"the forward, {backward} ms in the backward ({step} ms in the whole step){busy}.")


def fsdp_overlap_verdict(table: NumericTable, traces: list[str]) -> str:
    """What the exposed time measures, from each trace's GPU-busy share of the backward: time the compute waited
    for communication only where the GPU is busy; where it is mostly idle the step is host-bound."""
    busy = {t: table.value("GPU busy in backward", trace=t) for t in traces if _communicates(table, t)}
    idle = [t for t, share in busy.items() if share < HOST_BOUND_BUSY]
    busy_ones = [t for t, share in busy.items() if share >= HOST_BOUND_BUSY]

    def shares(names: list[str]) -> str:
        return " and ".join(f"{table.quote('GPU busy in backward', trace=t)} ({t})" for t in names)

    text = ""
    if idle:
        text += (f"The GPU runs kernels in only {shares(idle)} of the backward: under half, so the step is host-bound "
                 "(the GPU mostly waits for the host to launch the next kernels). A communication kernel with no "
                 "compute kernel beside it is then mostly the GPU waiting for the host, not the compute waiting for "
                 "the communication, and this measurement cannot tell how long a layer waited for its weights "
                 "(forward) or the step for its gathers and reduce-scatters (backward); the trace does not record "
                 "the forward's busy share. Measuring that wait needs a step that keeps the GPU busy.")
    if busy_ones:
        text += (" " if text else "") + (
            f"The GPU runs kernels in {shares(busy_ones)} of the backward, so there exposed communication is time the "
            "compute waited: a layer for its weights (forward), the step for its gathers and reduce-scatters "
            "(backward).")
    return text


def render_fsdp_overlap(ctx: Context) -> Section:
    table = ctx.numeric("fsdp_overlap")
    q = Quotes(table)
    intro = ("Answers the 2026 handout, section 7 (fsdp_accounting (b)): do the all-gathers finish before the "
             "forward needs them? From a PyTorch-profiler trace of one step per wrapper (`bench.ddp --trace-dir`, "
             "the first rank; Nsight Systems cannot make reports on our machines): communication kernels while no "
             "compute kernel runs are exposed.")
    traces = list(table.data["trace"])
    lines = "\n".join(_fsdp_overlap_line(q, trace) for trace in traces)
    verdict = fsdp_overlap_verdict(table, traces)
    checked = [intro, lines, *([verdict] if verdict else [])]
    figures = [ctx.figure(f"fsdp_traces/{trace}", f"trace {trace}") for trace in traces]
    # the handout's numbering is a word of the sentence
    return Section([*checked, ctx.table("fsdp_overlap"), *figures], table, checked, q.derived,
                   wording=("2026", "7"))


# ---- 2026 §8: parallelism analysis -------------------------------------------------------------------
def render_parallelism_section(ctx: Context) -> str:
    from cs336_systems.report.parallelism_render import render_parallelism  # sympy: see fsdp_accounting_table

    return render_parallelism(ctx.frame("allreduce"))


# The caption of every DDP step table: which statistic it prints (tables.ddp).
DDP_MEANS = ("Every time is a mean over the measured steps of all rounds (the step ± its standard deviation); "
             "forward+backward, communication wait and optimizer are means too, so they add up to the step, and the "
             "comm share is the mean communication wait over the mean step")


DELIVERABLES = [
    Deliverable("2.1 distributed_communication_single_node: all-reduce", "allreduce", render_allreduce,
                ("allreduce",),
                tables=(Table("allreduce", "allreduce", tables.allreduce,
                              "All-reduce of float32 tensors on one node (slowest rank per iteration); median over "
                              "the timed iterations, bandwidths from the median"),),
                figures=(Figure("allreduce", "allreduce", figures.allreduce),)),
    Deliverable("2.2 naive_ddp_benchmarking and 2.3 minimal_ddp_flat_benchmarking", "ddp_benchmark",
                render_ddp_naive, ("ddp_naive",),
                tables=(Table("ddp_naive", "ddp_naive", tables.ddp,
                              f"Naive and flat DDP versus single GPU and torch DDP. {DDP_MEANS}"),)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (a)", "ddp_benchmark", render_ddp_individual,
                ("ddp_individual",),
                tables=(Table("ddp_individual", "ddp_individual", tables.ddp,
                              f"DDP overlapping per-parameter all-reduces with backward. {DDP_MEANS}"),)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (b): profiler traces", "ddp_overlap",
                render_traces, ("ddp_overlap",)),
    Deliverable("2.3 ddp_bucketed_benchmarking (a, b)", "ddp_benchmark", render_ddp_bucketed, ("ddp_bucketed",),
                tables=(Table("ddp_bucketed", "ddp_bucketed", tables.ddp,
                              f"Bucketed DDP by bucket size, torch DDP in the same run. {DDP_MEANS}"),),
                figures=(Figure("ddp_bucketed", "ddp_bucketed", figures.ddp_bucketed,
                                also=("ddp_naive", "ddp_individual")),)),
    Deliverable("2.4 communication_accounting (a–d)", "communication_accounting", render_accounting),
    Deliverable("2026 §7 fsdp: ours against torch FSDP2, DDP and ZeRO-1", "fsdp_benchmark", render_fsdp,
                ("fsdp",),
                tables=(Table("fsdp", "fsdp", fsdp_table,
                              "FSDP step time and per-phase peak memory beside torch FSDP2, DDP and ZeRO-1"),)),
    Deliverable("2026 §7 fsdp_accounting (a)", "ddp_benchmark", render_fsdp_accounting_section, ("sharding",),
                tables=(Table("fsdp_accounting", "sharding", fsdp_accounting_table,
                              "Model state per rank under DDP, ZeRO-1 and FSDP, counted from each size's parameters "
                              "(analysis.fsdp_accounting, not measured) at the ranks of the DDP benchmark's runs "
                              "(2026 handout, 7 (a)); the provenance is those runs'"),)),
    Deliverable("2026 §7 fsdp_accounting (b): exposed communication per wrapper", "fsdp_overlap", render_fsdp_overlap,
                ("fsdp_overlap",),
                tables=(Table("fsdp_overlap", "fsdp_overlap", fsdp_overlap_table,
                              "FSDP step traces, first rank: communication kernel time and the part of it no compute "
                              "kernel overlapped (exposed), per phase"),)),
    Deliverable("2026 §8 analysing parallelism strategies (DP, FSDP, TP, 2D)", "allreduce",
                render_parallelism_section, ("allreduce",)),
]
