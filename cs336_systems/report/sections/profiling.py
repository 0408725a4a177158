"""Handout 1.1.4 (workflow/rules/benchmarking.smk, rule profile): kernel summaries per range of a
training step, from the profiler's tables.

(a) and (d)'s optimizer time quote the grid table (profile_grid), (b) the top-kernels table (profile_kernels),
both read back as the `table` rule built them; the shares of (c) and (d) and the attention stages of (e) are
sums over the profile rows that no table lists."""

from __future__ import annotations

from cs336_systems.model import get_config
from cs336_systems.report.appendix import appendix, moved
from cs336_systems.report.profile_tables import (MATMUL, attention_kernels, profile_grid, profile_kernels,
                                                 profile_kernels_of, profile_point)
import pandas as pd

from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table


def render_profile(ctx: Context) -> Section:
    frame = ctx.frame("profile")
    size, context = profile_point(frame)
    rows = frame[(frame["size"] == size) & (frame["context_length"] == context)]
    kernels = profile_kernels_of(rows)
    q = Quotes(ctx.numeric("profile_grid"))
    point = q.table.row(size=size, context=context)
    tool = kernels["tool"].iloc[0]
    top_kernels = ctx.numeric("profile_kernels")
    top = top_kernels.data[top_kernels.data["phase"] == "forward"]["ms per step"].idxmax()  # a row of that table
    fwd = kernels[kernels["phase"] == "forward"].sort_values("ms_per_step")
    both = kernels[kernels["phase"].isin(["forward", "backward"])].groupby("name")["ms_per_step"].sum()
    is_mm = kernels["name"].str.contains(MATMUL, case=False, regex=True)
    train = kernels["phase"].isin(["forward", "backward", "optimizer"])
    inference = kernels["phase"] == "inference"
    mm_train = kernels[train & is_mm]["ms_per_step"].sum() / kernels[train]["ms_per_step"].sum()
    mm_inf = kernels[inference & is_mm]["ms_per_step"].sum() / kernels[inference]["ms_per_step"].sum()
    notable = non_matmul_shares(kernels, "forward")
    stages = rows[(rows["kind"] == "attention_stage") & (rows["phase"] == "forward")].set_index("name")["ms_per_step"]
    ooms = frame[frame["status"] == "oom"]
    parts = [
        f"Profiled with {tool}"
        + ("" if tool.startswith("Nsight") else " (Nsight Systems cannot make reports on our GPU machines)")
        + f"; discussed at {size}, "
        f"context {context}, batch {int(rows['batch_size'].iloc[0])}, {rows['precision'].iloc[0]}. "
        + (f"Out of memory: {', '.join(f'{s} at {c}' for s, c in zip(ooms['size'], ooms['context_length']))}."
           if len(ooms) else "Every size and context length of the grid ran."),
        f"(a) The kernels of one forward pass add up to {q.cell('forward kernels (ms)', point)} ms; the harness "
        f"timed {q.cell('forward harness (ms)', point)} ms for the same forward pass (synchronized wall time, which "
        f"also counts launch gaps and Python overhead).",
        f"(b) The kernel with the most time in the forward pass is `{fwd['name'].iloc[-1][:80]}` "
        f"({top_kernels.quote('share of phase', top)} of forward time), launched "
        f"{top_kernels.quote('calls per step', top)} times per forward pass. Over forward and backward together the "
        f"top kernel is `{both.idxmax()[:80]}`"
        + (", the same one." if both.idxmax() == fwd["name"].iloc[-1] else ", a different one."),
        f"(c) In the forward pass, kernels other than matrix multiplications take {notable.sum():.0%} of the kernel "
        f"time; those with at least {NOTABLE:.0%} of it: "
        + (", ".join(f"`{n[:60]}` ({v:.1%})" for n, v in notable[notable >= NOTABLE].items()) or "none") + ".",
        f"(d) Matrix multiplications take {mm_train:.0%} of the kernel time of a full training step (with AdamW, "
        f"whose elementwise kernels add {q.cell('optimizer kernels (ms)', point)} ms) against {mm_inf:.0%} of "
        f"inference.",
    ]
    parts.append(_attention_paragraph(rows, stages, get_config(size).head_dim))
    # (a) is the grid's cells; the other answers are sums over the profile rows (and (b) the top-kernels table)
    kernels = moved(ctx, "profile_kernels", "nsys_profile: the kernel summaries", ("size", "context", "phase"))
    return Section([*parts, ctx.table("profile_grid"), *kernels], q.table, [parts[1]],
                   q.derived)


NOTABLE = 0.01  # (c) names the non-matmul kernels with at least this share of the phase's kernel time


def non_matmul_shares(kernels, phase: str):
    """(c): each non-matmul kernel's share of the kernel time of `phase` (the handout asks about the forward
    pass), largest first; their sum is the non-matmul share of that phase."""
    rows = kernels[kernels["phase"] == phase]
    is_mm = rows["name"].str.contains(MATMUL, case=False, regex=True)
    shares = rows[~is_mm].groupby("name")["ms_per_step"].sum() / rows["ms_per_step"].sum()
    return shares.sort_values(ascending=False)


def _attention_paragraph(rows, stages, head_dim: int) -> str:
    """(e): the attention's matrix products against its softmax, per forward pass. With the kernels of each
    stage recorded, the GEMM kernels alone against the softmax kernels; else the stage ranges, whose 'scores'
    also holds the scaling and masking passes, so their ratio only bounds the GEMMs' from above."""
    # Per attention layer: QK^T and PV are 2·2·B·T²·d_head FLOPs per head; the softmax about 5 per score.
    flop_ratio = (4 * head_dim) / 5
    flops = (f"while the products do about {flop_ratio:.0f}× the softmax's FLOPs (4·d_head against ~5 operations "
             f"per score, d_head = {head_dim})")
    by_class = attention_kernels(rows)
    if by_class is not None:
        gemm = by_class.get("GEMM", 0).sum()
        softmax = by_class.get("softmax", 0).sum()
        other = by_class.get("other", 0).sum()
        text = (f"(e) Inside attention, per forward pass, the GEMM kernels (scores and final matmul) take "
                f"{gemm:.3f} ms and the softmax kernels {softmax:.3f} ms: a time ratio of {gemm / softmax:.2f}, {flops}. "
                f"The attention's other kernels (scaling, masking, copies) take {other:.3f} ms more"
                + (f", {other / softmax:.1f}× the softmax's own time." if softmax else "."))
        ratio, bound = gemm / softmax, ""
    elif {"softmax", "scores", "final matmul"} <= set(stages.index):
        matmul_ms = stages["scores"] + stages["final matmul"]
        ratio, bound = matmul_ms / stages["softmax"], "at least "
        text = (f"(e) Inside attention the softmax range takes {stages['softmax']:.3f} ms per forward pass against "
                f"{matmul_ms:.3f} ms for the scores and final-matmul ranges: a time ratio of at most {ratio:.2f}, "
                f"{flops}. At most: the scores range also holds the scaling and masking passes, so the GEMMs alone "
                f"take less; their own time needs the per-stage kernel rows, pending: rule `profile` (its rows now "
                f"record each stage's kernels; these rows predate that).")
    else:
        return "(e) The attention stages were not profiled in this run."
    per_flop = flop_ratio / ratio
    if per_flop > 1:
        text += (f" Per FLOP the softmax is {bound}{per_flop:.1f}× slower: it reads and writes the whole T×T matrix with a "
                 f"few operations per element, so it is bound by memory traffic, while the products run on the "
                 f"matrix units.")
    return text


# ---- 2026 §2.1.4 nsys_profile: two sizes x power-of-two contexts above 128 (results/profile_2026.csv) -------------

def profile_2026(frame: pd.DataFrame) -> NumericTable:
    """Per (size, context): the harness's synchronized time of each phase (ms per step) and the top forward
    kernel's share of the forward kernel time; OOM where the point did not fit."""
    records, status = [], {}
    phases = ["forward", "backward", "optimizer", "inference"]
    for (size, context), rows in frame.groupby(["size", "context_length"], sort=False):
        record = {"size": str(size), "context": int(context)}
        harness = rows[rows["kind"] == "harness"].set_index("phase")["ms_per_step"]
        kernels = rows[(rows["kind"] == "kernel") & (rows["phase"] == "forward")]
        for phase in phases:
            record[f"{phase} (ms)"] = float(harness.get(phase, float("nan")))
        record["top forward kernel share"] = (kernels["ms_per_step"].max() / kernels["ms_per_step"].sum()
                                              if len(kernels) else float("nan"))
        if (rows["status"] == "oom").any():
            for header in [*(f"{p} (ms)" for p in phases), "top forward kernel share"]:
                status.setdefault(header, {})[len(records)] = "OOM"
        records.append(record)
    headers = [*(f"{p} (ms)" for p in phases), "top forward kernel share"]
    data = pd.DataFrame(records, columns=["size", "context", *headers])
    return NumericTable(data, (Col("size"), Col("context"), *(Col(h, ".2f") for h in headers[:-1]),
                               Col(headers[-1], ".1%")), status)


def render_profile_2026(ctx: Context) -> Section:
    frame = ctx.frame("profile_2026")
    q = Quotes(ctx.numeric("profile_2026"))
    parts = []
    for size in dict.fromkeys(q.frame["size"]):
        fits = q.frame[(q.frame["size"] == size) & q.frame["forward (ms)"].notna()].sort_values("context")
        chosen = fits.tail(3)
        if not len(chosen):
            parts.append(f"{size}: no context fits.")
            continue
        longest = chosen.index[-1]
        kernels = frame[(frame["size"] == size) & (frame["context_length"] == int(q.frame["context"][longest]))
                        & (frame["kind"] == "kernel") & (frame["phase"] == "forward")]
        top = kernels.loc[kernels["ms_per_step"].idxmax()] if len(kernels) else None
        which = ("the three longest power-of-two contexts that fit are" if len(chosen) == 3 else
                 f"only {('one', 'two')[len(chosen) - 1]} of the profiled contexts {('fits', 'fit')[len(chosen) - 1]}:")
        text = (f"{size} (2026 table): {which} "
                + ", ".join(q.cell("context", i) for i in chosen.index) + "; at "
                f"{q.cell('context', longest)} tokens the forward pass takes {q.cell('forward (ms)', longest)} ms, "
                f"the backward {q.cell('backward (ms)', longest)} ms and the optimizer step "
                f"{q.cell('optimizer (ms)', longest)} ms (synchronized wall time).")
        if top is not None:
            text += (f" The forward pass's largest kernel there takes {q.cell('top forward kernel share', longest)} "
                     f"of its kernel time ({top['name'][:80]}).")
        parts.append(text)
    tool = frame["tool"].dropna()
    head = (f"Profiled with {tool.iloc[0] if len(tool) else 'the PyTorch profiler'} (batch "
            f"{int(frame['batch_size'].iloc[0])}, {frame['precision'].iloc[0]}); contexts past the longest that fits "
            "are out-of-memory rows.")
    return Section([head, *parts, appendix("nsys_profile (2026): every size and context", ctx.table("profile_2026"))], q.table, parts, q.derived,
                   wording=("2026", "3"))


PROFILE_2026 = Table("profile_2026", "profile_2026", profile_2026,
                     "2026 §2.1.4: synchronized phase times (ms per step) per 2026 size and context")

DELIVERABLES = [
    Deliverable("1.1.4 (a–e) nsys_profile: kernel summaries per range", "profile", render_profile, ("profile",),
                tables=(Table("profile_kernels", "profile", profile_kernels,
                              "Top kernels per phase (PyTorch profiler), per training step"),
                        Table("profile_grid", "profile", profile_grid,
                              "Kernel time per phase for every size and context length (PyTorch profiler)"))),
    Deliverable("2026 §2.1.4 nsys_profile: two 2026 sizes at the three longest power-of-two contexts that fit",
                "profile_2026", render_profile_2026, ("profile_2026",), tables=(PROFILE_2026,)),
]
