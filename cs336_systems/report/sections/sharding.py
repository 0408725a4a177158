"""Handout 3 (workflow/rules/distributed.smk, rule ddp_benchmark): optimizer-state sharding's memory and
step time against unsharded DDP and torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

import pandas as pd

from cs336_systems.distributed.sharded_optimizer import GATHER_BUCKET_MB
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, column_values
from cs336_systems.report.ddp_analysis import RERUN
from cs336_systems.report.sections.distributed import ddp_specs
from cs336_systems.report.tables import round_medians


def _mib(value: float) -> str:
    return "—" if pd.isna(value) else f"{value:.0f}"  # memory is measured on CUDA only


def sharding_table(frame: pd.DataFrame) -> pd.DataFrame:
    """3(a–b): memory at the three points with each phase's peak, the accounting by formula, and the
    step and optimizer-phase times."""
    out = []
    for _, row in frame[frame["status"] == "ok"].iterrows():
        out.append({"precision": row["precision"], "config": row["config"],
                    "after init (MiB)": _mib(row["mem_after_init_mib"]),
                    "peak forward+backward (MiB)": _mib(row["peak_before_step_mib"]),
                    "before step (MiB)": _mib(row["mem_before_step_mib"]),
                    "peak of the step (MiB)": _mib(row["peak_after_step_mib"]),
                    "after step (MiB)": _mib(row["mem_after_step_mib"]),
                    "params by formula (MiB)": round(row["param_mib"]),
                    "grads by formula (MiB)": round(row["grad_mib"]),
                    "AdamW state by formula (MiB)": round(row["optimizer_state_mib"]),
                    "optimizer (ms)": round(row["optimizer_ms"], 1),
                    "step median (ms)": round(row["step_median_ms"], 1),
                    "round medians (ms)": round_medians(row)})
    return pd.DataFrame(out)


def render_sharding(ctx: Context) -> Section:
    frame = ctx.frame("sharding")
    table = sharding_table(frame)
    q = Quotes(table)
    ok = frame[frame["status"] == "ok"].set_index(["precision", "config"])
    specs = ddp_specs(frame)
    phase_peaks = "peak_scope" in frame

    def cell(t: pd.DataFrame, precision: str, config: str, column: str) -> float:
        return column_values(t, column, lambda t: (t["precision"] == precision) & (t["config"] == config)).iloc[0]

    def v(precision: str, config: str, column: str, fmt: str = ".0f") -> str:
        return format(cell(table, precision, config, column), fmt)

    def versus(precision: str, a: str, b: str, column: str, fmt: str, what: str, ratio: bool = False) -> str:
        return q.derive(lambda t: cell(t, precision, a, column) / cell(t, precision, b, column) if ratio
                        else cell(t, precision, a, column) - cell(t, precision, b, column), fmt, what)

    first = frame.iloc[0]
    setup = (f"Setup: {first['world_size']} ranks ({first['backend']}), model {first['size']}, batch "
             f"{first['batch_per_rank']} per rank, context {first['context_length']}; every config of the table ran "
             f"in the same run, interleaved, and the text compares them only with each other. "
             f"Memory is rank 0's: allocated after initialisation, the peak during forward+backward (the peak is reset "
             f"before it), allocated just before the optimizer step, the step's own peak and allocated just after it.")
    if not phase_peaks:
        setup += (" These rows predate resetting the peak before the optimizer step, so their 'peak of the step' is "
                  "the whole step's peak (it repeats the forward+backward peak in every row) and the text uses the "
                  "forward+backward peak only; the optimizer step's own peak waits for the rerun "
                  f"(pending: `{RERUN}`).")
    checked = []
    mem = "peak forward+backward (MiB)"
    step, opt = "step median (ms)", "optimizer (ms)"
    for precision in sorted(set(frame["precision"])):
        if not {(precision, "individual"), (precision, "individual+sharded")} <= set(ok.index):
            continue
        plain, sharded = "individual", "individual+sharded"
        measured = pd.notna(ok.loc[(precision, plain), "peak_before_step_mib"])  # allocator statistics: CUDA only
        formula = (f"By the formula parameters take {v(precision, plain, 'params by formula (MiB)')} MiB, gradients "
                   f"{v(precision, plain, 'grads by formula (MiB)')} MiB and AdamW's moments "
                   f"{v(precision, plain, 'AdamW state by formula (MiB)')} MiB, of which each rank keeps "
                   f"{v(precision, sharded, 'AdamW state by formula (MiB)')} MiB when sharded")
        if measured:
            text = (f"{precision}: peak memory during forward+backward {v(precision, plain, mem)} MiB without sharding "
                    f"and {v(precision, sharded, mem)} MiB with ours "
                    f"({versus(precision, sharded, plain, mem, '+.0f', f'{precision} sharded peak over plain')} MiB). "
                    f"{formula}; the rest of the peak is activations and temporaries.")
            if phase_peaks:
                text += (f" The optimizer step's own peak: {v(precision, plain, 'peak of the step (MiB)')} MiB "
                         f"unsharded, {v(precision, sharded, 'peak of the step (MiB)')} MiB with ours (its chunked "
                         f"all-gather stages the updated shards).")
        else:
            text = f"{precision}: memory is not measured on this device (the allocator's statistics are CUDA's). {formula}."
        zero = "torch_ddp+zero"
        if (precision, zero) in ok.index:
            if measured:
                text += (f" torch's ZeroRedundancyOptimizer over torch DDP peaks at {v(precision, zero, mem)} MiB in "
                         f"forward+backward (torch DDP keeps its own gradient buckets besides the gradients).")
            text += (f" Step time "
                     f"(median): {v(precision, sharded, step, '.1f')} ms for ours, {v(precision, zero, step, '.1f')} ms "
                     f"for torch's ({versus(precision, sharded, zero, step, '.2f', f'{precision} ours over ZeRO', True)}×), "
                     f"{v(precision, plain, step, '.1f')} ms without sharding. The optimizer phase, where sharding acts "
                     f"(each rank updates its shard; ours then all-gathers the updated shards in chunks, torch's "
                     f"broadcasts each parameter from its owner), takes {v(precision, sharded, opt, '.1f')} ms for "
                     f"ours, {v(precision, zero, opt, '.1f')} ms for torch's and {v(precision, plain, opt, '.1f')} ms "
                     f"unsharded.")
        for config in sorted(c for p, c in ok.index if p == precision and specs[c].optimizer_sharding == "sharded"
                             and c != sharded):
            text += (f" With {specs[config].wrapper} DDP under our sharded optimizer: {v(precision, config, step, '.1f')} "
                     f"ms" + (f", peak {v(precision, config, mem)} MiB." if measured else "."))
        reference = zero if (precision, zero) in ok.index else plain
        ref = ok.loc[(precision, reference)]
        if ref.get("rounds", 1) > 1:
            mine = [c for p, c in ok.index if p == precision and specs[c].optimizer_sharding == "sharded"]
            apart = [c for c in mine if ok.loc[(precision, c), "step_round_median_min_ms"] > ref["step_round_median_max_ms"]
                     or ok.loc[(precision, c), "step_round_median_max_ms"] < ref["step_round_median_min_ms"]]
            text += (f" Against {reference}, the per-round medians of "
                     + (f"{', '.join(apart)} do not overlap its own" if apart else "every sharded config overlap its own")
                     + " (ranges in the table).")
        checked.append(text)
    parts = [setup, *checked]
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
    return Section([*parts, ctx.table("sharding")], table, checked, q.derived)


def correctness_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per test of the correctness runs: passed/run, failures, skips and the seed shifts."""
    return pd.DataFrame({"test": frame["test"], "passed / run": [f"{p}/{n}" for p, n in zip(frame["passed"], frame["runs"])],
                         "failed": frame["failed"], "skipped": frame["skipped"],
                         "seed shifts": frame["seed_shifts"].astype(str)})


def render_correctness(ctx: Context) -> Section:
    frame = ctx.frame("ddp_correctness")
    table = correctness_table(frame)
    q = Quotes(table)

    def total(column: str):
        def formula(t: pd.DataFrame) -> float:
            pairs = t["passed / run"].str.split("/", expand=True).astype(int)
            return float(pairs[0 if column == "passed" else 1].sum())
        return formula

    passed = q.derive(total("passed"), ".0f", "runs passed, all tests")
    runs = q.derive(total("runs"), ".0f", "runs, all tests")
    failing = frame.loc[frame["failed"] > 0, "test"].tolist()
    text = (f"Correctness, rerun with fresh seeds (cs336_systems.bench.ddp_correctness: each run of the tests "
            f"shifts every seed by the run's number, so other initial weights and batches each time): {passed} of "
            f"{runs} test runs passed. Each wrapper test trains a toy model with a tied and a frozen layer on 2 gloo "
            f"ranks and compares every parameter with one process trained on the full batch (naive DDP's weights-"
            f"match check is `test_wrapper_matches_single_process[naive]`); the sharded-optimizer tests compare with "
            f"an unsharded AdamW. "
            + (f"Failing: {', '.join(f'`{t}`' for t in failing)}." if failing else "None failed."))
    return Section([text, ctx.table("ddp_correctness")], table, [text], q.derived, wording=("2",))


DELIVERABLES = [
    Deliverable("3 optimizer_state_sharding_accounting (a–c)", "ddp_benchmark", render_sharding, ("sharding",),
                tables=(Table("sharding", "sharding", sharding_table,
                              "Memory and step time with and without optimizer-state sharding"),)),
    Deliverable("3, continued: correctness of the DDP wrappers and the sharded optimizer", "ddp_correctness",
                render_correctness, ("ddp_correctness",),
                tables=(Table("ddp_correctness", "ddp_correctness", correctness_table,
                              "DDP-wrapper and sharded-optimizer tests, each run with fresh seeds (CPU, gloo, 2 ranks)"),)),
]
