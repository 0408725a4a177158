"""Handout 1.1.3, 1.1.5 and 1.3.1 (b) (workflow/rules/benchmarking.smk): end-to-end timing of the
Transformer LM, warm-up, mixed precision, torch.compile and the optimizer step."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.bench.e2e import COMPILE_SCOPES
from cs336_systems.model import forward_flops, get_config
from cs336_systems.report import figures, tables
from cs336_systems.report.section import Context, Deliverable, Figure, Quotes, Section, Table, column_values
from cs336_systems.report.tables import SIZE_ORDER, compile_column, compile_scope, compile_timing, mixed_precision


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


def render_mixed_precision(ctx: Context) -> Section:
    table = mixed_precision(ctx.frame("e2e"))
    speedup = column_values(table, "bf16 speed-up").set_axis(table["size"]).dropna()
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
    return Section([text, ctx.table("mixed_precision")], table, checked=[text])


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
    table = compile_timing(frame)
    q = Quotes(table)
    rows = _steps(frame)
    # one log per size (compile_timing_size); older runs wrote a single compile_timing log
    logs = [ctx.log("compile_timing"), *(ctx.log(f"compile/{size}") for size in frame["size"].unique())]
    affected = set().union(*(recompile_limited(log) for log in logs))
    rows = rows[[(size, mode) not in affected for size, mode in zip(rows["size"], rows["mode"])]]
    rows = rows.assign(scope=compile_scope)
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
    return Section([*parts, ctx.table("compile_timing"), ctx.figure("compile_timing", "compile")], table, checked,
                   q.derived)


def _versus_blocks(q: Quotes, scope: str, scopes: list[str], kept, commits: pd.Series) -> list[str]:
    """Another compile scope's step time over the block-compiled one's, per row of the table: the ratio of
    the two speed-up columns (both over the same eager median)."""
    blocks, other = compile_column("speed-up", "blocks", scopes), compile_column("speed-up", scope, scopes)

    def times(t: pd.DataFrame) -> pd.Series:
        pair = pd.DataFrame({"blocks": column_values(t, blocks, kept), "other": column_values(t, other, kept),
                             "size": t["size"].astype(str), "attention": t["attention"], "mode": t["mode"]}).dropna()
        return (pair["blocks"] / pair["other"]).set_axis(pd.MultiIndex.from_frame(pair[["size", "attention", "mode"]]))

    versus = times(q.table)
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


E2E = Table("e2e_timing", "e2e", tables.e2e_timing,
            "Forward and backward time per step (mean ± std over measured steps), fp32")
WARMUP = Table("e2e_warmup", "e2e_warmup", tables.e2e_warmup,
               "Forward+backward step time by number of warm-up steps, fp32")
MIXED = Table("mixed_precision", "e2e", mixed_precision, "Forward and backward time, fp32 versus bf16 autocast")
COMPILE = Table("compile_timing", "e2e_compile", compile_timing,
                "Eager versus torch.compile'd model: ms per step, mean ± std; speed-up = eager median ÷ compiled "
                "median, for each compiled scope; compiled MFU from the median of the fastest compiled scope; "
                "bf16 autocast")
OPTIMIZER = Table("optimizer", "optimizer", tables.optimizer_timing,
                  "AdamW's step alone, eager training steps: ms per step, mean ± std; the bandwidth is AdamW's "
                  "least traffic over the median time")

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
    Deliverable("1.3.1 (b) torch_compile: compiled versus vanilla Transformer", "compile_timing", render_compile,
                ("e2e_compile",), tables=(COMPILE,),
                figures=(Figure("compile_timing", "e2e_compile", figures.compile_timing),)),
    Deliverable("1.3.1 (b), continued: the optimizer step (our AdamW, multi-tensor and fused, and torch's)",
                "optimizer_timing", render_optimizer, ("optimizer",), tables=(OPTIMIZER,)),
]
