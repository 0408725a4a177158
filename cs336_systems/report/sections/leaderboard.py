"""2026 §9, the leaderboard step itself (rule leaderboard_8b, bench/leaderboard.py): one whole training step of
the 8B model, ours beside the plain-PyTorch anchors of the same run, and the ablations of ours. Every number of
the prose is a cell of the step table or a formula over its cells (section.Quotes); the published leaderboard's
figures and the handout's constants are given facts, declared as wording, and so is the intro's provenance (device,
versions, commits). The continuation (the profiled step) quotes its time table the same way."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.report.appendix import appendix, appendix_parts, outline, rows_of, statistic
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table, faster_or_slower
from cs336_systems.report.sections.leaderboard_handout import bench_rows, handout_table, render_handout
from cs336_systems.report.sections.leaderboard_profile import (QUOTED, SWAPPED, memory_table, profile_pointer,
                                                               profile_table, profiled_memory, profiled_time,
                                                               render_profile)
from cs336_systems.report.sections.leaderboard_steps import (ANCHOR, COMMIT, HANDOUT_BATCH, RATIO, SEQUENCES, STEP,
                                                             TARGET_MFU, TARGET_RATIO, TIMED, WARMUP, ablation_runs,
                                                             ablation_table, cell_of, is_ablation, is_measured, row_of,
                                                             runs_table, sized_ablation, step_of, step_table)
from cs336_systems.report.sections.leaderboard_verdict import (VERDICT_RUNS, VERDICT_STEPS, verdict_batches,
                                                               verdict_paragraph, verdict_rows, verdict_runs,
                                                               verdict_table)


def _ratio_to_anchor(q: Quotes, provider: str, batch: int, run: str | None = None) -> str:
    return q.derive(lambda t: cell_of(t, provider, RATIO, batch, run), ".3f", f"{provider} over SAC, batch {batch}")


def _mfu_percent(q: Quotes, provider: str, batch: int) -> str:
    return q.derive(lambda t: 100 * cell_of(t, provider, "MFU", batch), ".2f", f"{provider} MFU %, batch {batch}")


def _misses(t: pd.DataFrame, batch: int) -> str:
    """What of the target the quoted run's `ours` misses at `batch` ('' where it meets it)."""
    ratio_ok = cell_of(t, "ours", RATIO, batch) <= TARGET_RATIO
    mfu_ok = not is_measured(cell_of(t, "ours", "MFU", batch)) or cell_of(t, "ours", "MFU", batch) >= TARGET_MFU
    return " and ".join(what for what, ok in (("its step ratio", ratio_ok), ("its MFU", mfu_ok)) if not ok)


def _gap_paragraph(q: Quotes, batches: list[int]) -> str:
    """Ours against the SAC anchor at each batch (the ratio cells), then the quoted run against the issue's target,
    then how far the runs of the same recipe support that verdict."""
    parts = []
    t = q.frame
    for b in (b for b in batches if is_measured(cell_of(t, "ours", RATIO, b))):
        mfu = (f" at {_mfu_percent(q, 'ours', b)}% MFU against its {_mfu_percent(q, ANCHOR, b)}%"
               if is_measured(cell_of(t, "ours", "MFU", b)) else "")
        parts.append(f"at batch {b} ours takes {_ratio_to_anchor(q, 'ours', b)}× the anchor's mean step "
                     f"({q.cell(STEP, row_of(t, 'ours', batch=b))} against {q.cell(STEP, row_of(t, ANCHOR, batch=b))} ms, "
                     f"{faster_or_slower(cell_of(t, 'ours', RATIO, b))}){mfu}")
    if not parts:
        return "No row of ours with the selective-checkpointing anchor beside it in the same run."
    # a batch with a verdict from repeated runs is judged there, not on its quoted run or the spread across commits
    measured = [b for b in batches if is_measured(cell_of(t, "ours", RATIO, b)) and len(verdict_runs(t, b)) < VERDICT_RUNS]
    said = ([f"met at batch {', '.join(str(b) for b in measured if not _misses(t, b))}"]
            if any(not _misses(t, b) for b in measured) else [])
    said += [f"missed at batch {b} (by {_misses(t, b)})" for b in measured if _misses(t, b)]
    target = f"the issue's target, at most {TARGET_RATIO:g}× the anchor's step and at least {100 * TARGET_MFU:g}% MFU"
    judged = f" In these runs {target}, is " + " and ".join(said) + "." if said else ""
    spreads = "".join(_spread_sentence(q, b) for b in measured)
    return ("Against the strongest plain-PyTorch anchor timed in the same run (`torch_plain_sac`, torchtitan's "
            "selective checkpointing), in each batch's quoted run: " + "; ".join(parts) + "." + judged + spreads
            + _power_sentence(q))


POWER_LIMIT_W = 700  # the H200's board power limit, as `nvidia-smi -q -d POWER` reports it


def _powered_rows(t: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of the quoted run of the largest batch, where it recorded the GPU's power (the earliest runs
    did not; a CPU has none to record)."""
    if "power (W)" not in t:  # the step table prints the clocks only where some run recorded them
        return t.iloc[:0]
    quoted = t[t[QUOTED].astype(bool)]
    powered = quoted[(quoted["batch"] == quoted["batch"].max()) & quoted["power (W)"].notna() & quoted[STEP].notna()]
    return powered[powered["run"] == powered["run"].iloc[0]] if len(powered) else powered


def _span(q: Quotes, column: str, fmt: str, what: str) -> str:
    """The lowest–highest of `column` over the latest powered run's rows (one number where they print alike)."""
    low = q.derive(lambda t: _powered_rows(t)[column].min(), fmt, f"lowest {what}")
    high = format(_powered_rows(q.frame)[column].max(), fmt)
    return low if high == low else low + "–" + q.derive(lambda t: _powered_rows(t)[column].max(), fmt,
                                                         f"highest {what}")


def _kilojoules(t: pd.DataFrame, provider: str) -> float:
    """One provider's energy per step in the latest powered run: mean step × mean board power (kJ)."""
    rows = _powered_rows(t)
    row = rows[rows["provider"] == provider]
    return float(row[STEP].iloc[0] * row["power (W)"].iloc[0] / 1e6) if len(row) else float("nan")


def _power_sentence(q: Quotes) -> str:
    """Whether the latest run with the GPU's clock and power recorded ran at the board's power limit, and then each
    of ours' and the anchor's energy per step: under the limit the step's time follows its energy."""
    rows = _powered_rows(q.frame)
    if len(rows) < 2 or not {"ours", ANCHOR} <= set(rows["provider"]):
        return ""
    run = rows["run"].iloc[0]
    power = _span(q, "power (W)", ",.0f", "board power (W)")
    bound = rows["power (W)"].min() >= 0.95 * POWER_LIMIT_W
    energy = {p: q.derive(lambda t, p=p: _kilojoules(t, p), ".2f", f"{p} kJ per step") for p in ("ours", ANCHOR)}
    return (f" In run {run} the timed steps of every provider drew {power} W (the board's limit is "
            f"{POWER_LIMIT_W} W) at an SM clock of {_span(q, 'SM clock (MHz)', ',.0f', 'SM clock (MHz)')} MHz"
            + (": the step runs at the power limit, so its time follows the energy it spends. " if bound else
               ", below the power limit. ")
            + f"Mean step × mean power, ours spent {energy['ours']} kJ per step and the anchor {energy[ANCHOR]} kJ.")


def _same_recipe_rows(t: pd.DataFrame, batch: int) -> pd.DataFrame:
    """Ours' measured rows at `batch` in every run of the quoted run's recipe: as many sequences per pass and the same
    checkpoint policy (the probe's choice)."""
    last = row_of(t, "ours", batch=batch)
    return t[(t["provider"] == "ours") & (t["batch"] == batch) & (t[SEQUENCES] == t.at[last, SEQUENCES])
             & (t["checkpoint"] == t.at[last, "checkpoint"]) & t[RATIO].notna()]


def _target_met(rows: pd.DataFrame) -> pd.Series:
    return (rows[RATIO] <= TARGET_RATIO) & (rows["MFU"] >= TARGET_MFU)


def _commits_words(q: Quotes, batch: int, why: bool = True) -> str:
    """At how many commits the runs of the recipe were made, and (why) what their spread therefore measures."""
    rows = _same_recipe_rows(q.frame, batch)
    count = q.derive(lambda t: _same_recipe_rows(t, batch)[COMMIT].nunique(), "d", f"commits of the recipe, batch {batch}")
    if rows[COMMIT].nunique() == 1:
        return "all at one commit" + (", so their spread is run-to-run noise" if why else "")
    each = "different " if rows[COMMIT].nunique() == len(rows) else ""
    return f"at {count} {each}commits" + (", so their spread mixes code changes with run-to-run noise" if why else "")


def _spread_sentence(q: Quotes, batch: int) -> str:
    """How the verdict varies between runs of the same recipe, and what that spread can support: ours over the
    anchor and ours' MFU, lowest to highest, at how many commits, and in how many runs the target held."""
    rows = _same_recipe_rows(q.frame, batch)
    if len(rows) < 2:
        return ""

    def span(column: str, scale: float, fmt: str, what: str) -> str:
        return "–".join(q.derive(lambda t, pick=pick: scale * getattr(_same_recipe_rows(t, batch)[column], pick)(),
                                 fmt, f"{pick} {what}, batch {batch}") for pick in ("min", "max"))

    ratios = span(RATIO, 1, ".3f", "ours over SAC")
    mfu = f" at {span('MFU', 100, '.2f', 'ours MFU %')}% MFU" if rows["MFU"].notna().all() else ""
    runs = q.derive(lambda t: len(_same_recipe_rows(t, batch)), "d", f"runs of the recipe, batch {batch}")
    met = q.derive(lambda t: int(_target_met(_same_recipe_rows(t, batch)).sum()), "d", f"runs meeting it, batch {batch}")
    held = int(_target_met(rows).sum())
    verdict = "in every one" if held == len(rows) else f"in {met} of them" if held else "in none"
    ours = q.frame[(q.frame["provider"] == "ours") & (q.frame["batch"] == batch)]
    quoted = "latest" if ours[QUOTED].astype(bool).iloc[-1] else "quoted"  # rows in the order the runs ran
    settled = ("" if held in (0, len(rows)) else f" These runs support no verdict at batch {batch}: the margin is "
               "within their spread.")
    return (f" At batch {batch}, the {runs} runs of the {quoted} run's recipe (the same checkpoint policy and sequences "
            f"per pass; runs table in the appendix) were made {_commits_words(q, batch)}: ours took {ratios}× the anchor's "
            f"step{mfu}, and the target held {verdict}.{settled}")


def _last_run_with(rows: pd.DataFrame, provider: str) -> tuple[str, int] | None:
    """(run, batch) of the ablation rows of `provider` the prose names: the quoted run's, else the latest run's (rows
    are in the order the runs ran)."""
    mine = rows[rows["provider"] == provider]
    mine = mine[mine[QUOTED].astype(bool)] if mine[QUOTED].astype(bool).any() else mine
    return (mine["run"].iloc[-1], int(mine["batch"].iloc[-1])) if len(mine) else None


def _over_ours(t: pd.DataFrame, provider: str, batch: int) -> pd.Series:
    """`provider`'s mean step over ours' of the same run, one value per run that measured both at `batch`."""
    runs = t.loc[(t["provider"] == provider) & (t["batch"] == batch), "run"]
    return pd.Series({r: step_of(t, provider, r, batch) / step_of(t, "ours", r, batch) for r in runs}, dtype=float).dropna()


def _ablation_paragraph(q: Quotes) -> str | None:
    t = q.frame
    if not ablation_runs(t):
        return None
    rows = t[is_ablation(t["provider"])]

    def ratios(t: pd.DataFrame) -> pd.Series:  # every ablation row's step over ours' of its run and batch
        ablations = t[is_ablation(t["provider"])]
        found = [_over_ours(t, p, b) for p, b in dict.fromkeys(zip(ablations["provider"], ablations["batch"]))]
        return pd.concat(found) if found else pd.Series(dtype=float)

    def out_of_memory(t: pd.DataFrame) -> int:
        ablations = t[is_ablation(t["provider"])]
        return sum(not is_measured(step_of(t, p, r, b)) for p, r, b in
                   zip(ablations["provider"], ablations["run"], ablations["batch"]))

    # the table lists every row's ratio; the prose counts them rather than restating each
    text = ("The ablations (table in the appendix: each switches one optimisation of ours off, or spends free "
            "memory; `÷ ours` is its step over ours' of the same run and batch): "
            f"{q.derive(lambda t: int((ratios(t) > 1).sum()), 'd', 'ablation rows slower than ours')} of the "
            f"{q.derive(lambda t: len(ratios(t)), 'd', 'ablation rows compared with ours')} rows compared with ours "
            "are slower than ours"
            + (f", and {q.derive(out_of_memory, 'd', 'ablation rows out of memory')} ran out of memory"
               if out_of_memory(t) else "") + ".")
    sdpa = _last_run_with(rows, SWAPPED)
    if sdpa:
        run, batch = sdpa
        faster = step_of(t, SWAPPED, run, batch) > step_of(t, "ours", run, batch)
        text += (f" Ours with SDPA (cuDNN) attention in place of our kernel takes "
                 f"{_ratio_to_anchor(q, SWAPPED, batch, run)}× the anchor's step at batch {batch} "
                 f"(run {run}): " + ("in this run our attention is the faster of the two in the step."
                                    if faster else "in this run our attention is slower than cuDNN's in the step."))
    fp32 = _last_run_with(rows, "ours-fp32_moments")
    if fp32:
        run, batch = fp32
        text += (f" Numerics: float32 AdamW moments beside the bf16 parameters peak at "
                 f"{q.cell('peak (GiB)', row_of(t, 'ours-fp32_moments', run, batch))} GiB against ours' "
                 f"{q.cell('peak (GiB)', row_of(t, 'ours', run, batch))} GiB (+"
                 + q.derive(lambda t: cell_of(t, 'ours-fp32_moments', 'peak (GiB)', batch, run)
                            - cell_of(t, 'ours', 'peak (GiB)', batch, run), '.2f', 'fp32 moments extra GiB')
                 + f" GiB, run {run}) for the step time in the table.")
    return text + _memory_sentence(q, rows)


def _memory_sentence(q: Quotes, rows: pd.DataFrame) -> str:
    """The fastest measured variant that spends free memory (ours-keep:N, ours-mm:N), per batch, against the
    anchor of its run."""
    t = q.frame
    sized = rows[rows["provider"].map(lambda p: sized_ablation(str(p)) is not None)]
    comparable = [is_measured(step_of(t, p, r, b)) and is_measured(step_of(t, "ours", r, b))
                  for p, r, b in zip(sized["provider"], sized["run"], sized["batch"])]
    sized = sized.loc[pd.Series(comparable, index=sized.index, dtype=bool)]  # with ours in its run
    said = []
    for batch in sorted(set(sized["batch"]), reverse=True):
        mine = sized[sized["batch"] == batch]
        best = mine.loc[mine[STEP].idxmin()]
        provider, run = best["provider"], best["run"]
        against = (f"{_ratio_to_anchor(q, provider, batch, run)}× the anchor's step"
                   if is_measured(cell_of(t, provider, RATIO, batch, run)) else
                   q.derive(lambda t, p=provider, b=batch, r=run: step_of(t, p, r, b) / step_of(t, "ours", r, b), ".3f",
                            f"{provider} over ours, run {run}") + "× ours' step (no anchor in its run)")
        said.append(f"at batch {batch}, `{provider}` (peak {q.cell('peak (GiB)', row_of(t, provider, run, batch))} GiB) "
                    f"takes {against}")
    if not said:
        return ""
    return (" Spending the memory selective checkpointing leaves free, the fastest measured variant: "
            + "; ".join(said) + ".")


def _auto_sentence(q: Quotes, frame: pd.DataFrame) -> str:
    """Whether the runs' `ours` chose its matmul-saving blocks itself (bench/leaderboard.py, `AUTO`): which rows
    chose is read from the results (`matmul_blocks`), what they chose is their step-table cells, each choice said
    once with the runs that share it."""
    ours = frame[(frame["provider"] == "ours") & (frame["status"] == "ok")]
    # a run of ours without `AUTO` (e.g. only the anchors and sized ablations) writes no matmul_blocks column
    chosen = ours.dropna(subset=["matmul_blocks"]) if "matmul_blocks" in ours.columns else ours.iloc[:0]
    if not len(chosen):
        return (" In these runs `ours` used plain selective checkpointing; it now chooses how many blocks save "
                "their matmul outputs itself, from a plain selective probe's peak (`probe_matmul_blocks`), which "
                "no run has measured yet.")
    rows = [row_of(q.frame, "ours", str(run)[:6], int(batch)) for run, batch in zip(chosen["run_id"], chosen["batch"])]
    shared: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        shared.setdefault((q.cell("checkpoint", row), q.cell("batch", row)), []).append(q.cell("run", row))
    return (" `ours` chose how many blocks also save their matmul outputs from a plain selective probe's peak "
            "(`selective:0,A then selective:0,B`: A blocks in the first pass, B in the passes that hold gradients): "
            + "; ".join(f"{choice} at batch {batch} (run{'s' if len(runs) > 1 else ''} {', '.join(runs)})"
                        for (choice, batch), runs in shared.items()) + ".")


NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])")  # a number as a reader of the prose sees one


def _provenance_words(first: pd.Series, commits: list[str]) -> tuple[str, ...]:
    """The numbers the intro prints that are provenance, not measurements (the device's name, the torch and Triton
    versions, the commits, the context length of the size): words of the sentence, declared as such."""
    names = [str(first[c]) for c in ("device_name", "torch_version", "triton_version", "context_length")] + commits
    # a commit is a word whole too: a reader (and the checker) sees 4e34639 as a number in scientific notation
    return tuple(number for name in names for number in NUMBER.findall(name)) + tuple(commits)


def _peak_tflops(device: str) -> float:
    """The device's dense bf16 datasheet peak in TFLOP/s, the MFU denominator (`timing.peak_flops`; NaN: none)."""
    from cs336_systems.timing import peak_flops  # here, not above: timing imports torch, which a report job need not

    return peak_flops(device, "bf16") / 1e12


def _peak_words(device: str) -> str:
    peak = _peak_tflops(device)
    if not is_measured(peak):
        return ("MFU divides TFLOP/s by the device's dense bf16 datasheet peak (`timing.PEAK_FLOPS`), which is not "
                "known for this device.")
    return f"MFU divides TFLOP/s by {peak:g} TFLOP/s, the {device}'s dense bf16 datasheet peak (`timing.PEAK_FLOPS`)."


def _b200_tflops() -> float:
    """The B200's dense bf16 peak (TFLOP/s) that the 2026 §8 analysis uses (report/parallelism_render.B200)."""
    from cs336_systems.report.parallelism_render import B200  # here: it imports sympy, which only §8 needs

    return B200.flops / 1e12


BEST_ENTRY_MS, BEST_ENTRY_GPUS, NAIVE_MS = 3837, 2, 10_000  # the published leaderboard, as issue 24 quotes it


def _entry_mfu(t: pd.DataFrame, batch: int) -> float:
    """The leaderboard's best entry's MFU (%) by our count: the FLOPs of ours' quoted step at the leaderboard's
    batch (TFLOP/s × step) over the entry's time and its GPUs' peak."""
    tflop = cell_of(t, "ours", "TFLOP/s", batch) * cell_of(t, "ours", STEP, batch) / 1e3
    return 100 * tflop / (BEST_ENTRY_MS / 1e3) / (BEST_ENTRY_GPUS * _b200_tflops())


def _flops_paragraph(q: Quotes, device: str, batches: list[int]) -> str:
    """How MFU is counted (causal attention as half the score matrix), the leaderboard's own measure (wall time),
    and its best entry's MFU by the same count over one stated B200 peak."""
    batch = _leaderboard_batch(q.frame, batches)
    counted = batch is not None and is_measured(cell_of(q.frame, "ours", "TFLOP/s", batch))
    text = ("MFU counts a step's FLOPs with `model.accounting.leaderboard_flops`: 6 × the non-embedding matmul "
            "parameters (the blocks' projections and MLP and the LM head) × tokens, plus 6 × layers × tokens × "
            "context × d_model for attention, half of full attention's 12 × layers × tokens × context × d_model because "
            "causal masking leaves only the score matrix's lower triangle to compute; recomputation is not counted, so checkpointing costs "
            f"time, not FLOPs. {_peak_words(device)} The leaderboard itself ranks wall time and gives no FLOP count. "
            f"Its best entry, as issue 24 quotes the handout's, took {BEST_ENTRY_MS:,} ms on two B200s (the naive "
            f"baseline: {NAIVE_MS:,} ms)")
    if not counted:
        return text + "; this device measures no MFU to compare it with."
    entry = q.derive(lambda t: _entry_mfu(t, batch), ".1f", "best entry's MFU % by our count")
    return (text + f": our count over two B200s at {_b200_tflops():,.0f} TFLOP/s each (the 2026 handout's B200 bf16 "
            f"figure, which §8 uses) makes that {entry}% MFU, against ours' {_mfu_percent(q, 'ours', batch)}% on one "
            f"{device} at batch {batch}.")


def _leaderboard_batch(t: pd.DataFrame, batches: list[int]) -> int | None:
    """The batch the answer quotes: the leaderboard's where ours measured it, else ours' largest measured one."""
    measured = [b for b in batches if is_measured(step_of(t, "ours", batch=b))]
    return HANDOUT_BATCH if HANDOUT_BATCH in measured else (measured[0] if measured else None)


def _steps_words(q: Quotes) -> str:
    """Each point's statistic: the mean of the timed steps after the warm-up steps (the rows' own counts)."""
    def span(column: str, what: str) -> str:
        measured = q.frame[q.frame[STEP].notna()][column]
        low = q.derive(lambda t: t[t[STEP].notna()][column].min(), ".0f", f"fewest {what}")
        return low if measured.nunique() == 1 else low + "–" + q.derive(
            lambda t: t[t[STEP].notna()][column].max(), ".0f", f"most {what}")

    return (f"the mean of {span(TIMED, 'timed steps')} timed steps after {span(WARMUP, 'warm-up steps')} untimed "
            "warm-up steps (the first, compilation included, is the column 'first step')")


def _answer_paragraph(q: Quotes, batches: list[int], first: pd.Series) -> str:
    """The deliverable first: ours' step time at the leaderboard's batch in the quoted run, what each point is, and
    (before that batch has a verdict, which states the spread of one commit's runs) the spread of that step over the
    runs of the same recipe."""
    t = q.frame
    lead = ("Answers the 2026 handout, section 9 (leaderboard), whose deliverable is the best wall-clock time of a "
            "full training step with AdamW.")
    batch = _leaderboard_batch(t, batches)
    if batch is None:
        return lead + " No step of ours is measured yet."
    row = row_of(t, "ours", batch=batch)
    text = (f"{lead} Ours takes {q.cell(STEP, row)} ms per step at batch {batch}, context {first['context_length']:,}, "
            f"on one {first['device_name']} (the leaderboard times two B200s), in the quoted run "
            f"{q.cell('run', row)}; every point of the step table is {_steps_words(q)}.")
    rows = _same_recipe_rows(t, batch)
    if len(rows) > 1 and len(verdict_runs(t, batch)) < VERDICT_RUNS:
        steps = "–".join(q.derive(lambda t, pick=pick: getattr(_same_recipe_rows(t, batch)[STEP], pick)(), ",.1f",
                                  f"{pick} step of ours' recipe, batch {batch}") for pick in ("min", "max"))
        runs = q.derive(lambda t: len(_same_recipe_rows(t, batch)), "d", f"runs of the recipe, batch {batch}")
        text += (f" Over the {runs} runs of the same recipe at that batch, made {_commits_words(q, batch, why=False)}, "
                 f"ours' step ranged {steps} ms.")
    return text


def _setup_paragraph(ctx: Context, q: Quotes, frame: pd.DataFrame) -> str:
    """What ran (the providers, the harness, the check) and the runs' kernel history: the appendix of the section,
    before the runs table."""
    first = frame.iloc[0]
    return (f"Setup and runs. {first['device_name']}, torch {first['torch_version']}, Triton "
            f"{first['triton_version']}; model size `{first['size']}`, one device. Each run builds and times its "
            "providers one after another in one process (`python -m cs336_systems.bench.leaderboard`, rule "
            "`leaderboard_8b`), one row of the runs table (sequences per pass below the batch: gradients "
            "accumulated over passes). "
            "`ours` is our TransformerLM with our FlashAttention (on this GPU the Gluon forward; the backward FA2's "
            "Triton kernel in the earliest runs, then Gluon's lockstep schedule, then Gluon's ping-pong schedule at "
            "head dim 128: which commit made each change is in kernels/flash/DECISIONS.md, \"Backward schedule\", and "
            "each run's commit in the runs table), fused LM head + cross-entropy, "
            "fused AdamW, selective checkpointing and per-block compile; `torch_plain_sac` and `torch_plain_ac` are "
            "plain PyTorch (SDPA, chunked checkpointed LM head + CE, torch's fused AdamW) with selective and with "
            "full per-block checkpointing. " + _check_sentence(ctx.frame("leaderboard_8b_check"))
            + _auto_sentence(q, frame))


def _check_sentence(checks: pd.DataFrame | None) -> str:
    """What the runs' correctness checks gave (results/leaderboard_8b_check.csv; none where no run ran one)."""
    if checks is None or not len(checks):
        return ""
    failed = checks[checks["status"] != "check_ok"]
    said = ("every provider passed in every run" if not len(failed) else
            "; ".join(f"`{p}` {s} in run {str(r)[:6]}" for p, s, r in
                      zip(failed["provider"], failed["status"], failed["run_id"])) + "; the others passed")
    return ("Each run first checked each provider's loss and gradients against a float32 reference at a scaled-down "
            "config with the same code paths (`results/leaderboard_8b_check.csv`): " + said + ".")


def _ablation_parts(ctx: Context, ablation: str) -> list[str]:
    """The ablation paragraph in the body; the ablation table (every run's) in the appendix."""
    return [ablation, appendix("the 8B step: every ablation of every run", ctx.table("leaderboard_8b_ablations"))]


def render_leaderboard(ctx: Context) -> Section:
    frame = bench_rows(ctx.frame("leaderboard_8b"))
    table = ctx.numeric("leaderboard_8b")
    q = Quotes(table)
    first = frame.iloc[0]
    batches = sorted(set(q.frame.loc[q.frame["provider"] == "ours", "batch"]), reverse=True)
    answer = _answer_paragraph(q, batches, first)
    gap = _gap_paragraph(q, batches)
    verdict = verdict_paragraph(q, HANDOUT_BATCH)
    flops = _flops_paragraph(q, first["device_name"], batches)
    ablation = _ablation_paragraph(q)
    pointer = profile_pointer(ctx)
    setup = _setup_paragraph(ctx, q, frame)
    quoted = lambda t: t[QUOTED].astype(bool) & ~is_ablation(t["provider"])  # noqa: E731
    main = ("run", "provider", "batch", STEP, "MFU", "TFLOP/s", "peak (GiB)", "checkpoint", RATIO)
    shown = tuple(h for h in main if h in table.headers)  # a device that measures no MFU (a CPU) has no such column
    verdicts = ctx.table("leaderboard_8b_verdict")  # printed once some batch has a verdict (the table's rows)
    parts = [answer, gap, verdict, *((verdicts,) if verdict_batches(q.frame) else ()),
             rows_of(table, quoted, shown).to_markdown(),
             f"_{statistic(ctx.table('leaderboard_8b'))}: the quoted runs' rows, main columns; the full step table has "
             f"{outline(table, ['run', 'provider', 'batch'])}._",
             appendix("the 8B step: every run and provider", ctx.table("leaderboard_8b")),
             *appendix_parts("the 8B step: how MFU is counted", [flops]),
             *(_ablation_parts(ctx, ablation) if ablation else ()),
             pointer, *appendix_parts("the 8B step: setup and runs", [setup]),
             appendix("the 8B step: the runs, their commits and settings", ctx.table("leaderboard_8b_runs"))]
    checked = [gap, answer, verdict, flops, *((ablation,) if ablation else ()), setup, pointer]
    peak = _peak_tflops(first["device_name"])
    wording = ("9", "0.9", "54", "6", "12", *((f"{peak:g}",) if is_measured(peak) else ()), str(POWER_LIMIT_W),
               f"{BEST_ENTRY_MS:,}", f"{NAIVE_MS:,}", f"{_b200_tflops():,.0f}", "24", "2026", "8",
               "128",  # the head dim the ping-pong backward ships at (kernels/flash/DECISIONS.md)
               str(VERDICT_RUNS), str(VERDICT_STEPS))
    kept = tuple(sized[1] for sized in map(sized_ablation, set(q.frame["provider"])) if sized)
    runs = tuple(dict.fromkeys(q.frame["run"]))
    provenance = _provenance_words(first, [str(c)[:7] for c in frame["git_commit"]])
    return Section(parts, table, checked, q.derived,
                   wording=wording + tuple(str(b) for b in batches) + kept + runs + provenance)


DELIVERABLES = [
    Deliverable("2026 §9 leaderboard: the 8B training step on one H200", "leaderboard_8b", render_leaderboard,
                ("leaderboard_8b",),
                tables=(Table("leaderboard_8b", "leaderboard_8b", step_table,
                              "One training step per provider per run; mean ± std over the timed steps; "
                              "ratio of means to the selective-checkpointing anchor of the same run and batch"),
                        Table("leaderboard_8b_ablations", "leaderboard_8b", ablation_table,
                              "Ablations of ours (every run's, each beside ours of its run and batch): mean step over ours' of the same run"),
                        Table("leaderboard_8b_verdict", "leaderboard_8b", verdict_table,
                              f"The verdict: {VERDICT_RUNS} or more runs of one commit, each its own process timing "
                              f"ours and the SAC anchor over at least {VERDICT_STEPS} steps; median, least and largest "
                              "over the runs of each point's mean step, of ours over the anchor, and of ours' MFU",
                              rows=verdict_rows),
                        Table("leaderboard_8b_runs", "leaderboard_8b", runs_table,
                              "The runs of the step table, in the order they ran: commit, date, providers timed, "
                              "warm-up and timed steps per point, ours' checkpointing and sequences per pass, "
                              "allocator setting; `quoted`: the run the prose quotes for its batch"))),
    # the leaderboard's own test (`--timer do_bench`, run after the bench): pending until a run records it
    Deliverable("2026 §9 leaderboard's own test: the 8B step timed by do_bench", "leaderboard_8b",
                render_handout, ("leaderboard_8b",),
                tables=(Table("leaderboard_8b_handout", "leaderboard_8b", handout_table,
                              "Ours timed by triton.testing.do_bench as the leaderboard's test times it, from empty "
                              "compilation caches: do_bench's mean ± std over its repetitions; beside it ours' mean "
                              "step in the bench's latest run before it (same batch and commit)"),)),
    # the profiled step (`--profile`, the rule's second output): its own section, pending until a run records it
    Deliverable("2026 §9 leaderboard, continued: where the 8B step's time and memory go", "leaderboard_8b",
                render_profile, ("leaderboard_8b_profile",),
                tables=(Table("leaderboard_8b_profile", "leaderboard_8b_profile", profile_table,
                              "One profiled step per provider (largest batch of the run): device time by category "
                              "(ms), the same time summed another way, and the step's wall time", rows=profiled_time),
                        Table("leaderboard_8b_memory", "leaderboard_8b_profile", memory_table,
                              "Peak memory of the profiled step by what holds it (GiB)", rows=profiled_memory))),
]
