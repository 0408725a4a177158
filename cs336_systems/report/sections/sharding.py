"""Handout 3 (workflow/rules/distributed.smk, rule ddp_benchmark): optimizer-state sharding's memory and
step time against unsharded DDP and torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.appendix import moved
from cs336_systems.report.ddp_analysis import RERUN_NAMED
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, column_values
from cs336_systems.report.sections.distributed import ddp_specs


# allocated memory at three points and each phase's own peak, each labelled for which it is (as the FSDP table)
MEMORY = {"allocated after init (MiB)": "mem_after_init_mib", "peak forward+backward (MiB)": "peak_before_step_mib",
          "allocated before step (MiB)": "mem_before_step_mib", "peak of the step (MiB)": "peak_after_step_mib",
          "allocated after step (MiB)": "mem_after_step_mib"}  # measured on CUDA only: NaN, printed '—', elsewhere
FORMULA = {"params by formula (MiB)": "param_mib", "grads by formula (MiB)": "grad_mib",
           "AdamW state by formula (MiB)": "optimizer_state_mib"}
STEP = "step (ms)"


def sharding_table(frame: pd.DataFrame) -> NumericTable:
    """3(a–b): memory at the three points with each phase's peak, the accounting by formula, and the
    step and optimizer-phase times (means over every measured step of all rounds, as the DDP tables)."""
    rows = frame[frame["status"] == "ok"]
    data = pd.DataFrame({"precision": rows["precision"], "config": rows["config"],
                         **{label: rows[column] for label, column in {**MEMORY, **FORMULA}.items()},
                         "optimizer (ms)": rows["optimizer_ms"], STEP: rows["step_ms"],
                         "step std (ms)": rows["step_std_ms"]})
    return NumericTable(data, (Col("precision"), Col("config"), *(Col(label, ".0f") for label in {**MEMORY, **FORMULA}),
                               Col("optimizer (ms)", ".1f"), Col(STEP, ".1f", second="step std (ms)")))


def render_sharding(ctx: Context) -> Section:
    from cs336_systems.distributed.sharded_optimizer import GATHER_BUCKET_MB  # distributed/ needs torch; tables not

    frame = ctx.frame("sharding")
    table = ctx.numeric("sharding")
    q = Quotes(table)
    ok = frame[frame["status"] == "ok"].set_index(["precision", "config"])
    specs = ddp_specs(frame)
    phase_peaks = "peak_scope" in frame

    def cell(t: pd.DataFrame, precision: str, config: str, column: str) -> float:
        return column_values(t, column, lambda t: (t["precision"] == precision) & (t["config"] == config)).iloc[0]

    def v(precision: str, config: str, column: str) -> str:
        return table.quote(column, precision=precision, config=config)

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
                  f"(pending: {RERUN_NAMED}).")
    checked = []
    mem = "peak forward+backward (MiB)"
    step, opt = STEP, "optimizer (ms)"
    for precision in sorted(set(frame["precision"])):
        if not {(precision, "individual"), (precision, "individual+sharded")} <= set(ok.index):
            continue
        first_said = not checked  # the first paragraph says what each number is made of; the next ones do not repeat it
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
                    f"{formula}" + ("; the rest of the peak is activations and temporaries." if first_said else "."))
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
                         "forward+backward" + (" (torch DDP keeps its own gradient buckets besides the gradients)."
                                               if first_said else "."))
            text += (f" Step time "
                     f"(mean): {v(precision, sharded, step)} ms for ours, {v(precision, zero, step)} ms "
                     f"for torch's ({versus(precision, sharded, zero, step, '.2f', f'{precision} ours over ZeRO', True)}×), "
                     f"{v(precision, plain, step)} ms without sharding. The optimizer phase"
                     + (", where sharding acts (each rank updates its shard; ours then all-gathers the updated shards "
                        "in chunks, torch's broadcasts each parameter from its owner)," if first_said else "")
                     + f" takes {v(precision, sharded, opt)} ms for "
                     f"ours, {v(precision, zero, opt)} ms for torch's and {v(precision, plain, opt)} ms "
                     f"unsharded.")
        for config in sorted(c for p, c in ok.index if p == precision and specs[c].optimizer_sharding == "sharded"
                             and c != sharded):
            text += (f" With {specs[config].wrapper} DDP under our sharded optimizer: {v(precision, config, step)} "
                     f"ms" + (f", peak {v(precision, config, mem)} MiB." if measured else "."))
        reference = zero if (precision, zero) in ok.index else plain
        ref = ok.loc[(precision, reference)]
        if ref.get("rounds", 1) > 1:
            mine = [c for p, c in ok.index if p == precision and specs[c].optimizer_sharding == "sharded"]
            apart = [c for c in mine if ok.loc[(precision, c), "step_round_median_min_ms"] > ref["step_round_median_max_ms"]
                     or ok.loc[(precision, c), "step_round_median_max_ms"] < ref["step_round_median_min_ms"]]
            # the rounds' spread is a noise check from the results rows (per-round medians), not a table number
            text += (f" Against {reference}, the per-round step times of "
                     + (f"{', '.join(apart)} do not overlap its own" if apart else "every sharded config overlap its own")
                     + " (per-round medians, `results/sharding.csv`).")
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


def correctness_table(frame: pd.DataFrame) -> NumericTable:
    """One row per test of the correctness runs: passed/run, failures, skips and the seed shifts."""
    data = pd.DataFrame({"test": frame["test"], "passed / run": frame["passed"], "runs": frame["runs"],
                         "failed": frame["failed"], "skipped": frame["skipped"],
                         "seed shifts": frame["seed_shifts"].astype(str)})
    return NumericTable(data, (Col("test"), Col("passed / run", "d", second="runs", joiner="/"), Col("failed", "d"),
                               Col("skipped", "d"), Col("seed shifts")))


def render_correctness(ctx: Context) -> Section:
    frame = ctx.frame("ddp_correctness")
    table = ctx.numeric("ddp_correctness")
    q = Quotes(table)

    def total(column: str):
        def formula(t: pd.DataFrame) -> float:
            return float(t[column].sum())
        return formula

    passed = q.derive(total("passed / run"), ".0f", "runs passed, all tests")
    runs = q.derive(total("runs"), ".0f", "runs, all tests")
    failing = frame.loc[frame["failed"] > 0, "test"].tolist()
    text = (f"Correctness, rerun with fresh seeds (cs336_systems.bench.ddp_correctness: each run of the tests "
            f"shifts every seed by the run's number, so other initial weights and batches each time): {passed} of "
            f"{runs} test runs passed. Each wrapper test trains a toy model with a tied and a frozen layer on 2 gloo "
            f"ranks and compares every parameter with one process trained on the full batch (naive DDP's weights-"
            f"match check is `test_wrapper_matches_single_process[naive]`); the sharded-optimizer tests compare with "
            f"an unsharded AdamW. "
            + (f"Failing: {', '.join(f'`{t}`' for t in failing)}." if failing else "None failed."))
    tests = moved(ctx, "ddp_correctness", "correctness of the DDP wrappers and the sharded optimizer: every test")
    return Section([text, *tests], table, [text], q.derived, wording=("2",))


DELIVERABLES = [
    Deliverable("3 optimizer_state_sharding_accounting (a–c)", "ddp_benchmark", render_sharding, ("sharding",),
                tables=(Table("sharding", "sharding", sharding_table,
                              "Memory and step time with and without optimizer-state sharding; times are means over "
                              "the measured steps of all rounds (the step ± its standard deviation)"),)),
    Deliverable("3, continued: correctness of the DDP wrappers and the sharded optimizer", "ddp_correctness",
                render_correctness, ("ddp_correctness",),
                tables=(Table("ddp_correctness", "ddp_correctness", correctness_table,
                              "DDP-wrapper and sharded-optimizer tests, each run with fresh seeds (CPU, gloo, 2 ranks)"),)),
]
