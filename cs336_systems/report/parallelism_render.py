"""Section 8 of the 2026 handout as Markdown: the derived answers (analysis.parallelism), evaluated for
concrete machines and layer shapes, and the ring model checked against measured collective times; and
section 7's fsdp_accounting (a), written from analysis.fsdp_accounting (`render_fsdp_accounting`).

Machines (C in FLOP/s, W in egress bytes/s; each constant's source is carried with it):
- TPU v5p: the handout's own numbers for this analysis. The 2026 handout's section 8 is symbolic and
  points to the TPU Scaling Book; the 2025 handout (section 2.4, communication_accounting (c)) gives
  the Scaling Book's v5p values, W_ici = 2·9e10 B/s and C = 4.6e14 FLOP/s.
- B200: the course's GPU. C = 2500 TFLOP/s BF16 is the 2026 handout's (section 2.1.5, quoting the B200
  spec sheet); the handout gives no link bandwidth, so W = 900 GB/s each way is NVIDIA's (DGX/HGX B200
  datasheet: NVLink 5, 1.8 TB/s per GPU counting both directions).
- 2 × H200, ours: C = 989 TFLOP/s dense BF16 (NVIDIA H200 datasheet: 1,979 TFLOPS BF16 "with
  sparsity", half of it dense; the H100 SXM has the same) and W = the NCCL all-reduce bandwidth fitted
  from our measurement (analysis.collectives), beside the datasheet's 450 GB/s each way (900 GB/s NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import sympy as sp

from cs336_systems.analysis import parallelism as par
from cs336_systems.analysis.collectives import fit_ring_model, measured_bandwidth, ring_time
from cs336_systems.analysis.fsdp_accounting import accounting_table, predicted_peaks
from cs336_systems.analysis.fsdp_accounting import MIB
from cs336_systems.model import get_config
from cs336_systems.report.appendix import appendix
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Quotes, Section
from cs336_systems.results import read_table


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float  # C, FLOP/s per device
    bandwidth: float  # W, egress bytes/s per device
    source: str


@dataclass(frozen=True)
class Layer:
    name: str
    tokens: int  # B: rows of x, the global batch in tokens
    d_model: int  # D
    d_ff: int  # D_FF
    source: str


TPU_V5P = Machine("TPU v5p", 4.6e14, 2 * 9e10, "C and W_ici from the 2025 handout 2.4 (c), after the Scaling Book")
B200 = Machine("B200", 2.5e15, 9e11, "C: 2026 handout 2.1.5 (B200 spec sheet, BF16); W: NVIDIA B200 datasheet, "
               "NVLink 5 1.8 TB/s both ways")
H200_FLOPS = 989e12  # NVIDIA H200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
H200_NVLINK = 450e9  # NVIDIA H200 datasheet: NVLink 900 GB/s, counting both directions


def layers() -> list[Layer]:
    xl = get_config("xl")
    return [
        # Our DDP runs (config.yaml `ddp`): 2 ranks x batch 4 x 512 tokens of the xl model.
        Layer("xl FFN, our DDP batch", 2 * 4 * 512, xl.d_model, xl.d_ff, "get_config('xl'); config.yaml ddp"),
        # The 2026 leaderboard model (handout section 9): d_model 4096, d_ff 11008, batch 2 x 32,768.
        Layer("8B FFN, leaderboard batch", 2 * 32768, 4096, 11008, "2026 handout section 9 Config"),
    ]


def machines(allreduce_csv: pd.DataFrame | None) -> list[Machine]:
    found = [TPU_V5P, B200]
    measured = measured_bandwidth(allreduce_csv, "nccl", 2)
    if measured is not None:
        found.append(Machine("2 × H200 (measured W)", H200_FLOPS, measured,
                             "C: NVIDIA H200 datasheet (dense BF16); W: NCCL all-reduce fit, results/allreduce.csv"))
    found.append(Machine("H200 (datasheet W)", H200_FLOPS, H200_NVLINK, "NVIDIA H200 datasheet: C dense BF16, "
                         "NVLink 900 GB/s both ways"))
    return found


def _subs(machine: Machine, layer: Layer) -> dict:
    return {par.B: layer.tokens, par.D: layer.d_model, par.F: layer.d_ff,
            par.C: machine.flops, par.W: machine.bandwidth}


def evaluate(expr: sp.Basic, machine: Machine, layer: Layer, **devices: float) -> float:
    """An answer's expression (or a bound's right side) as a number; devices gives N_DP=..., N_TP=..."""
    expr = expr.rhs if isinstance(expr, sp.core.relational.Relational) else expr
    values = _subs(machine, layer) | {getattr(par, k): v for k, v in devices.items()}
    result = expr.subs(values)
    if result.free_symbols:
        raise ValueError(f"{expr} still has {sorted(map(str, result.free_symbols))} free; pass them as devices")
    return float(result)


BOUNDS = {"N_DP (DP)": "data_parallel_calcs.c", "N_FSDP, forward": "fsdp_calcs.c.forward",
          "N_FSDP, backward": "fsdp_calcs.c.backward", "N_TP, forward": "tp_calcs.d.forward",
          "N_TP, backward": "tp_calcs.d.backward", "N = N_FSDP·N_TP, overlapped": "fsdp_tp_calcs.c",
          "N = N_FSDP·N_TP, one network": "fsdp_tp_calcs.d"}


def bounds_table(allreduce_csv: pd.DataFrame | None) -> pd.DataFrame:
    """Largest device counts before communication-bound, exact ring factors, per machine and layer."""
    answers = par.derive()
    rows = []
    for layer in layers():
        for machine in machines(allreduce_csv):
            row = {"layer": layer.name, "machine": machine.name, "C (TFLOP/s)": machine.flops / 1e12,
                   "W (GB/s)": machine.bandwidth / 1e9}
            rows.append(row | {name: evaluate(answers[key].expr, machine, layer) for name, key in BOUNDS.items()})
    return pd.DataFrame(rows)


# Answer keys summed for a forward + backward step: (compute FLOPs, communication seconds). DP's forward
# FLOPs are FSDP's (both run the batch-sharded forward on full weights).
STEP = {"DP": (["fsdp_calcs.a.forward", "data_parallel_calcs.a"], ["data_parallel_calcs.b"]),
        "FSDP": (["fsdp_calcs.a.forward", "fsdp_calcs.a.backward"], ["fsdp_calcs.b.forward", "fsdp_calcs.b.backward"]),
        "TP": (["tp_calcs.b.forward", "tp_calcs.b.backward"], ["tp_calcs.c.forward", "tp_calcs.c.backward"])}


def step_times(machine: Machine, layer: Layer, n: int = 2) -> pd.DataFrame:
    """Compute and communication time (ms) per FFN step on n devices for DP, FSDP and TP, forward plus
    backward, and which one bounds the step when the two overlap."""
    answers, axes = par.derive(), {"N_DP": n, "N_FSDP": n, "N_TP": n}
    rows = []
    for strategy, (compute_keys, comm_keys) in STEP.items():
        compute = sum(evaluate(answers[k].expr, machine, layer, **axes) for k in compute_keys) / machine.flops
        comm = sum(evaluate(answers[k].expr, machine, layer, **axes) for k in comm_keys)
        rows.append({"strategy": strategy, "devices": n, "compute_ms": compute * 1e3, "communication_ms": comm * 1e3,
                     "bound": "compute" if compute >= comm else "communication"})
    return pd.DataFrame(rows)


def _expr(expr: sp.Basic) -> str:
    return f"`{sp.sstr(expr)}`"


def _answer_block(key: str, why: bool = False) -> str:
    """One answer as a list item: the quantity, its expression (and its large-N limit where that differs) and,
    with `why`, the reasoning behind it (the appendix's derivations)."""
    exact, approx = par.derive()[key], par.derive(large_n=True)[key]
    line = f"- {exact.quantity}: {_expr(exact.expr)}"
    if sp.simplify(exact.expr.rhs - approx.expr.rhs if isinstance(exact.expr, sp.core.relational.Relational)
                   else exact.expr - approx.expr) != 0:
        line += f" (large N: {_expr(approx.expr)})"
    return f"{line}\n  — {exact.justification}" if why else line


PROBLEMS = {
    "alternate_ring_all_reduce": "Alternate ring all-reduce (8.1)",
    "data_parallel_calcs": "Data parallel calculations (8.2)",
    "fsdp_calcs": "Fully sharded data parallel calculations (8.3)",
    "tp_calcs": "Tensor parallel calculations (8.4)",
    "fsdp_tp_calcs": "2D parallelism calculations (8.5)",
}


def render_parallelism(allreduce_csv: pd.DataFrame | None) -> str:
    """Markdown for section 8 of the 2026 handout; allreduce_csv is results/allreduce.csv (or None)."""
    answers = par.derive()
    out = ["Answers to section 8 of the 2026 handout (\"Analyzing Parallelism Strategies\"), derived in sympy by "
           "`cs336_systems.analysis.parallelism`: FLOPs from the matmuls each device runs, communication from the "
           "ring times of 8.1 (all-gather and reduce-scatter (N−1)/N·S/W, all-reduce 2(N−1)/N·S/W), bounds as "
           "the "
           "root of compute time = communication time. B is the batch in tokens, FP16 values (2 bytes); "
           "`large N` replaces (N−1)/N by 1.\n"]
    for problem, title in PROBLEMS.items():
        out.append(f"### {problem} — {title}\n")
        if problem == "tp_calcs":
            out.append("(a) The backward pass of the column/row-parallel FFN, per device i:\n\n```\n"
                       f"{par.TP_BACKWARD}```\n\n{par.TP_BACKWARD_WHY} "
                       "(`parallelism.tp_backward` runs these equations on simulated shards; the tests check them "
                       "against autograd.)\n")
        keys = [k for k in answers if k.split(".")[0] == problem]
        out.append("\n".join(_answer_block(k) for k in keys) + "\n")
    why = [f"**{problem}** ({title}):\n\n"
           + "\n".join(_answer_block(k, why=True) for k in answers if k.split(".")[0] == problem)
           for problem, title in PROBLEMS.items()]
    out.append(appendix("§8: why each answer holds", "\n\n".join(why)) + "\n")
    memory = par.weights_per_device()
    out.append("### Memory per device and numbers\n")
    out.append("FFN weight bytes each device holds between uses: "
               + ", ".join(f"{k} {_expr(v)}" for k, v in memory.items()) + ".\n")
    out.append("Machines: " + ", ".join(m.name for m in machines(allreduce_csv))
               + " (each one's C and W and where they come from are in the appendix).\n")
    out.append(appendix("§8: the machines' C and W and their sources",
                        "; ".join(f"**{m.name}** — {m.source}" for m in machines(allreduce_csv)) + ".") + "\n")
    if measured_bandwidth(allreduce_csv, "nccl", 2) is None:
        out.append("No NCCL 2-rank all-reduce in the results yet: the measured-W row is left out.\n")
    out.append("Largest device counts before the step is communication-bound (exact ring factors; round down):\n")
    out.append(bounds_table(allreduce_csv).to_markdown(index=False, floatfmt=",.1f") + "\n")
    h200 = next(m for m in machines(allreduce_csv) if "H200" in m.name)  # measured W where there is one
    for machine in (h200,):
        for layer in layers():
            out.append(f"Per-step FFN times on {machine.name}, {layer.name} (B = {layer.tokens}, D = {layer.d_model}, "
                       f"D_FF = {layer.d_ff}), forward + backward:\n")
            out.append(step_times(machine, layer).to_markdown(index=False, floatfmt=",.3f") + "\n")
    if allreduce_csv is not None:
        ring = ("Each op's time at its largest size against the ring prediction from an all-reduce fit of the "
                "same backend and world size over the other sizes only (t = α + factor·S/W, factor 2(N−1)/N for "
                "all-reduce and (N−1)/N for all-gather and reduce-scatter): the size predicted is held out of the "
                "fit (`fitted on`), so the ratio tests the model rather than the fit:\n\n"
                + held_out_ring_table(allreduce_csv).to_markdown(index=False, floatfmt=",.3f"))
        out.append(appendix("Ring model against measured collectives", ring) + "\n")
    return "\n".join(out)


ACCOUNTING_MIB = {"params_mib": "params (MiB)", "grads_mib": "grads (MiB)", "optimizer_mib": "optimizer (MiB)",
                  "state_mib": "state (MiB)", "saving_vs_ddp_mib": "saving vs DDP (MiB)",
                  "gather_buffers_mib": "gather buffers (MiB)"}


ACCOUNTING_SIZES = ("xl", "2.7B")  # the DDP benchmark's size and the handout's largest


def fsdp_accounting_table(sizes: tuple[str, ...] = ACCOUNTING_SIZES,
                          world_sizes: tuple[int, ...] = (2,)) -> NumericTable:
    """analysis.fsdp_accounting's table (MiB per rank) as the prose quotes it: one row per ranks, size and
    strategy."""
    table = pd.concat([accounting_table(sizes, world) for world in world_sizes], ignore_index=True)
    data = table[["size", "parameters", "world_size", "strategy", *ACCOUNTING_MIB]].rename(
        columns={"world_size": "ranks", **ACCOUNTING_MIB})
    return NumericTable(data, (Col("size"), Col("parameters", ",d"), Col("ranks", "d"), Col("strategy"),
                               *(Col(c, ",.0f") for c in ACCOUNTING_MIB.values())))


def fsdp_accounting_of_runs(frame: pd.DataFrame) -> NumericTable:
    """The `table` rule's build (from results/sharding.csv): the accounting at the world sizes the DDP benchmark
    ran, so it sits beside the measured peaks of the same ranks."""
    worlds = tuple(sorted({int(w) for w in frame["world_size"].dropna()})) or (2,)
    return fsdp_accounting_table(ACCOUNTING_SIZES, worlds)


def _state(t: pd.DataFrame, keys: dict, strategy: str, column: str = "state (MiB)") -> float:
    chosen = (t["size"] == keys["size"]) & (t["ranks"] == keys["ranks"]) & (t["strategy"] == strategy)
    return float(t.loc[chosen, column].iloc[0])


def fsdp_accounting_section(table: NumericTable, measured: pd.DataFrame | None = None,
                            embed: str | None = None) -> Section:
    """fsdp_accounting (a) of the 2026 handout: the accounting table (`embed`: its Markdown as the `table` rule
    wrote it, caption included; by default the bare table) and prose that quotes it (cells, and formulas over
    cells); `measured` is results/sharding.csv, whose peaks are set beside the accounting (not checked: another
    table). The answer is for the first row's size and ranks."""
    q = Quotes(table)
    keys = {"size": table.data["size"].iloc[0], "ranks": table.data["ranks"].iloc[0]}
    per_parameter = q.derive(lambda t: _state(t, keys, "DDP") * MIB / _state(t, keys, "DDP", "parameters"), ".0f",
                             f"DDP's state per parameter, {keys['size']}, B")
    ranks = (f"{q.cell('ranks', 0)} ranks" if table.data["ranks"].nunique() == 1 else
             "each row's ranks (the table's column)")
    heading = "### fsdp_accounting (a) — expected saving from FSDP (2026 handout, section 7)"
    intro = (f"Model state per rank, {ranks}: FP32 master weights, FP32 gradients and AdamW's two FP32 moments "
             f"({per_parameter} B per parameter), from `parameter_count` of each size. DDP holds all of it on every "
             "rank, ZeRO-1 shards the optimizer state, FSDP shards everything but the RMSNorm gains. The gathered "
             "BF16 copies (two units in flight plus one full gradient before its reduce-scatter, the largest units "
             "assumed) are the buffers the handout says to ignore; they are listed apart.")
    fsdp = {**keys, "strategy": "FSDP"}
    against_zero = q.derive(lambda t: _state(t, keys, "ZeRO-1") - _state(t, keys, "FSDP"), ",.0f",
                            f"{keys['size']}: ZeRO-1's state less FSDP's, MiB")
    answer = (f"**Answer.** The activations do not change, so the peak falls by the model state FSDP shards: for "
              f"{keys['size']} on {q.cell('ranks', **fsdp)} ranks, {q.cell('saving vs DDP (MiB)', **fsdp)} MiB "
              f"against DDP ({per_parameter}·P_sharded·(N−1)/N, P_sharded the parameters FSDP shards: all but the "
              f"RMSNorm gains) and {against_zero} MiB against ZeRO-1 (the parameters and gradients FSDP also shards, "
              "less the gains' moments ZeRO-1 shards and FSDP keeps whole: 8·(P_sharded − P_norms)·(N−1)/N), "
              f"minus about {q.cell('gather buffers (MiB)', **fsdp)} MiB of gathered BF16 buffers.")
    checked = [heading, intro, answer]
    parts = [heading, intro, table.to_markdown() if embed is None else embed, answer]
    if measured is not None:
        peaks = predicted_peaks(measured, peak="peak_before_step_mib")
        if len(peaks):
            parts += ["Measured forward+backward peaks (`peak_before_step_mib` of `results/sharding.csv`) against the "
                      "accounting; "
                      "the predicted FSDP peak is the measured ZeRO-1 peak less the parameter and gradient state "
                      "FSDP also shards:", peaks.to_markdown(index=False, floatfmt=",.0f")]
    # the handout's numbering and the constants of the two formulas (8 B of parameter and gradient; N − 1)
    return Section(parts, table, checked, q.derived, wording=("2026", "7", "8", "1"))


def render_fsdp_accounting(measured: pd.DataFrame | None = None, sizes: tuple[str, ...] = ACCOUNTING_SIZES,
                           world_size: int = 2) -> str:
    """Markdown answer to fsdp_accounting (a) of the 2026 handout; `measured` is results/sharding.csv."""
    return fsdp_accounting_section(fsdp_accounting_table(sizes, (world_size,)), measured).markdown() + "\n"


def held_out_ring_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Out-of-sample check of the ring model: for each (backend, device, world size, op), the time at its largest
    measured size against alpha + factor_op·S/W from the all-reduce fit (collectives.fit_ring_model) of the same
    backend and world size over the all-reduce sizes other than S. NaN where no other size was measured."""
    frame = frame.copy()
    frame["op"] = frame["op"].fillna("all_reduce") if "op" in frame else "all_reduce"
    if "device_type" not in frame:
        frame["device_type"] = ""
    ok = frame[(frame["status"] == "ok") & (frame["mode"].fillna("single") == "single" if "mode" in frame else True)]
    rows = []
    for (backend, device_type, world, op), group in ok.groupby(["backend", "device_type", "world_size", "op"]):
        held = group.loc[group["size_mb"].idxmax()]
        same = (ok["backend"] == backend) & (ok["device_type"] == device_type) & (ok["world_size"] == world)
        train = ok[same & (ok["op"] == "all_reduce") & (ok["size_mb"] != held["size_mb"])]
        predicted, fit = float("nan"), "none"
        if len(train):
            ar = fit_ring_model(train).iloc[0]
            # bytes as the bench allocates them: float32 elements, rounded down to a multiple of the world size
            size_bytes = int(held["size_mb"] * 2**20) // 4 // int(world) * int(world) * 4
            seconds = ar["latency_us"] / 1e6 + ring_time(op, size_bytes, int(world), ar["bandwidth_gbps"] * 1e9)
            predicted = seconds * 1e3
            fit = ar["fit"]
        rows.append({"backend": backend, "device_type": device_type, "world_size": world, "op": op,
                     "fitted on (MiB)": ", ".join(f"{v:g}" for v in sorted(set(train["size_mb"]))) or "—",
                     "fit": fit, "held out (MiB)": held["size_mb"], "measured_ms": held["median_ms"],
                     "predicted_ms": predicted, "measured_over_predicted": held["median_ms"] / predicted})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    """python -m cs336_systems.report.parallelism_render --allreduce results/allreduce.csv
    --sharding results/sharding.csv --out results/parallelism.md (both inputs optional)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--allreduce", help="collective bench CSV (cs336_systems.bench.allreduce)")
    parser.add_argument("--sharding", help="measured DDP/ZeRO-1 peaks (results/sharding.csv)")
    parser.add_argument("--out", required=True, help="Markdown file with fsdp_accounting (a) and section 8")
    args = parser.parse_args(argv)
    read = lambda path: read_table(path) if path else None  # noqa: E731
    text = render_fsdp_accounting(read(args.sharding)) + "\n" + render_parallelism(read(args.allreduce))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
