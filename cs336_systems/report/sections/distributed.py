"""Handout 2.1–2.4 (workflow/rules/distributed.smk): all-reduce, naive, flat, overlapped and bucketed
DDP, their profiler traces and the communication accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from cs336_systems.model import TransformerLM, get_config
from cs336_systems.report import figures, tables
from cs336_systems.report.collectives import all_reduce_rows
from cs336_systems.report.section import Context, Deliverable, Figure, Quotes, Section, Table, column_values
from cs336_systems.report.tables import round_medians


def render_allreduce(ctx: Context) -> Section:
    table = tables.allreduce(ctx.frame("allreduce"))
    largest = table[table["size (MB)"] == table["size (MB)"].max()]
    parts = []
    for backend, rows in largest.groupby("backend"):
        rows = rows.sort_values("processes")
        parts.append(f"{backend}: {rows['size (MB)'].iloc[0]:g} MB all-reduced in "
                     + ", ".join(f"{ms:.2f} ms with {n} processes ({bw:.1f} GB/s bus bandwidth)" for ms, n, bw in
                                 zip(rows["median (ms)"], rows["processes"], rows["busbw (GB/s)"])))
    smallest = table[table["size (MB)"] == table["size (MB)"].min()]
    checked = ["; ".join(parts) + ".", (
        "At the smallest size the time is latency: "
        + ", ".join(f"{b} × {n}: {ms:.3f} ms" for b, n, ms in
                    zip(smallest["backend"], smallest["processes"], smallest["median (ms)"]))
        + ". Large messages are bandwidth-bound: bus bandwidth (what each link carries in a ring, "
        "2(n−1)/n of the data) is the figure to compare across process counts.")]
    return Section([*checked, ctx.table("allreduce"), ctx.figure("allreduce", "all-reduce")], table, checked,
                   wording=("2", "1"))


@dataclass(frozen=True)
class DdpConfig:
    """What a DDP results row's `config` names: the data-parallel wrapper (`kind`: none, naive, flat,
    individual[-thread|-inline], bucketed, torch_ddp), its bucket size in MB (bucketed DDP; torch DDP's
    bucket_cap_mb), and how the optimizer state is sharded (None, 'sharded' for ours, 'zero' for torch's)."""
    kind: str
    bucket_mb: float | None
    optimizer_sharding: str | None

    @property
    def wrapper(self) -> str:
        return self.kind if self.bucket_mb is None else f"{self.kind}:{self.bucket_mb:g}"


def ddp_specs(frame: pd.DataFrame) -> dict[str, DdpConfig]:
    """Each config of a DDP results file as its rows' dp_kind, bucket_mb and optimizer_sharding columns
    say (written by the benchmark from its one parser, cs336_systems.distributed.DataParallelSpec)."""
    specs = {}
    for row in frame.drop_duplicates("config").itertuples():
        bucket = None if pd.isna(row.bucket_mb) else float(row.bucket_mb)
        sharding = None if pd.isna(row.optimizer_sharding) or row.optimizer_sharding == "none" else row.optimizer_sharding
        specs[row.config] = DdpConfig(row.dp_kind, bucket, sharding)
    return specs


def _ddp_steps(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["status"] == "ok"].set_index(["precision", "config"])


def _ddp_summary(frame: pd.DataFrame, configs: list[str]) -> list[str]:
    """The setup paragraph (from the rows' arguments), then one line per precision quoting the table's
    step medians, round ranges, communication waits and step-to-step deviations."""
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


def gradient_tensors(size: str) -> int:
    """How many gradient tensors (all-reduces for naive DDP) the model has; built on the meta device."""
    with torch.device("meta"):
        return sum(p.requires_grad for p in TransformerLM(get_config(size)).parameters())


def render_ddp_naive(ctx: Context) -> Section:
    frame = ctx.frame("ddp_naive")
    table = tables.ddp(frame)
    parts = _ddp_summary(frame, ["none", "naive", "flat", "torch_ddp"])
    checked = parts[1:]
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
    keys = pd.MultiIndex.from_frame(table[["precision", "config"]])
    share = (column_values(table, "comm share") / 100).set_axis(keys)
    shares = {p: share[(p, "naive")] for p in sorted(set(ok["precision"])) if (p, "naive") in share.index}
    if shares:
        text = "Communication is " + ", ".join(f"{share:.0%} of naive DDP's step in {p}" for p, share in shares.items())
        if shares.get("bf16", 0) > shares.get("fp32", 1):
            text += (": the faster the computation, the larger the share of the step that waits for gradients, "
                     "which is what overlapping communication with backward (2.3) recovers")
        parts.append(text + ".")
        checked.append(parts[-1])
    return Section([*parts, ctx.table("ddp_naive")], table, checked, wording=("2.3",))


def render_ddp_individual(ctx: Context) -> Section:
    frame = ctx.frame("ddp_individual")
    table = tables.ddp(frame)
    q = Quotes(table)

    def cell(t: pd.DataFrame, precision: str, config: str, column: str) -> float:
        return column_values(t, column, lambda t: (t["precision"] == precision) & (t["config"] == config)).iloc[0]

    def over_torch(precision: str, config: str):
        return q.derive(lambda t: cell(t, precision, config, "step median (ms)")
                        / cell(t, precision, "torch_ddp", "step median (ms)"), ".2f",
                        f"{precision} {config} over torch DDP")

    ok = table[table["step (ms)"].astype(str).str.contains("±")]
    present = set(zip(ok["precision"], ok["config"]))
    parts = _ddp_summary(frame, ["individual", "naive", "torch_ddp"])
    checked = parts[1:]
    for precision in sorted(set(frame["precision"])):
        if not {(precision, c) for c in ("individual", "naive", "torch_ddp")} <= present:
            continue
        ours, naive = ({column: cell(table, precision, c, column) for column in
                        ("communication wait (ms)", "forward+backward (ms)")} for c in ("individual", "naive"))
        change = q.derive(lambda t, p=precision: cell(t, p, "individual", "forward+backward (ms)")
                          - cell(t, p, "naive", "forward+backward (ms)"), "+.1f", f"{precision} overlap's change")
        checked.append(
            f"{precision}: overlapped-individual takes {over_torch(precision, 'individual')}× "
            f"torch DDP's step. Its communication wait is {ours['communication wait (ms)']:.1f} ms against naive's "
            f"{naive['communication wait (ms)']:.1f} ms, but its forward+backward takes "
            f"{ours['forward+backward (ms)']:.1f} ms against naive's {naive['forward+backward (ms)']:.1f} ms (which "
            f"communicates nothing during backward): overlapping one all-reduce per gradient with the backward pass "
            f"changes it by {change} ms.")
        variants = [(c, label) for c, label in VARIANTS_OF_INDIVIDUAL if (precision, c) in present]
        if variants:
            checked.append(f"{precision}, in the same run: " + "; ".join(
                f"{label}: step {cell(table, precision, c, 'step median (ms)'):.1f} ms "
                f"({over_torch(precision, c)}× torch DDP's), forward+backward "
                f"{cell(table, precision, c, 'forward+backward (ms)'):.1f} ms" for c, label in variants) + ".")
    return Section([parts[0], *checked, ctx.table("ddp_individual")], table, checked, q.derived,
                   wording=("1",))  # torch DDP's 1 MB buckets, named in a variant's label


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
    allreduce = all_reduce_rows(allreduce)
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


def render_ddp_bucketed(ctx: Context) -> Section:
    frame = ctx.frame("ddp_bucketed")
    table = tables.ddp(frame)
    q = Quotes(table)
    configs = list(dict.fromkeys(frame["config"]))
    ok = frame[frame["status"] == "ok"]
    model_bytes = ok["grad_mib"].iloc[0] * 2**20 if len(ok) else 0.0
    parts = _ddp_summary(frame, configs)
    checked = parts[1:]
    stds = _ddp_steps(frame)["step_std_ms"]

    def step_means(t: pd.DataFrame) -> pd.Series:  # the mean of the table's 'mean ± std' step cells
        return column_values(t, "step (ms)").set_axis(pd.MultiIndex.from_frame(t[["precision", "config"]]))

    steps = step_means(table).dropna()
    best_mb = {}
    specs = ddp_specs(frame)
    for precision in sorted(set(frame["precision"])):
        bucketed = {c: steps[(precision, c)] for c in configs
                    if c in specs and specs[c].kind == "bucketed" and (precision, c) in steps}
        if bucketed and (precision, "torch_ddp") in steps:
            best = min(bucketed, key=bucketed.get)
            best_mb[precision] = specs[best].bucket_mb
            ratio = q.derive(lambda t, p=precision, b=best: step_means(t)[(p, b)] / step_means(t)[(p, "torch_ddp")],
                             ".2f", f"{precision} best bucketed over torch DDP")
            text = f"{precision}: the best bucket size is {best_mb[precision]:g} MB, {ratio}× torch DDP's step time."
            if abs(bucketed[best] - steps[(precision, "torch_ddp")]) < max(stds[(precision, best)],
                                                                         stds[(precision, "torch_ddp")]):
                text += " The gap is smaller than the larger of the two step-to-step standard deviations."
            parts.append(text)
            checked.append(text)
    parts.append(bucket_model(ctx.frame("allreduce"), model_bytes, best_mb))
    return Section([*parts, ctx.table("ddp_bucketed"), ctx.figure("ddp_bucketed", "buckets")], table, checked,
                   q.derived)


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


def render_accounting(ctx: Context) -> str:
    path = ctx.results / "communication_accounting.md"
    return path.read_text() if path.exists() else "pending: rule `communication_accounting`\n"
DELIVERABLES = [
    Deliverable("2.1 distributed_communication_single_node: all-reduce", "allreduce", render_allreduce,
                ("allreduce",),
                tables=(Table("allreduce", "allreduce", tables.allreduce,
                              "All-reduce of float32 tensors on one node (slowest rank per iteration)"),),
                figures=(Figure("allreduce", "allreduce", figures.allreduce),)),
    Deliverable("2.2 naive_ddp_benchmarking and 2.3 minimal_ddp_flat_benchmarking", "ddp_benchmark",
                render_ddp_naive, ("ddp_naive",),
                tables=(Table("ddp_naive", "ddp_naive", tables.ddp,
                              "Naive and flat DDP versus single GPU and torch DDP"),)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (a)", "ddp_benchmark", render_ddp_individual,
                ("ddp_individual",),
                tables=(Table("ddp_individual", "ddp_individual", tables.ddp,
                              "DDP overlapping per-parameter all-reduces with backward"),)),
    Deliverable("2.3 ddp_overlap_individual_parameters_benchmarking (b): profiler traces", "ddp_overlap",
                render_traces, ("ddp_overlap",)),
    Deliverable("2.3 ddp_bucketed_benchmarking (a, b)", "ddp_benchmark", render_ddp_bucketed, ("ddp_bucketed",),
                tables=(Table("ddp_bucketed", "ddp_bucketed", tables.ddp,
                              "Bucketed DDP by bucket size, torch DDP in the same run"),),
                figures=(Figure("ddp_bucketed", "ddp_bucketed", figures.ddp_bucketed,
                                also=("ddp_naive", "ddp_individual")),)),
    Deliverable("2.4 communication_accounting (a–d)", "communication_accounting", render_accounting),
]
