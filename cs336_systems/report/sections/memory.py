"""Handout 1.1.6 (workflow/rules/benchmarking.smk, rules memory_profile and memory_timelines): peak
memory of the largest model by context length and precision, what the allocator snapshots show, and
why bf16 autocast lowers neither peak.

(a)–(c) quote the table `memory_peaks` (one row per precision and context length); (d) is arithmetic on
the model's shape and (e) reads the largest-allocation rows of the forward snapshot (memory_allocations.csv).
The columns of the training step's phases and of what its forward saves for the backward come from runs
of bench/memory.py that record them; rows of an earlier run leave them out and the prose says so."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.model import get_config
from cs336_systems.model.accounting import parameter_count
from cs336_systems.report.appendix import appendix, appendix_parts, rows_of, statistic
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
NUMBER = re.compile(r"\d+(?:\.\d+)?")  # the numbers of a device's name (provenance, not measurements)
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
        parts += [_largest_allocations(forward, config, batch, longest),
                  *_allocations_appendix(forward, f"{size} memory_profiling (e): the largest allocations of the forward")]
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
        + (f" that sets the step's peak ({q.cell(TRAIN, fp32)} MiB)" if _optimizer_sets_step_peak(q.frame) else "")
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
             "so it does not grow with the context here." if _optimizer_sets_step_peak(q.frame) else
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


def _optimizer_sets_step_peak(t: pd.DataFrame) -> bool:
    """Whether every measured training step (of a peaks table's numbers, either edition's) peaks within a tenth of
    the weights of five times the weights: weights, gradients, two moments and the update's temporary, i.e. at the
    optimizer step, not the activations. False where none was measured."""
    steps = t[t[TRAIN].notna()]
    return bool(len(steps)) and bool((_above(TRAIN, 5)(steps).abs() < 0.1 * column_values(steps, WEIGHTS)).all())


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
    if _optimizer_sets_step_peak(q.frame):
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
             ": bf16 lowers this peak, which is not the step's." if _optimizer_sets_step_peak(q.frame) else
             ": bf16 lowers this peak.")
    return text


def _allocations_appendix(forward: pd.DataFrame, title: str) -> list[str]:
    """(e)'s table, every largest allocation of the forward snapshot with where it was made, for the appendix."""
    return appendix_parts(title, [forward[["size_mib", "count", "origin"]].round(1).to_markdown(index=False)])


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
    (MiB), beside the float32 weights; OOM where the point did not fit (the next row then has the fallback
    attention's point, which reruns only the mode that did not fit)."""
    weights = parameter_count(get_config(str(frame["size"].iloc[0]), "2026")) * 4 / 2**20
    records, status = [], {}
    keys = ["precision", "context_length", "attention"]
    for (precision, context, attention), point in frame.groupby(keys, sort=False):
        record = {"precision": precision, "context": int(context), "attention": attention, WEIGHTS: weights}
        train = _mode_peaks(point, record, status, len(records))
        for header, column in PHASES_2026.items():
            record[header] = train[column] if train is not None else float("nan")
        records.append(record)
    headers = [FORWARD, TRAIN, WEIGHTS, *PHASES_2026]
    data = pd.DataFrame(records, columns=["precision", "context", "attention", *headers])
    return NumericTable(data, (Col("precision"), Col("context", "d"), Col("attention"),
                               *(Col(h, ",.0f") for h in headers)), status)


# The training step's levels that its timeline is read by (bench/memory.py, from the step's snapshot).
BEFORE, RISEN, AFTER = "train: before forward (MiB)", "train: forward peak (MiB)", "train: after backward (MiB)"
PHASES_2026 = {BEFORE: "forward_start_mib", RISEN: "forward_peak_mib", AFTER: "backward_end_mib"}


def _point(q: Quotes, header: str, precision: str, context: int, attention: str) -> str:
    """One point's peak in words: its cell in MiB, out of memory (the cell's status), or not run (the fallback
    backend reruns only the mode that ran out of memory), or not measured (no such row)."""
    t = q.frame
    rows = t.index[(t["precision"] == precision) & (t["context"] == context) & (t["attention"] == attention)]
    if not len(rows):
        return "not measured"
    if pd.notna(t.at[rows[0], header]):
        return f"{q.cell(header, int(rows[0]))} MiB"
    status = q.table.status.get(header, {}).get(int(rows[0]))
    return "out of memory" if status == "oom" else status or "not run"


def _step_2026(q: Quotes, precision: str, context: int, attentions: list[str]) -> str:
    """The training step at one context in words: the handout's attention first, then each fallback's point."""
    said = [_point(q, TRAIN, precision, context, attentions[0])]
    for attention in attentions[1:]:
        if _point(q, TRAIN, precision, context, attention) != "not measured":
            said.append(f"with `{attention}`, {_point(q, TRAIN, precision, context, attention)}")
    return "; ".join(said)


def _mixed_2026(q: Quotes, contexts: list[int], naive: str) -> str:
    """(c): bf16 autocast less fp32, per context, for each peak both precisions measured; 'significantly' where a
    change exceeds a tenth of the fp32 peak."""
    t = q.frame

    def delta(header: str, context: int):
        def formula(t):
            rows = t[(t["context"] == context) & (t["attention"] == naive)].set_index("precision")[header]
            return rows["bf16"] - rows["fp32"]
        return formula

    def paired(header: str) -> list[int]:
        rows = t[t["attention"] == naive]
        return [c for c in contexts if rows[(rows["context"] == c) & rows[header].notna()]["precision"].nunique() == 2]

    said, large = [], False
    for header, what in ((FORWARD, "the forward peak"), (TRAIN, "the training step's")):
        changes = [f"{q.derive(delta(header, c), '+,.0f', f'{what}: bf16 - fp32 at {c}')} MiB at context {c}"
                   for c in paired(header)]
        large |= any(abs(delta(header, c)(t)) > 0.1 * t.loc[(t["context"] == c) & (t["precision"] == "fp32")
                                                            & (t["attention"] == naive), header].iloc[0]
                     for c in paired(header))
        if changes:
            said.append(f"{what} by " + " and ".join(changes))
    if not said:
        return "(c) No point ran in both fp32 and bf16."
    text = f"(c) bf16 autocast changes {' and '.join(said)}: " + ("significantly." if large else "not significantly.")
    text += " The forward keeps no activations (no_grad), and autocast only adds bf16 copies of what it multiplies"
    text += (("; the training step peaks at its optimizer step, on float32 state autocast never touches."
              if _optimizer_sets_step_peak(t) else "."))
    return text


def render_memory_2026(ctx: Context) -> Section:
    """(a)-(e) for the 2026 xl: the peaks table and the timelines (the forward at the longest context, the training
    step at the longest context it fit), (a)-(c) from the table's cells, (d) from the model's shape and (e) from
    the largest allocations of the float32 forward snapshot at the longest context."""
    frame, allocations = ctx.frame("memory_2026"), ctx.frame("memory_allocations_2026")
    q = Quotes(ctx.numeric("memory_peaks_2026"))
    t = q.frame
    config = get_config(str(frame["size"].iloc[0]), "2026")
    batch, device = int(frame["batch_size"].iloc[0]), str(frame["device_name"].iloc[0])
    naive = str(t["attention"].iloc[0])  # the handout's attention; later rows of a context: the fallback's
    attentions = list(dict.fromkeys(t["attention"]))
    contexts = sorted(set(t["context"]))
    longest = contexts[-1]
    fp32 = t[(t["precision"] == "fp32") & (t["attention"] == naive)]
    fit = fp32[fp32[TRAIN].notna()]
    step_context = int(fit["context"].max()) if len(fit) else None
    intro = (f"The 2026 xl (d_model {config.d_model}, d_ff {config.d_ff}, {config.num_layers} layers, "
             f"{config.num_heads} heads: our 2025 2.7B), batch {batch}, the handout's {naive} attention; peaks from "
             f"`torch.cuda.max_memory_allocated` over one step after warm-up, on one {device}"
             + (f"; a training step that did not fit ran again with {', '.join(f'`{a}`' for a in attentions[1:])}."
                if len(attentions) > 1 else "."))
    forward_row = q.table.row(precision="fp32", context=longest, attention=naive)
    timelines = (f"(a) The forward-only timeline (fp32, context {longest}) is flat at the float32 weights "
                 f"({q.cell(WEIGHTS, 0)} MiB) with one tooth per layer up to its peak ({q.cell(FORWARD, forward_row)} "
                 "MiB): under no_grad each layer's activations are freed as the next one runs.")
    if step_context is not None:
        step_row = q.table.row(precision="fp32", context=step_context, attention=naive)
        climbs = t.at[step_row, AFTER] > t.at[step_row, RISEN]
        rise = q.derive(lambda t: t.at[step_row, RISEN] - t.at[step_row, BEFORE], ",.0f",
                        f"the training step's forward rise at {step_context}")
        timelines += (f" The training step's (fp32, context {step_context}, the longest that fit) shows each stage by "
                      f"its direction: `zero_grad` drops it to {q.cell(BEFORE, step_row)} MiB, the forward ramps up by "
                      f"{rise} MiB of saved activations, the backward "
                      + (f"climbs to {q.cell(AFTER, step_row)} MiB (the gradients it allocates outweigh the "
                         "activations it frees)" if climbs else
                         f"falls to {q.cell(AFTER, step_row)} MiB (it frees more activations than the gradients it "
                         "allocates)")
                      + ", and the optimizer step is a short plateau"
                      + (f" at the step's peak ({q.cell(TRAIN, step_row)} MiB, about five times the weights)"
                         if _optimizer_sets_step_peak(t) else "") + ".")
    peaks = ("(b) In fp32, " + "; ".join(
        f"context {c}: forward {_point(q, FORWARD, 'fp32', c, naive)}, training step "
        f"{_step_2026(q, 'fp32', c, attentions)}" for c in contexts) + ".")
    if fit.shape[0] < fp32.shape[0]:
        peaks += (f" Weights, gradients and AdamW's two moments alone take "
                  f"{q.derive(lambda t: 4 * t[WEIGHTS].iloc[0], ',.0f', 'four times the weights')} MiB (four times "
                  "the weights); the activations a longer context saves did not fit beside them on this GPU.")
    mixed = _mixed_2026(q, contexts, naive)
    table = ctx.table("memory_peaks_2026")
    shown = ("precision", "context", "attention", FORWARD, TRAIN)
    parts = [intro, rows_of(q.table, None, shown).to_markdown(),
             f"_{statistic(table)}: the phase levels (a) reads are in the full table._",
             appendix("2026 memory_profiling: peaks and the training step's levels", table),
             ctx.figure(f"memory_2026/forward_fp32_{longest}", f"forward fp32, context {longest}")]
    if step_context is not None:
        parts.append(ctx.figure(f"memory_2026/train_step_fp32_{step_context}", f"train step fp32, context {step_context}"))
    checked = [intro, timelines, peaks, mixed]
    parts += checked[1:]
    residual = {c: batch * c * config.d_model * 4 / 2**20 for c in contexts}
    parts.append("(d) One residual-stream activation in float32 is batch × context × d_model × 4 B: " + " and ".join(
        f"{batch} × {c} × {config.d_model} × 4 / 1024² = {residual[c]:.1f} MiB at context {c}" for c in contexts) + ".")
    if allocations is not None:
        forward = allocations[allocations["snapshot"] == f"forward_fp32_{longest}"]
        same = forward[(forward["size_mib"] - residual[longest]).abs() < 1e-6]
        if len(same):
            parts[-1] += (f" The fp32 forward snapshot at context {longest} has {int(same['count'].sum())} allocations "
                          "of exactly that size.")
        top = forward[forward["size_mib"].isin(sorted(set(forward["size_mib"]), reverse=True)[:2])]
        parts += [_largest_allocations(top, config, batch, longest),
                  *_allocations_appendix(forward, "2026 memory_profiling (e): the largest allocations of the forward")]
    wording = ("2026", "2025", "2", str(config.d_model), str(config.d_ff), str(config.num_layers),
               str(config.num_heads), str(batch), *NUMBER.findall(device))
    return Section(parts, q.table, checked, q.derived, wording=wording)


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
                render_memory_2026, ("memory_2026", "memory_allocations_2026"), tables=(MEMORY_2026,),
                cuda_only="the allocator history is a CUDA feature"),
    Deliverable("2026 §2.1.6 (f) memory_profiling: residuals, their top-5 ops and gradients per block",
                "memory_residuals_2026", render_block_memory_2026, ("block_memory_2026",),
                tables=(BLOCK_MEMORY_2026,)),
]
