"""results/writeup.md: one section per handout deliverable, in handout order.

Every number in the text is computed here from a results file; a deliverable whose producing rule is
not built yet shows a visible 'pending' line naming it.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from cs336_systems.distributed.sharded_optimizer import GATHER_BUCKET_MB
from cs336_systems.model import forward_flops, get_config
from cs336_systems.report.tables import SIZE_ORDER, compile_scope, round_medians


@dataclass(eq=False)  # hashed by identity, so frame() can be cached per context
class Context:
    results: Path
    figures: Path
    out_dir: Path
    anchors: dict

    @functools.cache
    def frame(self, name: str) -> pd.DataFrame | None:
        path = self.results / f"{name}.csv"
        return pd.read_csv(path) if path.exists() else None

    def log(self, name: str) -> str:
        path = self.results / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def table(self, name: str) -> str:
        path = self.results / "tables" / f"{name}.md"
        return path.read_text() if path.exists() else f"_table {name} not built_\n"

    def figure(self, name: str, caption: str) -> str:
        path = self.figures / f"{name}.png"
        if not path.exists():
            return f"_figure {name} not built_\n"
        rel = Path(*([".."] * len(self.out_dir.resolve().relative_to(Path.cwd().resolve()).parts)), path)
        return f"![{caption}]({rel.as_posix()})\n"


@dataclass(frozen=True)
class Deliverable:
    section: str  # handout numbering and problem name
    rule: str | None  # the Snakemake rule that produces its data; None while nobody has built it
    render: Callable[[Context], str] | None = None
    data: tuple[str, ...] = ()  # results/<name>.csv files the section is computed from
    cuda_only: str | None = None  # why the data cannot be measured without a GPU, if it cannot


def _steps(frame: pd.DataFrame, **where) -> pd.DataFrame:
    rows = frame[(frame["phase"] == "step") & (frame["status"] == "ok")]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return rows


def _by_size(rows: pd.DataFrame, column: str) -> pd.Series:
    series = rows.set_index("size")[column]
    return series.reindex([s for s in SIZE_ORDER if s in series.index])


def render_e2e(ctx: Context) -> str:
    frame = ctx.frame("e2e")
    rows = frame[(frame["precision"] == "fp32") & (frame["attention"] == "naive") & (frame["status"] == "ok")
                 & (frame["mode"] == "forward_backward")]
    fwd = _by_size(rows[rows["phase"] == "forward"], "mean_ms")
    bwd = _by_size(rows[rows["phase"] == "backward"], "mean_ms")
    cv = (rows["std_ms"] / rows["mean_ms"]).max() * 100
    ratio = bwd / fwd
    ooms = sorted(set(frame.loc[frame["status"] == "oom", "size"]))
    text = (
        f"Batch {int(rows['batch_size'].iloc[0])}, context {int(rows['context_length'].iloc[0])}, "
        f"{int(rows['warmup'].iloc[0])} warm-up and {int(rows['steps'].iloc[0])} measured steps, float32. "
        f"The forward pass takes {fwd.iloc[0]:.1f} ms for {fwd.index[0]} and {fwd.iloc[-1]:.1f} ms for "
        f"{fwd.index[-1]}; the backward pass takes {ratio.min():.2f}–{ratio.max():.2f}× the forward time, "
        f"as expected from its two matrix products per forward one. Once warmed up the steps are steady: "
        f"the standard deviation is at most {cv:.1f}% of the mean."
    )
    if ooms:
        text += f" Out of memory: {', '.join(ooms)}."
    return "\n\n".join([text, ctx.table("e2e_timing"), ctx.figure("e2e_timing", "timings")])


def render_warmup(ctx: Context) -> str:
    frame = ctx.frame("e2e_warmup")
    rows = _steps(frame)
    warmups = sorted(set(rows["warmup"]))
    cold, warm = rows[rows["warmup"] == warmups[0]], rows[rows["warmup"] == warmups[-1]]
    mean_cold, mean_warm = _by_size(cold, "mean_ms"), _by_size(warm, "mean_ms")
    std_cold, std_warm = _by_size(cold, "std_ms"), _by_size(warm, "std_ms")
    worst = (mean_cold / mean_warm).idxmax()
    text = (
        f"With {warmups[0]} warm-up steps the mean step time of {worst} is {mean_cold[worst]:.1f} ms "
        f"(std {std_cold[worst]:.1f} ms) against {mean_warm[worst]:.1f} ms (std {std_warm[worst]:.1f} ms) with "
        f"{warmups[-1]}: {mean_cold[worst] / mean_warm[worst]:.2f}× the time, with a standard deviation "
        f"{std_cold[worst] / max(std_warm[worst], 1e-9):.1f}× as large. Each point here ran "
        f"in a fresh process, so its first step pays the one-time costs (CUDA context and cuBLAS handle creation, "
        f"kernel selection and loading, the caching allocator growing to its working set); later steps reuse all "
        f"of them, which is why one or two warm-up steps already bring the mean close to the fully warmed value."
    )
    return "\n\n".join([text, ctx.table("e2e_warmup"), ctx.figure("e2e_warmup", "warm-up")])


def render_mixed_precision(ctx: Context) -> str:
    frame = ctx.frame("e2e")
    rows = _steps(frame, mode="forward_backward", attention="naive")
    fp32, bf16 = _by_size(rows[rows["precision"] == "fp32"], "median_ms"), _by_size(
        rows[rows["precision"] == "bf16"], "median_ms")
    speedup = (fp32 / bf16).dropna()
    text = (
        f"bf16 autocast speeds the forward+backward step up by {speedup.iloc[0]:.2f}× for {speedup.index[0]} "
        f"and {speedup.iloc[-1]:.2f}× for {speedup.index[-1]} (range {speedup.min():.2f}–{speedup.max():.2f}×). "
    )
    if speedup.is_monotonic_increasing:
        text += (" The gain grows with model size: small models spend much of their step in elementwise kernels "
                 "and launch overhead, which autocast does not speed up (and adds casts to), while large ones are "
                 "dominated by matrix products that run on bf16 tensor cores instead of the float32 units.")
    else:
        text += (f" The gain is not monotone in model size (largest for {speedup.idxmax()}), so beyond matrix-product "
                 "speed the elementwise work and the casts autocast adds matter at these sizes.")
    return "\n\n".join([text, ctx.table("mixed_precision")])


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


def render_compile(ctx: Context) -> str:
    frame = ctx.frame("e2e_compile")
    rows = _steps(frame)
    # one log per size (compile_timing_size); older runs wrote a single compile_timing log
    logs = [ctx.log("compile_timing"), *(ctx.log(f"compile/{size}") for size in frame["size"].unique())]
    affected = set().union(*(recompile_limited(log) for log in logs))
    rows = rows[[(size, mode) not in affected for size, mode in zip(rows["size"], rows["mode"])]]
    rows = rows.assign(scope=compile_scope)
    eager = rows[rows["scope"] == "none"].set_index(["size", "attention", "mode"])["median_ms"]
    compiled = rows[rows["scope"] == "blocks"].set_index(["size", "attention", "mode"])["median_ms"]
    speedup = (eager / compiled).dropna()
    parts = [
        f"Compiling each Transformer block with torch.compile changes the step time by "
        f"{speedup.min():.2f}–{speedup.max():.2f}× (eager over compiled; median {speedup.median():.2f}×): "
        f"the compiler fuses the elementwise work (RMSNorm, RoPE, SiLU gating, softmax and masking) into few "
        f"kernels, while the matrix products, which dominate large models, stay cuBLAS calls."
    ]
    if affected:
        parts.append(
            f"Left out above: {', '.join(f'{s} {m}' for s, m in sorted(affected))}. The run's log shows torch.compile "
            f"hitting its recompile limit before these points, so their 'compiled' time is partly eager (the "
            f"table still lists them). The harness now resets the compiler before every point.")
    ooms = frame[frame["status"] == "oom"]
    if len(ooms):
        cases = sorted({(size, mode) for size, mode in zip(ooms["size"], ooms["mode"])})
        parts.append(f"Out of memory on the {frame['device_name'].iloc[0]}: "
                     f"{', '.join(f'{s} {m}' for s, m in cases)} (eager and/or compiled, as the table shows).")
    commits = rows.set_index(["size", "attention", "mode", "scope"])["git_commit"].str[:7]
    for scope in ("model", "model-cudagraphs"):
        other = rows[rows["scope"] == scope].set_index(["size", "attention", "mode"])["median_ms"]
        versus = (compiled / other).dropna()
        if len(versus):
            runs = {(commits.get((*key, "blocks")), commits.get((*key, scope))) for key in versus.index}
            note = ("" if all(a == b for a, b in runs) else
                    " These pairs come from different runs (block-compiled at "
                    + ", ".join(sorted({a for a, _ in runs})) + f", {scope} at "
                    + ", ".join(sorted({b for _, b in runs})) + "): the ratio carries the difference between "
                    "the two runs as well.")
            parts.append(f"With the {COMPILE_SCOPE_NAMES[scope]} instead, the step takes "
                         f"{(1 / versus).min():.2f}–{(1 / versus).max():.2f}× the time of the block-compiled "
                         f"one (median {(1 / versus).median():.2f}×; "
                         + ", ".join(f"{size} {mode}" for size, _, mode in versus.index) + f").{note}")
    per_layer = _compiled_forward_per_layer(rows[rows["scope"].isin(["none", "blocks"])])
    if per_layer:
        parts.append(per_layer)
    anchor = ctx.anchors.get("xl_train_step_sdpa_ms")
    targets = rows[(rows["size"] == "xl") & (rows["attention"] == "sdpa") & (rows["mode"] == "train_step")
                   & rows["compile"]]
    for _, target in targets.iterrows() if anchor else []:
        ms, mfu = target["median_ms"], target["mfu"]
        optimizer = target.get("optimizer", "foreach")  # runs from before the column used foreach
        parts.append(
            f"Target case (xl, batch 4, context 512, bf16, full training step, SDPA attention, "
            f"{COMPILE_SCOPE_NAMES[target['scope']]}, {OPTIMIZER_NAMES.get(optimizer, optimizer)}): "
            f"{ms:.1f} ms per step (median; mean {target['mean_ms']:.1f} ± {target['std_ms']:.1f}), "
            f"MFU {mfu:.1%} of the bf16 dense peak; that is {ms / anchor['value']:.2f}× the {anchor['value']} ms "
            f"anchor ({anchor['source']})."
        )
    return "\n\n".join([*parts, ctx.table("compile_timing"), ctx.figure("compile_timing", "compile")])


def _compiled_forward_per_layer(rows: pd.DataFrame) -> str:
    """Compiled forward time per layer by size, set against the matrix FLOPs per layer: a time per layer
    that stays nearly flat while the work per layer grows points to a cost that does not scale with it."""
    forward = rows[(rows["mode"] == "forward") & rows["compile"]].drop_duplicates("size")
    if len(forward) < 2:
        return ""
    forward = forward.set_index("size").reindex([s for s in SIZE_ORDER if s in set(forward["size"])])
    ms = forward["median_ms"] / forward["num_layers"]
    flops = pd.Series({size: forward_flops(get_config(size), int(row["batch_size"]), int(row["context_length"]))
                       / row["num_layers"] for size, row in forward.iterrows()})
    text = ("Compiled forward time per layer (median step ÷ layers): "
            + ", ".join(f"{size} {value:.2f} ms" for size, value in ms.items())
            + f"; the matrix FLOPs per layer grow {flops.max() / flops.min():.1f}× over the same sizes.")
    if ms.max() / ms.min() < flops.max() / flops.min() / 3:
        text += (f" The time per layer varies only {ms.max() / ms.min():.1f}× between sizes, so a cost per layer "
                 f"that does not scale with the work weighs heavily up to the larger sizes; our hypothesis, not yet "
                 f"profiled, is host work per compiled block (guards, the generated Python, kernel launches).")
    return text


COMPILE_SCOPE_NAMES = {"blocks": "each block compiled", "model": "whole model compiled",
                       "model-cudagraphs": "whole model compiled with CUDA graphs"}
OPTIMIZER_NAMES = {"foreach": "our multi-tensor AdamW", "fused": "our fused Triton AdamW",
                   "torch_fused": "torch's fused AdamW"}


def render_optimizer(ctx: Context) -> str:
    frame = ctx.frame("optimizer")
    rows = frame[(frame["phase"] == "optimizer") & (frame["status"] == "ok")]
    wide = rows.pivot_table(index="size", columns="optimizer", values="median_ms", observed=True)
    wide = wide.reindex([s for s in SIZE_ORDER if s in wide.index])
    parts = [f"Each row times the optimizer phase of an eager {frame['precision'].iloc[0]} training step "
             f"(the parameters, gradients and AdamW state are fp32 in every case) on the "
             f"{frame['device_name'].iloc[0]}. `foreach` is our AdamW with one multi-tensor operation per step "
             f"of the formula, about 20 passes over memory; `fused` is our AdamW with one Triton kernel per "
             f"tensor (`kernels/adamw_triton.py`), 7 passes; `torch_fused` is torch.optim.AdamW(fused=True)."]
    if {"foreach", "fused"} <= set(wide.columns):
        ratio = (wide["foreach"] / wide["fused"]).dropna()
        if len(ratio):
            largest = ratio.index[-1]
            parts.append(f"The fused kernel takes the step from {wide.loc[largest, 'foreach']:.1f} to "
                         f"{wide.loc[largest, 'fused']:.1f} ms for the {largest} model "
                         f"({ratio[largest]:.2f}× faster; {ratio.min():.2f}–{ratio.max():.2f}× over all sizes).")
    if {"fused", "torch_fused"} <= set(wide.columns):
        ratio = (wide["fused"] / wide["torch_fused"]).dropna()
        if len(ratio):
            parts.append(f"Ours over torch's fused AdamW: {ratio.min():.2f}–{ratio.max():.2f}× "
                         f"({', '.join(f'{size} {r:.2f}×' for size, r in ratio.items())}).")
    ooms = sorted(set(frame.loc[frame["status"] == "oom", "size"]), key=SIZE_ORDER.index)
    if ooms:
        parts.append(f"Out of memory: {', '.join(ooms)} (a training step of that size needs more than the device has).")
    return "\n\n".join([*parts, ctx.table("optimizer")])


def render_attention(ctx: Context) -> str:
    frame = ctx.frame("attention")
    eager = frame[(frame["impl"] == "eager") & (frame["phase"] == "forward")]
    ooms = eager[eager["status"] == "oom"].sort_values(["seq_len", "head_dim"])
    ok = eager[eager["status"] == "ok"]
    parts = []
    if ooms.empty:
        parts.append("No configuration of the grid ran out of memory on this device.")
    else:
        first = ooms.iloc[0]
        square = first["square_matrix_bytes"] / 2**30
        parts.append(
            f"The smallest configuration that runs out of memory is d={first['head_dim']}, "
            f"seq={first['seq_len']}. By the formulas (batch {first['batch']}, float32), each "
            f"(batch, seq, seq) matrix takes {square:.1f} GiB: autograd keeps Q, K, V and the softmax output P "
            f"for backward ({first['saved_for_backward_bytes'] / 2**30:.1f} GiB), the forward peaks with S and P "
            f"alive together ({first['forward_peak_bytes'] / 2**30:.1f} GiB) and the backward with P, dP and dS "
            f"({first['backward_peak_bytes'] / 2**30:.1f} GiB).")
    if len(ok):
        largest = ok.sort_values("seq_len").iloc[-1]
        smaller = ok[(ok["head_dim"] == largest["head_dim"]) & (ok["seq_len"] < largest["seq_len"])]
        if len(smaller) and smaller["memory_before_backward_mib"].min() > 0:  # measured on CUDA only
            prev = smaller.sort_values("seq_len").iloc[-1]
            growth = largest["memory_before_backward_mib"] / prev["memory_before_backward_mib"]
            factor = largest["seq_len"] / prev["seq_len"]
            parts.append(
                f"Memory saved for backward grows quadratically: from seq {prev['seq_len']} to {largest['seq_len']} "
                f"(×{factor:.0f}) the memory in use before backward grows ×{growth:.1f} "
                f"({prev['memory_before_backward_mib']:.0f} → {largest['memory_before_backward_mib']:.0f} MiB at "
                f"d={largest['head_dim']}), while the inputs grow only ×{factor:.0f}.")
    parts.append(
        "The seq² term disappears if the softmax matrix is never stored: FlashAttention-2 computes attention "
        "tile by tile with an online softmax, keeps only the per-row logsumexp L (seq floats) for backward "
        "and recomputes P from Q, K and L there, trading a second pass of matrix products for O(seq) memory.")
    return "\n\n".join([*parts, ctx.table("attention"), ctx.figure("attention_memory", "attention memory")])


def render_attention_compile(ctx: Context) -> str:
    frame = ctx.frame("attention")
    ok = frame[frame["status"] == "ok"].pivot_table(index=["head_dim", "seq_len", "phase"], columns="impl",
                                                    values="mean_ms")
    ok = ok.dropna()
    speedup = ok["eager"] / ok["compiled"]
    fwd, bwd = speedup.xs("forward", level="phase"), speedup.xs("backward", level="phase")
    oom = frame[frame["status"] == "oom"].groupby("impl")[["head_dim", "seq_len"]].apply(
        lambda g: set(map(tuple, g.values)))
    text = (f"Speed-up of torch.compile over eager (eager time ÷ compiled time): forward "
            f"{fwd.min():.2f}–{fwd.max():.2f}× (median {fwd.median():.2f}×), backward {bwd.min():.2f}–{bwd.max():.2f}× "
            f"(median {bwd.median():.2f}×). The compiler fuses the scaling, the softmax and its gradient into "
            f"generated kernels; the matrix products stay cuBLAS calls and the seq² matrices are still stored.")
    if len(oom):
        same = oom.get("eager", set()) == oom.get("compiled", set())
        text += (" The same configurations run out of memory with and without compilation." if same else
                 f" Out of memory: eager {sorted(oom.get('eager', set()))}, compiled {sorted(oom.get('compiled', set()))}.")
    return "\n\n".join([text, ctx.table("attention_compile")])


def render_flash_correctness(ctx: Context) -> str:
    frame = ctx.frame("flash_correctness")
    passed = int((frame["outcome"] == "passed").sum())
    skipped = frame.loc[frame["outcome"] == "skipped", "test"]
    aside = f" ({len(skipped)} skipped: {', '.join(skipped)})" if len(skipped) else ""
    text = (f"{passed} of {len(frame)} tests of `tests/test_flash.py` passed{aside} on "
            f"{frame['device_name'].iloc[0]}: "
            "O, L, dQ, dK and dV of both implementations against a float64 reference, causal and not, lengths "
            "from 1 to 100 (up to 1000 on a GPU) and rectangular cases, with and without a heads dimension, float32 "
            "(relative error < 1e-4) and 16-bit (error within 2× of PyTorch's own attention in the same dtype; "
            "bfloat16 on a GPU only).")
    return "\n\n".join([text, ctx.table("flash_correctness")])


def render_flash_sweep(ctx: Context) -> str:
    frame = ctx.frame("flash_sweep")
    ok = frame[(frame["status"] == "ok") & (frame["pass"] == "forward_backward")]
    wide = ok.pivot_table(index=["dtype", "head_dim", "seq_len"], columns="provider", values="median_ms")
    parts = []
    if {"flash_triton", "naive"} <= set(wide.columns):
        both = wide[["flash_triton", "naive"]].dropna()
        ratio = both["naive"] / both["flash_triton"]
        parts.append(f"Naive PyTorch attention takes {ratio.min():.3g}–{ratio.max():.3g}× the time of our Triton "
                     f"FlashAttention-2 (forward+backward) where both run; naive attention runs out of "
                     f"memory at {int((frame[(frame['provider'] == 'naive')]['status'] == 'oom').sum() // 3)} of the "
                     f"grid's cases, ours at "
                     f"{int((frame[(frame['provider'] == 'flash_triton')]['status'] == 'oom').sum() // 3)}.")
    if {"flash_triton", "sdpa_flash"} <= set(wide.columns):
        both = wide[["flash_triton", "sdpa_flash"]].dropna()
        ratio = both["flash_triton"] / both["sdpa_flash"]
        faster = int((ratio < 1).sum())
        seqs = ratio.index.get_level_values("seq_len")
        # The shortest length from which ours is faster at every longer length and head dim.
        behind = seqs[ratio.values >= 1]
        crossover = seqs[seqs > behind.max()].min() if len(behind) else seqs.min()
        parts.append(f"Against PyTorch SDPA's flash backend (16-bit only) ours takes {ratio.min():.2f}–"
                     f"{ratio.max():.2f}× its time (median {ratio.median():.2f}×) and is faster in {faster} of "
                     f"{len(ratio)} cases.")
        if crossover == crossover:  # not NaN: some length from which ours always wins
            long = ratio[seqs >= crossover]
            ours = frame[(frame["provider"] == "flash_triton") & (frame["status"] == "ok")]
            short_backward = ours[(ours["pass"] == "backward") & (ours["seq_len"] <= 1024)]["median_ms"].median()
            parts[-1] += (f" From {crossover} tokens on ours is faster at every head dim (median "
                          f"{long.median():.2f}× SDPA flash's time). Below that, with batch 1 and one head, both "
                          f"are bound by fixed per-call costs, and ours pays more of them: at ≤ 1024 tokens our "
                          f"backward alone takes a median {short_backward:.2f} ms "
                          f"(three launches through Triton's Python launcher, two of them autotuned, where SDPA "
                          f"makes one call from C++).")
        else:
            parts[-1] += " Ours is not faster at every head dim at any length of the grid."
    parts.append(_flash_float32(frame, wide))
    parts.append(_flash_coverage(ctx, frame))
    best = frame[(frame["provider"] == "flash_triton") & (frame["status"] == "ok")].sort_values("tflops").iloc[-1]
    parts.append(f"Our best throughput is {best['tflops']:.0f} TFLOP/s ({best['pass']}, {best['dtype']}, "
                 f"d={best['head_dim']}, seq={best['seq_len']}).")
    return "\n\n".join([*parts, ctx.figure("flash_latency", "latency"), ctx.figure("flash_tflops", "TFLOP/s"),
                         ctx.table("flash_sweep")])


def _flash_float32(frame: pd.DataFrame, wide: pd.DataFrame) -> str:
    """How ours does where PyTorch's fused backends do not run (float32), and its backward over forward."""
    ours = frame[(frame["provider"] == "flash_triton") & (frame["status"] == "ok") & (frame["seq_len"] >= 8192)]
    by_pass = ours.pivot_table(index=["dtype", "head_dim", "seq_len"], columns="pass", values="median_ms")
    text = []
    if "fp32" in set(wide.index.get_level_values("dtype")) and {"flash_triton", "naive"} <= set(wide.columns):
        both = wide.xs("fp32", level="dtype")[["flash_triton", "naive"]].dropna()
        ratio = (both["naive"] / both["flash_triton"])[both.index.get_level_values("seq_len") >= 8192]
        if len(ratio):
            fp32 = frame[(frame["dtype"] == "fp32") & (frame["provider"] == "flash_triton")]
            commits = ", ".join(sorted(fp32["git_commit"].str[:7].unique()))
            dots = (", ".join(sorted(fp32["float32_dot"].dropna().unique())) if "float32_dot" in fp32 else "")
            text.append(f"In float32 (our kernels at {commits}" + (f", {dots} dots" if dots else "")
                        + f"; SDPA's flash and cuDNN backends take 16-bit inputs only) naive attention takes "
                        f"{ratio.min():.2f}–{ratio.max():.2f}× our forward+backward time from 8192 tokens on.")
    if {"forward", "backward"} <= set(by_pass.columns):
        ratio = (by_pass["backward"] / by_pass["forward"]).groupby(level="dtype").median()
        text.append("From 8192 tokens on our backward takes a median "
                    + ", ".join(f"{r:.1f}× our forward in {dtype}" for dtype, r in ratio.items())
                    + " (FlashAttention-2's backward does 2.5× the forward's matrix FLOPs: five products "
                      "against two).")
    return " ".join(text)


def _flash_coverage(ctx: Context, frame: pd.DataFrame) -> str:
    """Which (dtype, head dim) sweeps have rows, and where the missing ones' logs are."""
    dims = frame.groupby("dtype")["head_dim"].unique()
    every = sorted(frame["head_dim"].unique())
    measured = (f"{dtype} at d = {', '.join(map(str, sorted(d)))}" for dtype, d in dims.items())
    text = "Measured: " + "; ".join(measured) + "."
    for dtype, present in dims.items():
        for d in (d for d in every if d not in present):
            name = f"flash_benchmark/{dtype}_d{d}"
            text += f" {dtype} at d = {d} has no rows" + (
                f": its run did not finish (`logs/{name}.log` shows how far it got)." if ctx.log(name) else ".")
    return text


def _fitting(rows: pd.DataFrame, limit: int = 232448) -> str:
    """Which d=128 tiles fit in the H100's shared memory (227 KiB per block), per kernel."""
    d128 = rows[rows["head_dim"] == 128]
    return "; ".join(
        f"{kernel} " + ", ".join(f"{r.outer}×{r.inner}/{r.warps}w/{r.stages}s" for r in group.itertuples()
                                 if r.shared_bytes <= limit)
        for kernel, group in d128.groupby("kernel", sort=False)) or "none measured"


def render_flash_resources(ctx: Context) -> str:
    frame = ctx.frame("flash_resources")
    ok = frame[frame["status"] == "ok"]
    parts = [f"Each kernel compiled by Triton {frame['triton_version'].iloc[0]} for {frame['arch'].iloc[0]} (H100 "
             f"and H200) on a machine without a GPU; `ptxas -v` reports the registers per thread and the bytes a "
             f"thread spills to local memory, which lives in DRAM behind the L1 cache. "
             f"`python -m cs336_systems.bench.kernel_resources` compiles any other tile the same way."]
    for (dtype, dot), rows in ok.groupby(["dtype", ok.get("dot", pd.Series("", index=ok.index))], sort=False):
        spilled = rows[rows["spill_store_bytes"] > 0]
        label = f"{dtype} ({dot} dots)" if dtype == "fp32" and dot else dtype
        text = f"{label}: {len(spilled)} of {len(rows)} compiled configs spill"
        if len(spilled):
            worst = spilled.sort_values("spill_store_bytes").iloc[-1]
            clean_dims = sorted(set(rows["head_dim"]) - set(spilled["head_dim"]))
            text += (f", the most {worst['spill_store_bytes']:,} B per thread ({worst['kernel']}, "
                     f"{worst['outer']}×{worst['inner']} with {worst['warps']} warps, d={worst['head_dim']})")
            if clean_dims:
                text += f"; none at d = {', '.join(map(str, clean_dims))}"
        parts.append(text + ".")
    if "dot" in ok and {"ieee", "tf32x3"} <= set(ok["dot"]):
        fp32 = ok[ok["dtype"] == "fp32"]
        spills = fp32.groupby("dot")["spill_store_bytes"]
        parts.append(
            f"Float32 with IEEE dots (FMAs on the CUDA cores, operands held in registers): "
            f"{(spills.get_group('ieee') > 0).sum()} of {spills.get_group('ieee').size} configs spill, up to "
            f"{spills.get_group('ieee').max():,} B per thread. With tf32x3 dots (three TF32 tensor-core products "
            f"per dot, the kernels' float32 path now): {(spills.get_group('tf32x3') > 0).sum()} of "
            f"{spills.get_group('tf32x3').size}, up to {spills.get_group('tf32x3').max():,} B. tf32x3 stages "
            f"float32 operands in shared memory instead, so at d=128 only these float32 configs fit in the "
            f"H100's 227 KiB per block (the 2-stage ones are the float32-only tiles): "
            f"{_fitting(fp32[fp32['dot'] == 'tf32x3'])}.")
    errors = frame[frame["status"] != "ok"]
    if len(errors):
        parts.append(f"{len(errors)} configs did not compile (rows with status=error).")
    return "\n\n".join([*parts, ctx.table("flash_resources")])


def render_leaderboard(ctx: Context) -> str:
    frame = ctx.frame("flash_leaderboard")
    fb = frame[frame["pass"] == "forward_backward"].set_index("provider")["mean_ms"]
    parts = []
    if "flash_triton" in fb:
        text = f"Forward+backward of our Triton kernel: {fb['flash_triton']:.2f} ms"
        if "sdpa_flash" in fb:
            text += f", {fb['flash_triton'] / fb['sdpa_flash']:.2f}× SDPA flash ({fb['sdpa_flash']:.2f} ms)"
        if "sdpa_cudnn" in fb:
            text += f" and {fb['flash_triton'] / fb['sdpa_cudnn']:.2f}× SDPA cuDNN ({fb['sdpa_cudnn']:.2f} ms)"
        parts.append(text + ", all timed in the same run as the handout's test times them.")
    return "\n\n".join([*parts, ctx.table("flash_leaderboard")])


def render_allreduce(ctx: Context) -> str:
    frame = ctx.frame("allreduce")
    largest = frame[frame["size_mb"] == frame["size_mb"].max()]
    parts = []
    for backend, rows in largest.groupby("backend"):
        rows = rows.sort_values("world_size")
        parts.append(f"{backend}: {rows['size_mb'].iloc[0]:g} MB all-reduced in "
                     + ", ".join(f"{ms:.2f} ms with {n} processes ({bw:.1f} GB/s bus bandwidth)"
                                 for ms, n, bw in zip(rows["median_ms"], rows["world_size"], rows["busbw_gbps"])))
    smallest = frame[frame["size_mb"] == frame["size_mb"].min()]
    parts.append("At the smallest size the time is latency: "
                 + ", ".join(f"{b} × {n}: {ms:.3f} ms" for b, n, ms in
                             zip(smallest["backend"], smallest["world_size"], smallest["median_ms"]))
                 + ". Large messages are bandwidth-bound: bus bandwidth (what each link carries in a ring, "
                 "2(n−1)/n of the data) is the figure to compare across process counts.")
    return "\n\n".join(["; ".join(parts[:-1]) + ".", parts[-1], ctx.table("allreduce"),
                         ctx.figure("allreduce", "all-reduce")])


def _ddp_steps(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == "ok"].set_index(["precision", "config"])


def _ddp_summary(frame: pd.DataFrame, configs: list[str]) -> str:
    steps = _ddp_steps(frame)
    rounds = int(frame["rounds"].max()) if "rounds" in frame and frame["rounds"].notna().any() else 1
    lines = []
    for precision in sorted(set(frame["precision"])):
        cells = []
        for config in configs:
            if (precision, config) in steps.index:
                row = steps.loc[(precision, config)]
                spread = f", rounds {round_medians(row)}" if rounds > 1 else ""
                cells.append(f"{config} {row['step_median_ms']:.1f} ms{spread} (communication wait "
                             f"{row['communication_ms']:.1f} ms)")
        std = steps.loc[precision]["step_std_ms"].max() if precision in steps.index else float("nan")
        lines.append(f"{precision}: " + "; ".join(cells) + f". Step-to-step standard deviation up to {std:.1f} ms.")
    first = frame.iloc[0]
    repeats = (f"{rounds} interleaved rounds (every config once per round) of {first['warmup']} warm-up and "
               f"{first['steps']} measured steps; a time is the median over all measured steps, with the range "
               f"of the per-round medians" if rounds > 1 else
               f"{first['warmup']} warm-up and {first['steps']} measured steps; times are medians")
    setup = (f"Setup: {first['world_size']} ranks ({first['backend']}), model {first['size']}"
             f"{_ddp_compile_and_adamw(first)}, batch {first['batch_per_rank']} per rank, context "
             f"{first['context_length']}, {repeats}. "
             f"'Communication wait' is the time from the end of backward until the gradients are synchronised "
             f"(torch DDP synchronises inside backward, so its wait is part of its forward+backward time).")
    return setup + "\n\n" + "\n\n".join(lines)


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


def gradient_tensors(size: str) -> int:
    """How many gradient tensors (all-reduces for naive DDP) the model has; built on the meta device."""
    from cs336_systems.model import TransformerLM, get_config

    with torch.device("meta"):
        return sum(p.requires_grad for p in TransformerLM(get_config(size)).parameters())


def render_ddp_naive(ctx: Context) -> str:
    frame = ctx.frame("ddp_naive")
    parts = [_ddp_summary(frame, ["none", "naive", "flat", "torch_ddp"])]
    steps = _ddp_steps(frame)
    cost = allreduce_cost(ctx.frame("allreduce"))
    ok = frame[frame["status"] == "ok"]
    if cost is not None and len(ok):
        o, w = cost
        grad_bytes, tensors = ok["grad_mib"].iloc[0] * 2**20, gradient_tensors(ok["size"].iloc[0])
        waits = "; ".join(
            f"{p}: naive {steps.loc[(p, 'naive'), 'communication_ms']:.1f} ms, flat "
            f"{steps.loc[(p, 'flat'), 'communication_ms']:.1f} ms"
            for p in sorted(set(ok["precision"])) if {(p, "naive"), (p, "flat")} <= set(steps.index))
        parts.append(
            f"The gradients are {tensors} tensors, {grad_bytes / 2**30:.2f} GiB in float32. The all-reduce times of "
            f"2.1 fit t = o + bytes/w with o = {o * 1e6:.0f} µs and w = {w / 1e9:.0f} GB/s: one all-reduce of all "
            f"gradients should take {(o + grad_bytes / w) * 1e3:.1f} ms, and {tensors} separate ones "
            f"{(tensors * o + grad_bytes / w) * 1e3:.1f} ms if each paid o in full. Measured waits: {waits}. "
            f"Flat DDP also copies every gradient into one buffer and back, which the prediction leaves out.")
    shares = {p: steps.loc[(p, "naive"), "communication_ms"] / steps.loc[(p, "naive"), "step_ms"]
              for p in sorted(set(ok["precision"])) if (p, "naive") in steps.index}
    if shares:
        text = "Communication is " + ", ".join(f"{share:.0%} of naive DDP's step in {p}" for p, share in shares.items())
        if shares.get("bf16", 0) > shares.get("fp32", 1):
            text += (": the faster the computation, the larger the share of the step that waits for gradients, "
                     "which is what overlapping communication with backward (2.3) recovers")
        parts.append(text + ".")
    return "\n\n".join([*parts, ctx.table("ddp_naive")])


def render_ddp_individual(ctx: Context) -> str:
    frame = ctx.frame("ddp_individual")
    steps = _ddp_steps(frame)
    parts = [_ddp_summary(frame, ["individual", "naive", "torch_ddp"])]
    for precision in sorted(set(frame["precision"])):
        if not {(precision, c) for c in ("individual", "naive", "torch_ddp")} <= set(steps.index):
            continue
        ours, naive, torch_ddp = (steps.loc[(precision, c)] for c in ("individual", "naive", "torch_ddp"))
        parts.append(
            f"{precision}: overlapped-individual takes {ours['step_median_ms'] / torch_ddp['step_median_ms']:.2f}× "
            f"torch DDP's step. Its communication wait is {ours['communication_ms']:.1f} ms against naive's "
            f"{naive['communication_ms']:.1f} ms, but its forward+backward takes {ours['forward_backward_ms']:.1f} ms "
            f"against naive's {naive['forward_backward_ms']:.1f} ms (which communicates nothing during backward): "
            f"overlapping one all-reduce per gradient with the backward pass changes it by "
            f"{ours['forward_backward_ms'] - naive['forward_backward_ms']:+.1f} ms.")
        variants = [(c, label) for c, label in VARIANTS_OF_INDIVIDUAL if (precision, c) in steps.index]
        if variants:
            parts.append(f"{precision}, in the same run: " + "; ".join(
                f"{label}: step {steps.loc[(precision, c), 'step_median_ms']:.1f} ms "
                f"({steps.loc[(precision, c), 'step_median_ms'] / torch_ddp['step_median_ms']:.2f}× torch DDP's), "
                f"forward+backward "
                f"{steps.loc[(precision, c), 'forward_backward_ms']:.1f} ms" for c, label in variants) + ".")
    return "\n\n".join([*parts, ctx.table("ddp_individual")])


# Configs that tell where overlapped-individual's time goes: the same all-reduces issued from another
# thread, and torch's C++ reducer at (about) the same granularity.
VARIANTS_OF_INDIVIDUAL = (
    ("individual-thread", "the same all-reduces issued from a worker thread instead of by each gradient hook "
                          "on autograd's thread (individual-thread)"),
    ("individual-inline", "the same all-reduces issued by each gradient hook itself on autograd's thread "
                          "(individual-inline, from runs where `individual` issued them from a worker thread)"),
    ("torch_ddp:1", "torch DDP with 1 MB buckets, its C++ reducer issuing about one all-reduce per gradient "
                    "(torch_ddp:1)"),
)


def allreduce_cost(allreduce: pd.DataFrame | None) -> tuple[float, float] | None:
    """(o seconds, w bytes/s) of t = o + bytes/w, fitted to the 2-rank NCCL all-reduce times of 2.1."""
    if allreduce is None:
        return None
    nccl = allreduce[(allreduce["backend"] == "nccl") & (allreduce["world_size"] == 2)]
    if len(nccl) < 2:
        return None
    slope, intercept = np.polyfit(nccl["size_mb"] * 2**20, nccl["median_ms"] / 1e3, 1)
    return max(intercept, 1e-7), 1 / slope


def bucket_model(allreduce: pd.DataFrame | None, model_bytes: float, best_mb: dict[str, float] | None = None) -> str:
    """2.3(b): the overhead model, with o and w fitted to the measured all-reduce times, next to the best
    bucket size the sweep measured (`best_mb`: MB by precision)."""
    text = ("Model: n_b buckets of s/n_b bytes; computing a bucket's gradients takes as long as sending it, "
            "s/(n_b·w), and every all-reduce also costs o. Communication falls behind by o per bucket and the "
            "last bucket can only start when backward ends, so the time after backward is "
            "**overhead(n_b) = n_b·o + s/(n_b·w)**. Setting the derivative to zero gives "
            "**n_b\\* = √(s/(w·o))**, i.e. an optimal bucket size **b\\* = s/n_b\\* = √(s·w·o)**.")
    cost = allreduce_cost(allreduce)
    if cost is None:
        return text
    o, w = cost
    best = math.sqrt(model_bytes * w * o)
    text += (f" Fitted to our NCCL all-reduce times (2 ranks): o = {o * 1e6:.1f} µs, w = {w / 1e9:.1f} GB/s; "
             f"for the {model_bytes / 2**30:.2f} GiB of gradients this gives b\\* = {best / 2**20:.0f} MiB.")
    if best_mb:
        text += " Measured best of the sweep: " + ", ".join(f"{mb:g} MB in {p}" for p, mb in best_mb.items()) + "."
    return text


def render_ddp_bucketed(ctx: Context) -> str:
    frame = ctx.frame("ddp_bucketed")
    configs = list(dict.fromkeys(frame["config"]))
    ok = frame[frame["status"] == "ok"]
    model_bytes = ok["grad_mib"].iloc[0] * 2**20 if len(ok) else 0.0
    parts = [_ddp_summary(frame, configs)]
    ok_steps = _ddp_steps(frame)
    steps, stds = ok_steps["step_ms"], ok_steps["step_std_ms"]
    best_mb = {}
    for precision in sorted(set(frame["precision"])):
        bucketed = {c: steps[(precision, c)] for c in configs if c.startswith("bucketed") and (precision, c) in steps}
        if bucketed and (precision, "torch_ddp") in steps:
            best = min(bucketed, key=bucketed.get)
            best_mb[precision] = float(best.split(":")[1])
            text = (f"{precision}: the best bucket size is {best.split(':')[1]} MB, "
                    f"{bucketed[best] / steps[(precision, 'torch_ddp')]:.2f}× torch DDP's step time.")
            if abs(bucketed[best] - steps[(precision, "torch_ddp")]) < max(stds[(precision, best)],
                                                                         stds[(precision, "torch_ddp")]):
                text += " The gap is smaller than the larger of the two step-to-step standard deviations."
            parts.append(text)
    parts.append(bucket_model(ctx.frame("allreduce"), model_bytes, best_mb))
    return "\n\n".join([*parts, ctx.table("ddp_bucketed"), ctx.figure("ddp_bucketed", "buckets")])


def render_sharding(ctx: Context) -> str:
    frame = ctx.frame("sharding")
    ok = frame[frame["status"] == "ok"].set_index(["precision", "config"])
    parts = []
    for precision in sorted(set(frame["precision"])):
        if not {(precision, "individual"), (precision, "individual+sharded")} <= set(ok.index):
            continue
        plain, sharded = ok.loc[(precision, "individual")], ok.loc[(precision, "individual+sharded")]
        text = (f"{precision}: peak memory {plain['peak_after_step_mib']:.0f} MiB without sharding and "
                f"{sharded['peak_after_step_mib']:.0f} MiB with ours "
                f"({sharded['peak_after_step_mib'] - plain['peak_after_step_mib']:+.0f} MiB). By the formula parameters "
                f"take {plain['param_mib']:.0f} MiB, gradients {plain['grad_mib']:.0f} MiB and AdamW's moments "
                f"{plain['optimizer_state_mib']:.0f} MiB, of which each rank keeps {sharded['optimizer_state_mib']:.0f} "
                f"MiB when sharded; the rest of the peak is activations and temporaries.")
        compared = [plain, sharded]
        if (precision, "torch_ddp+zero") in ok.index:
            zero = ok.loc[(precision, "torch_ddp+zero")]
            compared.append(zero)
            text += (f" torch's ZeroRedundancyOptimizer over torch DDP peaks at {zero['peak_after_step_mib']:.0f} MiB "
                     f"(torch DDP keeps its own gradient buckets besides the gradients; our bucketed wrapper "
                     f"makes the gradients views of its buckets). Step time (median): "
                     f"{sharded['step_median_ms']:.1f} ms for ours, {zero['step_median_ms']:.1f} ms for torch's "
                     f"({sharded['step_median_ms'] / zero['step_median_ms']:.2f}×), "
                     f"{plain['step_median_ms']:.1f} ms without sharding. The optimizer phase, where sharding acts "
                     f"(each rank updates its shard; ours then all-gathers the updated shards in chunks, torch's "
                     f"broadcasts each parameter from its owner), takes "
                     f"{sharded['optimizer_ms']:.1f} ms for ours, {zero['optimizer_ms']:.1f} ms for torch's and "
                     f"{plain['optimizer_ms']:.1f} ms unsharded.")
        else:
            text += (f" Step time (median) {plain['step_median_ms']:.1f} ms without and "
                     f"{sharded['step_median_ms']:.1f} ms with sharding.")
        for config in sorted(c for p, c in ok.index if p == precision and c.endswith("+sharded")
                             and c != "individual+sharded"):
            other = ok.loc[(precision, config)]
            compared.append(other)
            versus = ok.loc[(precision, "torch_ddp+zero")] if (precision, "torch_ddp+zero") in ok.index else None
            text += (f" With {config.split('+')[0]} DDP under our sharded optimizer: {other['step_median_ms']:.1f} ms"
                     + (f" ({other['step_median_ms'] / versus['step_median_ms']:.2f}× torch's)" if versus is not None
                        else "") + f", peak {other['peak_after_step_mib']:.0f} MiB.")
        if "step_round_median_min_ms" in ok:
            # ours against torch's (or against no sharding): apart only if their per-round medians are
            zero_key = (precision, "torch_ddp+zero")
            reference = ok.loc[zero_key] if zero_key in ok.index else plain
            apart = [row.name[1] for row in compared if row.name[1].endswith("+sharded") and (
                row["step_round_median_min_ms"] > reference["step_round_median_max_ms"]
                or row["step_round_median_max_ms"] < reference["step_round_median_min_ms"])]
            text += (f" Against {reference.name[1]}, the per-round medians of "
                     + (f"{', '.join(apart)} do not overlap its own" if apart else "every sharded config overlap its own")
                     + " (ranges in the table).")
        else:
            spread = max(row["step_std_ms"] for row in compared)
            gap = max(row["step_median_ms"] for row in compared) - min(row["step_median_ms"] for row in compared)
            if gap < spread:
                text += (f" These step times differ by less than their step-to-step standard deviation (up to "
                         f"{spread:.1f} ms), so this run does not separate them.")
        parts.append(text)
    parts.append(
        "3(c): ours shards only the optimizer state (ZeRO stage 1): every rank still holds all parameters and "
        "all gradients, all-reduces full gradients (DDP) instead of reduce-scattering them, updates its shard "
        f"and then all-gathers the updated shards (in chunks of at most {GATHER_BUCKET_MB:.0f} MiB through two "
        "staging buffers), "
        "where ZeRO-1 as described by Rajbhandari et al. (2020) reduce-scatters gradients before the update, so "
        "that its communication volume equals plain data parallelism's; ours moves the gradients' volume twice "
        "(all-reduce) and the parameters' once. Shards here are whole parameters assigned greedily by size, not "
        "equal slices of a flat buffer, so they balance only approximately and the shorter shard is padded "
        "in the all-gather.")
    return "\n\n".join([*parts, ctx.table("sharding")])


def render_accounting(ctx: Context) -> str:
    path = ctx.results / "communication_accounting.md"
    return path.read_text() if path.exists() else "pending: rule `communication_accounting`\n"


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


def render_profile(ctx: Context) -> str:
    from cs336_systems.model import get_config
    from cs336_systems.report.tables import MATMUL, profile_kernels_of, profile_point

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


def render_memory(ctx: Context) -> str:
    from cs336_systems.model import get_config
    from cs336_systems.model.functional import parameter_count

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
        parts.append(f"(c) bf16 autocast changes the peak by {delta.min():+.0f} to {delta.max():+.0f} MiB: the "
                     f"peaks are set by float32 tensors that autocast leaves alone (the weights in the forward "
                     f"pass; weights, gradients and AdamW state in the training step), while what autocast halves, "
                     f"the activations, is a small part of either peak at these context lengths.")
    parts.append(f"(d) One residual-stream activation at context {longest} is batch × context × d_model × 4 B = "
                 f"{batch} × {longest} × {config.d_model} × 4 / 1024² = {residual:.1f} MiB.")
    if allocations is not None:
        forward = allocations[allocations["snapshot"] == f"forward_fp32_{longest}"]
        same = forward[(forward["size_mib"] - residual).abs() < 1e-6]
        if len(same):
            parts[-1] += f" The forward snapshot has {int(same['count'].sum())} allocations of exactly that size."
        parts.append("(e) Largest allocations in the forward pass (fp32, context "
                     f"{longest}) and the code that made them:\n\n"
                     + forward[["size_mib", "count", "origin"]].round(1).to_markdown(index=False))
    return "\n\n".join(parts)


def render_traces(ctx: Context) -> str:
    frame = ctx.frame("ddp_overlap")
    parts = ["Each figure is drawn from a PyTorch-profiler trace of one training step on rank 0 (the handout asks "
             "for Nsight screenshots; Nsight Systems cannot make reports on our machines): the backward range, "
             "compute work and gradient communication on one time axis."]
    for _, row in frame.iterrows():
        host = ""
        if "collectives_in_backward" in row and pd.notna(row["collectives_in_backward"]):
            busy = (f"GPU kernels cover {row['gpu_busy_in_backward']:.0%} of the {row['backward_ms']:.1f} ms "
                    f"backward range.")
            if row["collectives_in_backward"] == 0 and row["overlap_with_backward"] > 0:
                # communication kernels ran during backward, so some thread issued them unseen
                host = (" No collective call appears on the threads this trace records (they were issued from a "
                        f"worker thread the profiler did not record) although its kernels ran during backward; {busy}")
            else:
                host = (f" The host launched {int(row['collectives_in_backward'])} collectives during the backward "
                        f"range and spent {row['host_collective_ms_in_backward']:.1f} ms inside those calls; {busy}")
        parts.append(f"`{row['trace']}`: {row['communication_ms']:.1f} ms of communication, "
                     f"{row['overlap_with_backward']:.0%} of it during the backward pass.{host}")
        parts.append(ctx.figure(f"ddp_traces/{row['trace']}", row["trace"]))
    return "\n\n".join(parts)


# Same seed, same global batch: runs may differ only by float rounding in reductions of another order.
LOSS_AGREEMENT = 1e-3


def render_train_matrix(ctx: Context) -> str:
    from cs336_systems.report.tables import train_matrix

    frame = ctx.frame("train_matrix")
    summary = train_matrix(frame)
    first, ddp = frame.iloc[0], frame[frame["world_size"] > 1]
    per_rank = f"{int(ddp['batch_per_rank'].iloc[0])} sequences per rank; " if len(ddp) else ""
    parts = [f"{first['size']} model, {first['precision']}, context {first['context_length']}, "
             f"{int(first['tokens_per_step'])} tokens per step for every run ({per_rank}the single-GPU run takes "
             f"the whole global batch), {int(frame['step'].max())} steps from the same seed, on "
             f"{first['device_name']}."]
    drift = summary.dropna(subset=["max |loss − torch DDP|"])
    if len(drift):
        worst = drift.sort_values("max |loss − torch DDP|").iloc[-1]
        gap = worst["max |loss − torch DDP|"]
        if gap < LOSS_AGREEMENT:
            parts.append(f"Every run's loss stays within {gap:.2g} of torch DDP's with the same attention backend "
                         f"at every step: our wrappers train the model as torch's does, and data parallelism as a "
                         f"whole matches one GPU on the same global batch.")
        else:
            parts.append(f"The loss curves do not agree: {worst['wrapper']} with {worst['attention']} strays "
                         f"{gap:.2g} from torch DDP's (agreement would be below {LOSS_AGREEMENT}).")
    fastest = set()
    for attention, runs in summary.groupby("attention", sort=False):
        best = runs.sort_values("tokens/s").iloc[-1]
        fastest.add(best["wrapper"])
        parts.append(f"Tokens/s with {attention} attention: "
                     + ", ".join(f"{r['wrapper']} {r['tokens/s']:,}" for _, r in runs.iterrows())
                     + f" (fastest: {best['wrapper']}).")
    if len(fastest) > 1:
        parts.append("The fastest wrapper changes with the attention backend, so these short runs of a small model "
                     "do not rank the wrappers; the xl measurements of 2.2–2.3 do.")
    return "\n\n".join([*parts, ctx.figure("train_matrix", "loss curves"), ctx.table("train_matrix")])


DELIVERABLES = [
    Deliverable("1.1.3 (a) benchmarking_script: the benchmarking script", "e2e_timing",
                lambda ctx: "`python -m cs336_systems.bench.e2e --help` (module `cs336_systems/bench/e2e.py`)."),
    Deliverable("1.1.3 (b) forward and backward timings for every model size", "e2e_timing", render_e2e, ("e2e",)),
    Deliverable("1.1.3 (c) the effect of 0, 1 and 2 warm-up steps", "e2e_warmup", render_warmup, ("e2e_warmup",)),
    Deliverable("1.1.4 (a–e) nsys_profile: kernel summaries per range", "profile", render_profile, ("profile",)),
    Deliverable("1.1.5 mixed_precision_accumulation", "mixed_precision", render_accumulation, ("mixed_precision",)),
    Deliverable("1.1.5 (a–b) benchmarking_mixed_precision: ToyModel dtypes and layer norm", "mixed_precision",
                render_toy_dtypes, ("mixed_precision",)),
    Deliverable("1.1.5 (c) fp32 versus bf16 timings for every model size", "e2e_timing", render_mixed_precision,
                ("e2e",)),
    Deliverable("1.1.6 (a–e) memory_profiling of the 2.7B model", "memory_profile", render_memory,
                ("memory", "memory_allocations"), cuda_only="the allocator history is a CUDA feature"),
    Deliverable("1.2.1 pytorch_attention: attention timings and memory", "attention_timing", render_attention,
                ("attention",)),
    Deliverable("1.3.1 (a) torch_compile: compiled versus vanilla attention", "attention_timing",
                render_attention_compile, ("attention",)),
    Deliverable("1.3.1 (b) torch_compile: compiled versus vanilla Transformer", "compile_timing", render_compile,
                ("e2e_compile",)),
    Deliverable("1.3.1 (b), continued: the optimizer step (our AdamW, multi-tensor and fused, and torch's)",
                "optimizer_timing", render_optimizer, ("optimizer",)),
    Deliverable("1.3.2 flash_forward / flash_backward: correctness", "flash_correctness", render_flash_correctness,
                ("flash_correctness",)),
    Deliverable("1.3.2 (e) flash_benchmarking", "flash_benchmark", render_flash_sweep, ("flash_sweep",)),
    Deliverable("1.3.2 (e), continued: registers and spills of our kernels per tile", "flash_resources",
                render_flash_resources, ("flash_resources",)),
    Deliverable("1.3.3 leaderboard case", "flash_leaderboard", render_leaderboard, ("flash_leaderboard",)),
    Deliverable("2.1 distributed_communication_single_node: all-reduce", "allreduce", render_allreduce,
                ("allreduce",)),
    Deliverable("2.2 naive_ddp_benchmarking and 2.3 minimal_ddp_flat_benchmarking", "ddp_benchmark",
                render_ddp_naive, ("ddp_naive",)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (a)", "ddp_benchmark", render_ddp_individual,
                ("ddp_individual",)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (b): profiler traces", "ddp_overlap",
                render_traces, ("ddp_overlap",)),
    Deliverable("2.3 ddp_bucketed_benchmarking (a, b)", "ddp_benchmark", render_ddp_bucketed, ("ddp_bucketed",)),
    Deliverable("2.4 communication_accounting (a–d)", "communication_accounting", render_accounting),
    Deliverable("3 optimizer_state_sharding_accounting (a–c)", "ddp_benchmark", render_sharding, ("sharding",)),
    Deliverable("End to end: training runs by attention backend and wrapper", "train_matrix", render_train_matrix,
                ("train_matrix",)),
]


def build(ctx: Context, scale: str, device: str = "cuda") -> str:
    lines = [f"# CS336 Assignment 2 (systems): results ({scale} scale)", "",
             "Generated by `snakemake writeup`; every number below is computed from the files in this folder.", ""]
    for item in DELIVERABLES:
        lines.append(f"## {item.section}\n")
        missing = [name for name in item.data if ctx.frame(name) is None]
        if item.rule is None or item.render is None:
            lines.append("pending: no producing rule yet\n")
        elif missing and item.cuda_only and device != "cuda":
            lines.append(f"not measured at this scale, which runs on the {device}: {item.cuda_only}.\n")
        elif missing:
            files = ", ".join(f"{ctx.results / name}.csv" for name in missing)
            lines.append(f"pending: rule `{item.rule}` has not produced {files} yet\n")
        else:
            lines.append(item.render(ctx) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the Markdown report from results files.")
    parser.add_argument("--results", required=True, help="results directory of one scale")
    parser.add_argument("--figures", required=True, help="figures directory of the same scale")
    parser.add_argument("--scale", required=True)
    parser.add_argument("--device", default="cuda", help="the device this scale measures on (config: device)")
    parser.add_argument("--anchors", default=None, help="YAML file with reference numbers (config.yaml)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    anchors = {}
    if args.anchors:
        anchors = yaml.safe_load(Path(args.anchors).read_text()).get("anchors", {})
    out = Path(args.out)
    ctx = Context(Path(args.results), Path(args.figures), out.parent, anchors)
    out.write_text(build(ctx, args.scale, args.device))


if __name__ == "__main__":
    main()
