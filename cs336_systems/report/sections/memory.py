"""Handout 1.1.6 (workflow/rules/benchmarking.smk, rules memory_profile and memory_timelines): peak
memory of the largest model by context length and precision, what the allocator snapshots show, and
why bf16 autocast lowers neither peak.

(a)–(c) quote the table `memory_peaks` (one row per precision and context length); (d) is arithmetic on
the model's shape and (e) reads the largest-allocation rows of the forward snapshot (memory_allocations.csv).
The columns of the training step's phases and of what its forward saves for the backward come from runs
of bench/memory.py that record them; rows of an earlier run leave them out and the prose says so."""

from __future__ import annotations

import pandas as pd

from cs336_systems.model import get_config
from cs336_systems.model.accounting import parameter_count
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, column_values

WEIGHTS = "fp32 weights (MiB)"
FORWARD, TRAIN = "forward peak (MiB)", "train step peak (MiB)"
# Recorded by bench/memory.py from the training step's snapshot and a forward with saved-tensor hooks:
# header -> how it is computed from the train_step row's columns.
PHASE_COLUMNS = {
    "train: before forward (MiB)": lambda row: row["forward_start_mib"],
    "train: forward peak (MiB)": lambda row: row["forward_peak_mib"],
    "train: forward+backward peak (MiB)": lambda row: max(row["forward_peak_mib"], row["backward_peak_mib"]),
    "saved activations (MiB)": lambda row: row["saved_activations_mib"],
    "of which fp32 (MiB)": lambda row: row["saved_fp32_activations_mib"],
    "saved weight copies (MiB)": lambda row: row["saved_weight_copies_mib"],
}
RECORDED = ("forward_start_mib", "forward_peak_mib", "backward_peak_mib", "saved_activations_mib",
            "saved_fp32_activations_mib", "saved_weight_copies_mib")
PENDING = ("`snakemake results/memory.csv results/memory_allocations.csv --cores 1 --forcerun memory_profile` "
           "on one GPU")


def _mode_peaks(point: pd.DataFrame, record: dict, status: dict, index: int) -> pd.Series | None:
    """One point's forward and training-step peaks (MiB) into `record`, NaN where a mode did not run cleanly, whose
    status then goes to `status[header][index]`. Returns the training step's row where it ran cleanly."""
    train = None
    for header, mode in ((FORWARD, "forward"), (TRAIN, "train_step")):
        row = point[point["mode"] == mode]
        ok = len(row) and row["status"].iloc[0] == "ok"
        record[header] = row["peak_memory_mib"].iloc[0] if ok else float("nan")
        if len(row) and not ok:
            status.setdefault(header, {})[index] = str(row["status"].iloc[0])
        if ok and mode == "train_step":
            train = row.iloc[0]
    return train


def memory_peaks(frame: pd.DataFrame) -> NumericTable:
    """(b) and (c): per precision and context length, the peak of a forward pass (no_grad) and of a training
    step, beside the float32 weights (P × 4 B) they are read against; where the run recorded them, the
    training step's level before its forward, its forward+backward peak, and what its forward saves."""
    phases = [h for h in PHASE_COLUMNS if set(RECORDED) <= set(frame.columns)]
    weights = parameter_count(get_config(str(frame["size"].iloc[0]))) * 4 / 2**20
    records, status = [], {}
    for precision in [p for p in ("fp32", "bf16", "fp16") if p in set(frame["precision"])]:
        for context in sorted(set(frame["context_length"])):
            point = frame[(frame["precision"] == precision) & (frame["context_length"] == context)]
            record = {"precision": precision, "context": int(context), WEIGHTS: weights}
            train = _mode_peaks(point, record, status, len(records))
            for name in phases:
                record[name] = PHASE_COLUMNS[name](train) if train is not None else float("nan")
            records.append(record)
    headers = [FORWARD, TRAIN, WEIGHTS, *phases]
    return NumericTable(pd.DataFrame(records, columns=["precision", "context", *headers]),
                        (Col("precision"), Col("context", "d"), *(Col(h, ",.0f") for h in headers)), status)


def render_memory(ctx: Context) -> Section:
    peaks, allocations = ctx.frame("memory"), ctx.frame("memory_allocations")
    q = Quotes(ctx.numeric("memory_peaks"))
    table = q.frame
    size, batch = peaks["size"].iloc[0], int(peaks["batch_size"].iloc[0])
    config = get_config(size)
    longest = int(table["context"].max())
    ooms = peaks[peaks["status"] == "oom"]
    intro = (f"{size}, batch {batch}; peak memory allocated by tensors during one measured step (after warm-up), "
             f"from `torch.cuda.max_memory_allocated`. Out of memory: "
             + (", ".join(f"{m} {p} at {c}" for m, p, c in ooms[["mode", "precision", "context_length"]].values)
                or "none") + ".")
    parts = [intro, ctx.table("memory_peaks")]
    for precision in ("fp32", "bf16"):
        parts.append(ctx.figure(f"memory/forward_{precision}_{longest}", f"forward {precision}"))
        parts.append(ctx.figure(f"memory/train_step_{precision}_{longest}", f"train step {precision}"))
    checked = [_timelines(q, longest), _peaks(q), _precision(q, longest)]
    parts += checked
    residual = batch * longest * config.d_model * 4 / 2**20
    parts.append(f"(d) One residual-stream activation at context {longest} is batch × context × d_model × 4 B = "
                 f"{batch} × {longest} × {config.d_model} × 4 / 1024² = {residual:.1f} MiB.")
    if allocations is not None:
        forward = allocations[allocations["snapshot"] == f"forward_fp32_{longest}"]
        same = forward[(forward["size_mib"] - residual).abs() < 1e-6]
        if len(same):
            parts[-1] += f" The forward snapshot has {int(same['count'].sum())} allocations of exactly that size."
        parts.append(_largest_allocations(forward, config, batch, longest)
                     + "\n\n" + forward[["size_mib", "count", "origin"]].round(1).to_markdown(index=False))
    # "2" of "2.7B" is the size's name, not a measurement
    return Section(parts, q.table, checked, q.derived, wording=("2",))


def _weights(q: Quotes) -> str:
    return q.cell(WEIGHTS, 0)


def _times_weights(q: Quotes, factor: int, what: str) -> str:
    return q.derive(lambda t: factor * column_values(t, WEIGHTS).iloc[0], ",.0f", what)


def _timelines(q: Quotes, longest: int) -> str:
    """(a): what each timeline shows, phase by phase (the figures above, context `longest`)."""
    fp32 = q.table.row(precision="fp32", context=longest)
    text = (
        f"(a) The timelines are drawn over host time (each allocation and free is made by the host as it "
        f"enqueues the kernels, ahead of the GPU; the shaded phases end at the synchronize that closes each). "
        f"The forward-only timeline is flat: the float32 weights ({_weights(q)} MiB) stay resident and, under "
        f"no_grad, each layer's activations are freed as the next layer runs, so the curve only shows one small "
        f"tooth per layer up to the forward peak ({q.cell(FORWARD, fp32)} MiB in fp32 at context {longest}); "
        f"nothing in it grows with depth. The training step's timeline tells its stages apart by shape. It opens at "
        f"about four times the weights ({_times_weights(q, 4, 'weights, gradients and two AdamW moments')} MiB: "
        f"weights, the last step's gradients and AdamW's two moments) and drops to three times "
        f"({_times_weights(q, 3, 'weights and two AdamW moments')} MiB) when `zero_grad` frees the gradients. "
        f"The forward pass is a steady ramp up, each layer adding the activations it saves for the backward")
    if "train: before forward (MiB)" in q.table.headers:
        text += f" ({_forward_rise(q, fp32)} MiB in fp32 at context {longest})"
    text += (
        "; the backward is a slower ramp down, freeing those activations layer by layer while it allocates the "
        "gradients, and ends at four times the weights; the optimizer step is a short plateau one weights' "
        "worth higher (the multi-tensor AdamW's temporary per parameter)"
        + (f" that sets the step's peak ({q.cell(TRAIN, fp32)} MiB)" if _optimizer_sets_step_peak(q) else "")
        + ", then falls back. So yes: ramp up, ramp down and plateau are forward, backward and optimizer.")
    return text


def _forward_rise(q: Quotes, row: int) -> str:
    """What the training step's forward adds: its own peak less the level before it (the backward's peak, a little
    higher, is not the forward's)."""
    return q.derive(lambda t: (column_values(t, "train: forward peak (MiB)")
                               - column_values(t, "train: before forward (MiB)")).iloc[row],
                    ",.0f", f"forward peak less the level before the forward, row {row}")


def _above(header: str, factor: int, pick: str | None = None):
    """A formula: the column less `factor` times the float32 weights, per row, or its min / max (`pick`)."""
    def formula(t):
        values = column_values(t, header) - factor * column_values(t, WEIGHTS)
        return values if pick is None else getattr(values, pick)()
    return formula


def _peaks(q: Quotes) -> str:
    """(b): the two peaks per context length, against what must be resident."""
    def span(header: str, factor: int, fmt: str, what: str) -> str:
        return (f"{q.derive(_above(header, factor, 'min'), fmt, what + ', least')}"
                f"{'–' if fmt == ',.0f' else ' to '}{q.derive(_above(header, factor, 'max'), fmt, what + ', most')}")

    extra = q.frame.assign(above=_above(FORWARD, 1)(q.frame))
    grows = extra.groupby("precision", sort=False)["above"].apply(lambda v: v.is_monotonic_increasing).all()
    text = (
        f"(b) The forward pass (no_grad) peaks {span(FORWARD, 1, ',.0f', 'forward peak above the weights')} MiB "
        f"above the float32 weights: the working set of one layer"
        + (", which grows with the context (its T×T attention scores most)" if grows else "")
        + f". A training step peaks {span(TRAIN, 5, '+,.0f', 'train step peak above five times the weights')} MiB "
        f"from five times the weights ({_times_weights(q, 5, 'weights, gradients, two moments and the update temporary')}"
        f" MiB: weights, gradients, AdamW's two moments and the temporary of the multi-tensor update)")
    text += (", at every context length: the peak is the optimizer step, not the activations of the backward pass, "
             "so it does not grow with the context here." if _optimizer_sets_step_peak(q) else
             ": what lies above that is the activations kept for the backward pass.")
    return text + _activations_next_to_peak(q)


def _activations_next_to_peak(q: Quotes) -> str:
    """(b), continued: the activations are not small at the longest context, only below the optimizer's peak."""
    peak = "train: forward+backward peak (MiB)"
    longest = int(q.table.data["context"].max())
    precision = "fp32" if q.table.has(precision="fp32", context=longest) else str(q.table.data["precision"].iloc[0])
    row = q.table.row(precision=precision, context=longest)
    if peak not in q.table.headers:
        return (f" The activations are not small, though: the training timelines (context {q.cell('context', row)}) "
                "climb by nearly twice the weights during the forward pass, to within a few GiB of the optimizer's "
                "peak; the phase levels that measure this are pending (see (c)).")

    def below(t):
        return (column_values(t, TRAIN) - column_values(t, peak)).iloc[row]

    return (f" The activations are not small, though: at context {q.cell('context', row)} ({precision}) the forward "
            f"raises memory by {_forward_rise(q, row)} MiB (its peak less the level before it), and the "
            f"forward+backward peak, {q.cell(peak, row)} MiB, lies "
            f"{q.derive(below, ',.0f', 'step peak less forward+backward peak, longest context')} MiB below the "
            f"optimizer's.")


def _optimizer_sets_step_peak(q: Quotes) -> bool:
    """Whether every training step peaks within a tenth of the weights of five times the weights: weights,
    gradients, two moments and the update's temporary, i.e. at the optimizer step, not the activations."""
    return bool((_above(TRAIN, 5)(q.frame).abs() < 0.1 * column_values(q.frame, WEIGHTS)).all())


def _precision(q: Quotes, longest: int) -> str:
    """(c): which peak bf16 lowers, and why; with the recorded columns, what the forward saves per precision."""
    table = q.frame
    if not {"fp32", "bf16"} <= set(table["precision"]):
        return "(c) The run has no fp32 and bf16 rows to compare."

    def delta(header: str, pick: str | None = None, context: int | None = None):
        def formula(t):
            wide = t.pivot_table(index="context", columns="precision", values=header)
            values = wide["bf16"] - wide["fp32"]
            return values.loc[context] if pick is None else getattr(values, pick)()
        return formula

    text = (
        f"(c) bf16 autocast changes the forward peak by {q.derive(delta(FORWARD, 'min'), '+,.0f', 'forward bf16 - fp32, least')}"
        f" to {q.derive(delta(FORWARD, 'max'), '+,.0f', 'forward bf16 - fp32, most')} MiB and the training step's "
        f"by {q.derive(delta(TRAIN, 'min'), '+,.0f', 'train bf16 - fp32, least')} to "
        f"{q.derive(delta(TRAIN, 'max'), '+,.0f', 'train bf16 - fp32, most')} MiB: not significantly. Neither "
        f"peak is made of what autocast shrinks. The forward pass runs under no_grad, so it keeps no activations; "
        f"its peak is the float32 weights plus one layer's working set, and autocast only adds short-lived bf16 "
        f"casts of the weight being multiplied.")
    if _optimizer_sets_step_peak(q):
        text += (" The training step's peak is its optimizer step, on float32 weights, gradients and AdamW state "
                 "that autocast never touches.")
    text += (" Autocast acts on what the forward of a training step saves for the backward, and there it need not "
             "halve memory: each matmul saves its bf16 operands, including a bf16 copy of its weight (the float32 "
             "run saves the weight itself, resident anyway), while the norms, the softmax and the loss still "
             "compute, and save, float32.")
    if "saved weight copies (MiB)" not in q.table.headers:
        return text + (
            " The rows above hold only each step's overall peak, so they do not show the forward+backward peak per "
            "precision nor what the forward saves; the timelines suggest the bf16 forward climbs no lower than the "
            "fp32 one. bench/memory.py now records both (the phase levels from the snapshot, and the saved "
            "activations, their float32 part and the weight copies from a forward with saved-tensor hooks): "
            f"pending: {PENDING}.")
    fp32, bf16 = (q.table.row(precision=p, context=longest) for p in ("fp32", "bf16"))
    peak, saved, copies = "train: forward+backward peak (MiB)", "saved activations (MiB)", "saved weight copies (MiB)"

    def bf16_over_fp32(t):
        kept = column_values(t, saved) + column_values(t, copies)
        return kept.iloc[bf16] / kept.iloc[fp32]

    change = delta(peak, context=longest)(table)
    text += (
        f" Measured at context {longest}: the fp32 forward saves {q.cell(saved, fp32)} MiB of activations; the bf16 "
        f"forward saves {q.cell(saved, bf16)} MiB, {q.cell('of which fp32 (MiB)', bf16)} MiB of it float32, plus "
        f"{q.cell(copies, bf16)} MiB of bf16 weight copies: "
        f"{q.derive(bf16_over_fp32, '.2f', 'bf16 saved (activations and copies) over fp32 saved')}× what fp32 "
        f"keeps. The forward+backward peak is {q.cell(peak, fp32)} MiB in fp32 and {q.cell(peak, bf16)} MiB in bf16 "
        f"({q.derive(delta(peak, context=longest), '+,.0f', f'forward+backward peak bf16 - fp32 at {longest}')} MiB)")
    text += (": so bf16 does not lower this peak either." if change >= 0 else
             ": bf16 lowers this peak, which is not the step's." if _optimizer_sets_step_peak(q) else
             ": bf16 lowers this peak.")
    return text


def _largest_allocations(forward, config, batch: int, context: int) -> str:
    """(e) in words: each of the largest allocation sizes of the forward snapshot, matched with the float32
    tensor shape it is (attention scores B·H·T², SwiGLU hidden B·T·d_ff, logits B·T·vocab, residual B·T·d)."""
    shapes = {"B×H×T×T: an attention score matrix (scores, masked scores, softmax)":
              batch * config.num_heads * context * context,
              "B×T×d_ff: a SwiGLU hidden activation": batch * context * config.d_ff,
              "B×T×vocab: the logits": batch * context * config.vocab_size,
              "B×T×d_model: a residual-stream activation": batch * context * config.d_model}
    named = []
    for size_mib, rows in forward.groupby("size_mib", sort=False):
        shape = next((name for name, n in shapes.items() if abs(n * 4 / 2**20 - size_mib) < 1e-6), None)
        origins = ", ".join(f"{o} ×{int(c)}" for o, c in zip(rows["origin"], rows["count"]))
        named.append(f"{size_mib:.1f} MiB ({origins}): " + (f"{shape}, float32" if shape else "no activation shape"))
    return (f"(e) The largest allocations of the forward pass (fp32, context {context}), largest first, with the "
            f"tensor each size is (B = {batch}, H = {config.num_heads}, T = {context}, d_ff = {config.d_ff}, "
            f"vocab = {config.vocab_size}, d_model = {config.d_model}): " + "; ".join(named) + ".")


# ---- 2026 §2.1.6 memory_profiling: the 2026 xl (our 2025 2.7B) at contexts 128 and 2048 --------------------

def memory_peaks_2026(frame: pd.DataFrame) -> NumericTable:
    """(b), (c): per precision, context and attention backend, the peak of a forward pass and of a training step
    (MiB); OOM where the point did not fit (the next row then has the fallback attention's point)."""
    records, status = [], {}
    keys = ["precision", "context_length", "attention"]
    for (precision, context, attention), point in frame.groupby(keys, sort=False):
        record = {"precision": precision, "context": int(context), "attention": attention}
        _mode_peaks(point, record, status, len(records))
        records.append(record)
    data = pd.DataFrame(records, columns=["precision", "context", "attention", FORWARD, TRAIN])
    return NumericTable(data, (Col("precision"), Col("context", "d"), Col("attention"), Col(FORWARD, ",.0f"),
                               Col(TRAIN, ",.0f")), status)


def render_memory_2026(ctx: Context) -> str:
    frame = ctx.frame("memory_2026")
    q = Quotes(ctx.numeric("memory_peaks_2026"))
    config = get_config(str(frame["size"].iloc[0]), "2026")
    weights = parameter_count(config) * 4 / 2**20
    def peak(header: str, i: int, what: str) -> str:
        """A point's peak in words: its cell, out of memory (the cell's status), or not run (the fallback backend
        reruns only the mode that ran out of memory)."""
        if pd.notna(q.frame.at[i, header]):
            return f"{what} peak {q.cell(header, i)} MiB"
        status = q.table.status.get(header, {}).get(i)
        return f"{what} {'out of memory' if status == 'oom' else status or 'not run'}"

    parts = [f"{row['precision']}, context {q.cell('context', i)}, {row['attention']} attention: "
             f"{peak(FORWARD, i, 'forward')}, {peak(TRAIN, i, 'training step')}." for i, row in q.frame.iterrows()]
    text = (f"The 2026 xl (d_model {config.d_model}, {config.num_layers} layers: our 2025 2.7B), batch "
            f"{int(frame['batch_size'].iloc[0])}; its float32 weights are {weights:,.0f} MiB. " + " ".join(parts))
    figures = sorted((ctx.figures / "memory_2026").glob("*.png")) if (ctx.figures / "memory_2026").exists() else []
    timelines = "Active-memory timelines: " + (
        ", ".join(f.name for f in figures) + f" in {ctx.figures / 'memory_2026'}." if figures else
        f"pending: `snakemake {ctx.results}/memory_allocations_2026.csv --cores 1 --resources gpu=1`.")
    return "\n\n".join([text, ctx.table("memory_peaks_2026"), timelines])  # prose from the rows (not yet checked)


def block_memory_2026(frame: pd.DataFrame) -> NumericTable:
    """(f): per context and attention, a middle block's residuals (MiB), its five largest producing ops with their
    share, its parameter gradients (MiB) and, on CUDA, the gradients implied by the memory change across its
    backward plus the residuals it frees."""
    records, status = [], {}
    for (context, attention), point in frame.groupby(["context_length", "attention"], sort=False):
        record = {"context": int(context), "attention": attention}
        blocks = point[point["kind"] == "block"]
        if (point["status"] == "oom").any() or not len(blocks):
            for header in ("residuals (MiB)", "gradients (MiB)", "implied gradients (MiB)"):
                status.setdefault(header, {})[len(records)] = "OOM"
            records.append({**record, "top-5 ops": ""})
            continue
        block = int(blocks["block"].max()) // 2
        row = blocks[blocks["block"] == block].iloc[0]
        ops = point[(point["kind"] == "op") & (point["block"] == block)].sort_values("rank").head(5)
        record |= {"residuals (MiB)": row["residual_mib"], "gradients (MiB)": row["gradient_mib"],
                   "implied gradients (MiB)": row["implied_gradient_mib"],
                   "top-5 ops": ", ".join(f"{o.removeprefix('aten::')} {s:.0%}" for o, s in zip(ops["op"], ops["share"])),
                   "top-5 share": ops["share"].sum()}
        records.append(record)
    headers = ["residuals (MiB)", "top-5 ops", "top-5 share", "gradients (MiB)", "implied gradients (MiB)"]
    data = pd.DataFrame(records, columns=["context", "attention", *headers])
    return NumericTable(data, (Col("context", "d"), Col("attention"), Col("residuals (MiB)", ",.1f"),
                               Col("top-5 ops"), Col("top-5 share", ".0%"), Col("gradients (MiB)", ",.1f"),
                               Col("implied gradients (MiB)", ",.1f")), status)


def render_block_memory_2026(ctx: Context) -> str:
    frame = ctx.frame("block_memory_2026")
    q = Quotes(ctx.numeric("block_memory_2026"))
    config = get_config(str(frame["size"].iloc[0]), "2026")
    per_block = (4 * config.d_model**2 + 3 * config.d_model * config.d_ff + 2 * config.d_model) * 4 / 2**20
    parts = []
    for i, row in q.frame.iterrows():
        if pd.isna(row["residuals (MiB)"]):
            parts.append(f"Context {q.cell('context', i)}, {row['attention']} attention: out of memory.")
            continue
        implied = ("" if pd.isna(row["implied gradients (MiB)"]) else
                   f"; from the memory levels, the backward's change plus the residuals it frees gives "
                   f"{q.cell('implied gradients (MiB)', i)} MiB")
        parts.append(f"Context {q.cell('context', i)}, {row['attention']} attention: one block saves "
                     f"{q.cell('residuals (MiB)', i)} MiB for the backward; its five largest producing ops ("
                     f"{row['top-5 ops']}) hold {q.cell('top-5 share', i)} of it. Its parameter gradients take "
                     f"{q.cell('gradients (MiB)', i)} MiB{implied}.")
    text = (f"Measured on the 2026 {frame['size'].iloc[0]} (batch {int(frame['batch_size'].iloc[0])}, {frame['precision'].iloc[0]}) "
            f"where autograd saves each tensor (bench/block_memory.py: each storage once, charged to the ATen op "
            f"that allocated it), rather than read from Nsight's memory track. A block's parameters in float32 "
            f"are {per_block:,.1f} MiB (4 d² + 3 d·d_ff + 2 d parameters × 4 B), which its gradients should "
            f"equal. " + " ".join(parts))
    return "\n\n".join([text, ctx.table("block_memory_2026")])  # prose from the rows (not yet checked)


MEMORY_2026 = Table("memory_peaks_2026", "memory_2026", memory_peaks_2026,
                    "2026 §2.1.6 (b, c): peak memory of the 2026 xl per precision, context and attention (MiB)")
BLOCK_MEMORY_2026 = Table("block_memory_2026", "block_memory_2026", block_memory_2026,
                          "2026 §2.1.6 (f): residuals, their top-5 ops and gradients of one block (MiB)")

DELIVERABLES = [
    Deliverable("1.1.6 (a–e) memory_profiling of the 2.7B model", "memory_profile", render_memory,
                ("memory", "memory_allocations"),
                tables=(Table("memory_peaks", "memory", memory_peaks,
                              "Peak memory of the 2.7B model (batch 4) per precision and context length: forward "
                              "pass (no_grad) and training step (forward, backward, AdamW)"),),
                cuda_only="the allocator history is a CUDA feature"),
    Deliverable("2026 §2.1.6 (a–e) memory_profiling of the 2026 xl at contexts 128 and 2048", "memory_profile_2026",
                render_memory_2026, ("memory_2026",), tables=(MEMORY_2026,),
                cuda_only="the allocator history is a CUDA feature"),
    Deliverable("2026 §2.1.6 (f) memory_profiling: residuals, their top-5 ops and gradients per block",
                "memory_residuals_2026", render_block_memory_2026, ("block_memory_2026",),
                tables=(BLOCK_MEMORY_2026,)),
]
