"""Handout 1.1.6 (workflow/rules/benchmarking.smk, rules memory_profile and memory_timelines): peak
memory of the largest model by context length and precision, and what the allocator snapshots show."""

from __future__ import annotations

from cs336_systems.model import get_config
from cs336_systems.model.functional import parameter_count
from cs336_systems.report.section import Context, Deliverable


def render_memory(ctx: Context) -> str:
    peaks = ctx.frame("memory")
    allocations = ctx.frame("memory_allocations")
    ok = peaks[peaks["status"] == "ok"]
    table = ok.pivot_table(index="context_length", columns=["mode", "precision"], values="peak_memory_mib").round(0)
    table.columns = [f"{mode} {precision} peak (MiB)" for mode, precision in table.columns]
    size, batch = peaks["size"].iloc[0], int(peaks["batch_size"].iloc[0])
    config = get_config(size)
    longest = int(ok["context_length"].max())
    residual = batch * longest * config.d_model * 4 / 2**20
    parts = [f"{size}, batch {batch}; peak memory allocated by tensors during one measured step (after warm-up), "
             f"from `torch.cuda.max_memory_allocated`. Out of memory: "
             + (", ".join(f"{m} {p} at {c}" for m, p, c in peaks[peaks["status"] == "oom"][
                 ["mode", "precision", "context_length"]].values) or "none") + ".",
             table.reset_index().to_markdown(index=False)]
    for precision in ("fp32", "bf16"):
        name = f"forward_{precision}_{longest}"
        parts.append(ctx.figure(f"memory/{name}", f"forward {precision}"))
        parts.append(ctx.figure(f"memory/train_step_{precision}_{longest}", f"train step {precision}"))
    # What must be resident, from the parameter count P (float32, 4 B each): the weights alone in a
    # forward pass (run under no_grad, so one layer's activations are live at a time); in a training
    # step weights, gradients, AdamW's two moments, and the √v temporary of the multi-tensor update.
    weights = parameter_count(config) * 4 / 2**20
    fixed = {"forward": weights, "train_step": 5 * weights}
    above = ok.assign(above=ok["peak_memory_mib"] - ok["mode"].map(fixed))
    forward, train = above[above["mode"] == "forward"], above[above["mode"] == "train_step"]
    parts.append(
        f"(b) The model has {parameter_count(config) / 1e9:.2f}B parameters: {weights:,.0f} MiB of float32 weights. "
        f"The forward pass (no_grad) peaks {forward['above'].min():,.0f}–{forward['above'].max():,.0f} MiB above "
        f"the weights: the working set of one layer, which grows with the context. A training step peaks "
        f"{train['above'].min():+,.0f} to {train['above'].max():+,.0f} MiB from 5 × the weights "
        f"({fixed['train_step']:,.0f} MiB: weights, gradients, AdamW's two moments and the √v temporary "
        f"of the update)"
        + (", at every context length: the peak is the optimizer step, not the activations of the backward "
           "pass, so it does not grow with the context here."
           if train["above"].abs().max() < 0.1 * weights else
           ": what lies above that is the activations kept for the backward pass."))
    if {"fp32", "bf16"} <= set(ok["precision"]):
        wide = ok.pivot_table(index=["mode", "context_length"], columns="precision", values="peak_memory_mib")
        delta = (wide["bf16"] - wide["fp32"]).dropna()
        optimizer_peak = train["above"].abs().max() < 0.1 * weights  # as (b): the step's peak is the optimizer's
        parts.append(f"(c) bf16 autocast changes the peak by {delta.min():+.0f} to {delta.max():+.0f} MiB: neither "
                     f"peak holds what autocast halves, the activations kept for the backward. The forward pass "
                     f"(no_grad) keeps none; its peak is the float32 weights plus one layer's working set"
                     + (", and the training step's peak is its optimizer step (weights, gradients and AdamW "
                        "state, all float32), after the backward has freed the activations. These rows do not "
                        "show how bf16 changes the forward+backward peak, which the activations do set."
                        if optimizer_peak else "."))
    parts.append(f"(d) One residual-stream activation at context {longest} is batch × context × d_model × 4 B = "
                 f"{batch} × {longest} × {config.d_model} × 4 / 1024² = {residual:.1f} MiB.")
    if allocations is not None:
        forward = allocations[allocations["snapshot"] == f"forward_fp32_{longest}"]
        same = forward[(forward["size_mib"] - residual).abs() < 1e-6]
        if len(same):
            parts[-1] += f" The forward snapshot has {int(same['count'].sum())} allocations of exactly that size."
        parts.append(_largest_allocations(forward, config, batch, longest)
                     + "\n\n" + forward[["size_mib", "count", "origin"]].round(1).to_markdown(index=False))
    return "\n\n".join(parts)


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


DELIVERABLES = [
    Deliverable("1.1.6 (a–e) memory_profiling of the 2.7B model", "memory_profile", render_memory,
                ("memory", "memory_allocations"), cuda_only="the allocator history is a CUDA feature"),
]
