"""The 2026 handout's section 9, the leaderboard's loss (workflow/rules/leaderboard.smk, rule linear_ce): the
fused LM head + cross-entropy against the plain loss, eager and compiled, at the 8B size's head. The whole 8B
step is sections/leaderboard.py's."""

from __future__ import annotations

import pandas as pd

from cs336_systems.model import get_config
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, shared_cell
from cs336_systems.report.sections.leaderboard import NUMBER

HANDOUT_BATCH = 2  # the handout's §9 timing sample: batch 2 at the 8B size's context length
CE_MS, CE_PEAK, CHUNK = "forward+backward (ms, median)", "peak (MiB)", "chunk (tokens)"


def linear_ce_table(frame: pd.DataFrame) -> NumericTable:
    """One row per (tokens, provider): the run's head shape and dtype and the tokens per chunk (the fused op's
    chunk, the whole call for the plain loss), beside the measured time, TFLOP/s, peak and loss."""
    rows = frame.sort_values(["tokens", "provider"])
    ok = rows["status"].eq("ok")
    data = pd.DataFrame({
        "tokens": rows["tokens"], "provider": rows["provider"], "status": rows["status"],
        "d_model": rows["d_model"], "vocab": rows["vocab"], "dtype": rows["dtype"], CHUNK: rows["chunk_tokens"],
        CE_MS: rows["median_ms"].where(ok), "TFLOP/s": rows["tflops"].where(ok),
        CE_PEAK: rows["peak_mib"].where(ok), "loss": rows["loss"].where(ok)})
    return NumericTable(data, (Col("tokens", "d"), Col("provider"), Col("status"), Col("d_model", "d"),
                               Col("vocab", "d"), Col("dtype"), Col(CHUNK, "d"), Col(CE_MS, ".1f"),
                               Col("TFLOP/s", ".0f"), Col(CE_PEAK, ",.0f"), Col("loss", ".4f")))


def _linear_ce_intro(table: NumericTable, device: str) -> str:
    """The section's intro: the handout's setting (given: its batch and the 8B size's context) and the run's
    (the head's shape, dtype and chunk, each a cell of the table, stated once where every row shares it)."""
    eight_b = get_config("8B", edition="2026")
    t = table.data
    sample = HANDOUT_BATCH * eight_b.context_length
    at_sample = (f", the table's {table.quote('tokens', int(t.index[t['tokens'] == sample][0]))}-token rows"
                 if (t["tokens"] == sample).any() else "")
    d_model, vocab, dtype = (shared_cell(table, h) for h in ("d_model", "vocab", "dtype"))
    if None in (d_model, vocab, dtype):
        shape = "at each row's d_model, vocab and dtype (the table's columns)"
    else:
        same_as_8b = t["d_model"].iloc[0] == eight_b.d_model and t["vocab"].iloc[0] == eight_b.vocab_size
        whose = "the 8B size's " if same_as_8b else ""
        shape = f"at {whose}d_model {d_model} and vocab {vocab}, {dtype}"
    fused = t.index[t["provider"] == "fused"]
    # the largest call's chunk: a call smaller than the chunk is one chunk of its own size
    chunk = (f"chunks of {table.quote(CHUNK, int(t.loc[fused, 'tokens'].idxmax()))} tokens" if len(fused) else
             "chunks (column `chunk (tokens)`)")
    return (f"Part of the 2026 handout's section 9 leaderboard, a full training step of the 8B model on the "
            f"handout's sample: batch {HANDOUT_BATCH} at the size's context of {eight_b.context_length} tokens"
            f"{at_sample}. The whole step, measured on one H200, is the section \"2026 §9 leaderboard: the 8B "
            f"training step on one H200\". This is its loss alone: the LM head and cross-entropy {shape}, on "
            f"{device}. `linear_cross_entropy` (kernels/fused_linear_ce.py) runs the head in {chunk}; a Triton "
            "kernel turns each chunk's logits into the loss and, in place, the logits' gradient, whose two matmuls "
            "give the hidden states' and the weight's gradients in the same pass, so the [tokens, vocab] logits "
            "never exist at once. The anchors are the plain loss (the model's fp32 cross-entropy of the full "
            "logits: its chunk is the whole call), eager and `torch.compile`d, in the same run.")


def _linear_ce_results(q: Quotes) -> str:
    """Per token count, fused against the compiled plain loss (time, their ratio, peak), and who ran out of
    memory: cells of the table and one formula per ratio."""
    table, t = q.table, q.frame
    lines = []
    ran = set(zip(t.loc[t["status"] == "ok", "tokens"], t.loc[t["status"] == "ok", "provider"]))
    for tokens in sorted(set(t["tokens"])):
        if {(tokens, "fused"), (tokens, "plain_compiled")} <= ran:
            def cell(column: str, provider: str, n=tokens) -> str:
                return table.quote(column, tokens=n, provider=provider)

            def fused_over_compiled(t: pd.DataFrame, n=tokens) -> float:
                return _ce_cell(t, n, "fused", CE_MS) / _ce_cell(t, n, "plain_compiled", CE_MS)

            ratio = q.derive(fused_over_compiled, ".2f", f"{tokens} tokens, fused over plain compiled")
            peaks = all(pd.notna(_ce_cell(t, tokens, p, CE_PEAK)) for p in ("fused", "plain_compiled"))
            memory = (f"peak {cell(CE_PEAK, 'fused')} MiB against {cell(CE_PEAK, 'plain_compiled')} MiB" if peaks
                      else "no peak memory (this device keeps no allocator statistics)")
            lines.append(f"- {cell('tokens', 'fused')} tokens: {cell(CE_MS, 'fused')} ms against "
                         f"{cell(CE_MS, 'plain_compiled')} ms compiled ({ratio}×), {memory}.")
        oom = t.index[(t["tokens"] == tokens) & (t["status"] == "oom")]
        if len(oom):
            lines.append(f"- {table.quote('tokens', int(oom[0]))} tokens: out of memory for "
                         f"{', '.join(t.loc[oom, 'provider'])}.")
    return "\n".join(lines)


def render_linear_ce(ctx: Context) -> Section:
    table = ctx.numeric("linear_ce")
    q = Quotes(table)
    device = str(ctx.frame("linear_ce")["device_name"].iloc[0])
    intro = _linear_ce_intro(table, device)
    results = _linear_ce_results(q)
    eight_b = get_config("8B", edition="2026")
    # the handout's numbering, its sample's batch, the 8B size's context and the device's name (a CPU's names
    # its cores) are words of the sentence
    given = ("2026", "9", str(HANDOUT_BATCH), str(eight_b.context_length), *NUMBER.findall(device))
    return Section([intro, results, ctx.table("linear_ce")], table, [intro] + ([results] if results else []),
                   q.derived, wording=given)


def _ce_cell(t: pd.DataFrame, tokens: int, provider: str, column: str) -> float:
    return float(t.loc[(t["tokens"] == tokens) & (t["provider"] == provider), column].iloc[0])


DELIVERABLES = [
    Deliverable("2026 §9 leaderboard parts: the fused LM head + cross-entropy", "linear_ce", render_linear_ce,
                ("linear_ce",),
                tables=(Table("linear_ce", "linear_ce", linear_ce_table,
                              "LM head + cross-entropy, forward+backward: fused against the plain loss; chunk: "
                              "tokens per chunk of the fused op (the plain loss takes the whole call at once)"),)),
]
