"""Handout 1.1.4 (workflow/rules/benchmarking.smk, rule profile): kernel summaries per range of a
training step, from the profiler's tables."""

from __future__ import annotations

from cs336_systems.model import get_config
from cs336_systems.report.profile_tables import MATMUL, profile_grid, profile_kernels, profile_kernels_of, profile_point
from cs336_systems.report.section import Context, Deliverable, Table


def render_profile(ctx: Context) -> str:
    frame = ctx.frame("profile")
    size, context = profile_point(frame)
    rows = frame[(frame["size"] == size) & (frame["context_length"] == context)]
    kernels = profile_kernels_of(rows)
    harness = rows[rows["kind"] == "harness"].set_index("phase")["ms_per_step"]
    by_phase = kernels.groupby("phase")["ms_per_step"].sum()
    tool = kernels["tool"].iloc[0]
    fwd = kernels[kernels["phase"] == "forward"].sort_values("ms_per_step")
    top = fwd.iloc[-1]
    both = kernels[kernels["phase"].isin(["forward", "backward"])].groupby("name")["ms_per_step"].sum()
    is_mm = kernels["name"].str.contains(MATMUL, case=False, regex=True)
    train = kernels["phase"].isin(["forward", "backward", "optimizer"])
    inference = kernels["phase"] == "inference"
    mm_train = kernels[train & is_mm]["ms_per_step"].sum() / kernels[train]["ms_per_step"].sum()
    mm_inf = kernels[inference & is_mm]["ms_per_step"].sum() / kernels[inference]["ms_per_step"].sum()
    fb = kernels[kernels["phase"].isin(["forward", "backward"]) & ~is_mm].groupby("name")["ms_per_step"].sum()
    fb_total = kernels[kernels["phase"].isin(["forward", "backward"])]["ms_per_step"].sum()
    notable = (fb / fb_total).sort_values(ascending=False)
    notable = notable[notable >= 0.01].head(5)
    stages = rows[(rows["kind"] == "attention_stage") & (rows["phase"] == "forward")].set_index("name")["ms_per_step"]
    config = get_config(size)
    ooms = frame[frame["status"] == "oom"]
    parts = [
        f"Profiled with {tool}"
        + ("" if tool.startswith("Nsight") else " (Nsight Systems cannot make reports on our GPU machines)")
        + f"; discussed at {size}, "
        f"context {context}, batch {int(rows['batch_size'].iloc[0])}, {rows['precision'].iloc[0]}. "
        + (f"Out of memory: {', '.join(f'{s} at {c}' for s, c in zip(ooms['size'], ooms['context_length']))}."
           if len(ooms) else "Every size and context length of the grid ran."),
        f"(a) The kernels of one forward pass add up to {by_phase['forward']:.2f} ms; the harness timed "
        f"{harness['forward']:.2f} ms for the same forward pass (synchronized wall time, which also counts "
        f"launch gaps and Python overhead).",
        f"(b) The kernel with the most time in the forward pass is `{top['name'][:80]}` "
        f"({top['ms_per_step'] / by_phase['forward']:.0%} of forward time), launched "
        f"{top['calls_per_step']:.0f} times per forward pass. Over forward and backward together the top "
        f"kernel is `{both.idxmax()[:80]}`" + (", the same one." if both.idxmax() == top["name"] else ", a different one."),
        "(c) Non-matmul kernels with at least 1% of forward+backward time: "
        + (", ".join(f"`{n[:60]}` ({v:.1%})" for n, v in notable.items()) or "none") + ".",
        f"(d) Matrix multiplications take {mm_train:.0%} of the kernel time of a full training step (with AdamW, "
        f"whose elementwise kernels add {by_phase.get('optimizer', 0):.2f} ms) against {mm_inf:.0%} of inference.",
    ]
    if {"softmax", "scores", "final matmul"} <= set(stages.index):
        matmul_ms = stages["scores"] + stages["final matmul"]
        # Per attention layer: QK^T and PV are 2·2·B·T²·d_head FLOPs per head; the softmax about 5 per score.
        flop_ratio = (4 * config.head_dim) / 5
        parts.append(
            f"(e) Inside attention the softmax takes {stages['softmax']:.3f} ms per forward pass against "
            f"{matmul_ms:.3f} ms for the two matrix products (scores and final matmul): a time ratio of "
            f"{matmul_ms / stages['softmax']:.2f}, while the products do about {flop_ratio:.0f}× the softmax's FLOPs "
            f"(4·d_head against ~5 operations per score, d_head = {config.head_dim}).")
        per_flop = flop_ratio / (matmul_ms / stages["softmax"])
        if per_flop > 1:
            parts[-1] += (f" Per FLOP the softmax is {per_flop:.1f}× slower: it reads and writes the whole T×T "
                          f"matrix with a few operations per element, so it is bound by memory traffic, while the "
                          f"products run on the matrix units.")
    return "\n\n".join([*parts, ctx.table("profile_grid"), ctx.table("profile_kernels")])


DELIVERABLES = [
    Deliverable("1.1.4 (a–e) nsys_profile: kernel summaries per range", "profile", render_profile, ("profile",),
                tables=(Table("profile_kernels", "profile", profile_kernels,
                              "Top kernels per phase (PyTorch profiler), per training step"),
                        Table("profile_grid", "profile", profile_grid,
                              "Kernel time per phase for every size and context length (PyTorch profiler)"))),
]
