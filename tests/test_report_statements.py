"""The writeup's statements that an audit found wrong or unsupported (issue 59's list), each now derived from the
results: every test changes a cell of the data and expects the sentence to change, or the section to fail its
prose check (tests/test_report.py's `unquoted`)."""

import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from cs336_systems.report.__main__ import make_tables
from cs336_systems.report.frame import NumericTable
from cs336_systems.report.section import Context, Quotes, Section
from tests.test_report import unquoted

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def results_copy(tmp_path: Path, *names: str, change=None) -> Context:
    """results/NAME.csv of each name copied to tmp_path, `change(name, frame)` applied to each (it returns the
    frame to write), and their tables rebuilt as the `table` rule does: a context over that folder."""
    (tmp_path / "tables").mkdir(exist_ok=True)
    for name in names:
        frame = pd.read_csv(RESULTS / f"{name}.csv")
        (change(name, frame) if change else frame).to_csv(tmp_path / f"{name}.csv", index=False)
    make_tables(tmp_path, None)
    return Context(tmp_path, tmp_path, tmp_path)


def committed_context() -> Context:
    """The committed results; figures are not what these tests read (a folder without them: 'not built')."""
    return Context(RESULTS, RESULTS / "no-figures-here", RESULTS)


# ---- 1. fsdp_accounting (b): exposed communication in a host-bound step: tests/test_report.py
# (test_fsdp_overlap_verdict_follows_the_gpu_busy_share)


# ---- 2. fsdp_accounting (a): the measured peaks set beside the accounting are forward+backward peaks ----------
def test_fsdp_accounting_measured_peaks_are_the_forward_backward_peaks():
    from cs336_systems.report.parallelism_render import fsdp_accounting_section

    table = NumericTable.load(RESULTS / "tables" / "fsdp_accounting.json")
    measured = pd.read_csv(RESULTS / "sharding.csv")
    text = fsdp_accounting_section(table, measured).markdown()
    assert "after the optimizer step" not in text
    assert "Measured forward+backward peaks (`peak_before_step_mib`" in text
    plain = (measured["config"] == "individual") & (measured["precision"] == "bf16")
    before = measured.loc[plain, "peak_before_step_mib"].iloc[0]
    assert f"{before:,.0f}" in text
    # the peak of forward+backward moves the row; the step's own peak does not
    moved = measured.copy()
    moved.loc[plain, "peak_before_step_mib"] = before + 1000
    assert f"{before + 1000:,.0f}" in fsdp_accounting_section(table, moved).markdown()
    moved = measured.copy()
    moved.loc[plain, "peak_after_step_mib"] = before + 1000
    assert f"{before + 1000:,.0f}" not in fsdp_accounting_section(table, moved).markdown()


# ---- 3. the FSDP and sharding tables label allocated memory and peaks apart --------------------------------
def test_fsdp_table_labels_allocated_after_init_apart_from_the_init_peak(tmp_path):
    from cs336_systems.report.sections.distributed import render_fsdp

    def change(name, frame):  # ours holds a different amount after init than its init peak, and than DDP
        ours = (frame["config"] == "fsdp") & (frame["size"] == "xl") & (frame["precision"] == "bf16")
        return frame.assign(mem_after_init_mib=frame["mem_after_init_mib"].where(~ours, 1234.0))

    body = render_fsdp(results_copy(tmp_path, "fsdp", change=change))
    assert unquoted(body) == []
    table = body.table
    row = table.row(size="xl", precision="bf16", config="fsdp")
    assert table.quote("allocated after init (MiB)", row) == "1,234"
    frame = pd.read_csv(RESULTS / "fsdp.csv")
    init_peak = frame[(frame["config"] == "fsdp") & (frame["size"] == "xl") & (frame["precision"] == "bf16")]
    assert table.quote("peak during init (MiB)", row) == f"{init_peak['peak_after_init_mib'].iloc[0]:,.0f}"
    line = next(p for p in body.checked if p.startswith("xl, bf16"))
    assert "allocated after init 1,234 MiB (ours)" in line
    ddp = frame[(frame["config"] == "bucketed:1000") & (frame["size"] == "xl") & (frame["precision"] == "bf16")]
    assert f"{ddp['mem_after_init_mib'].iloc[0]:,.0f} MiB (bucketed:1000)" in line
    assert unquoted(replace(body, checked=[p.replace("1,234 MiB (ours)", "1,235 MiB (ours)") for p in body.checked]))


def test_sharding_table_says_which_columns_are_allocated_and_which_are_peaks():
    table = NumericTable.load(RESULTS / "tables" / "sharding.json")
    memory = [h for h in table.headers if h.endswith("(MiB)") and "formula" not in h]
    assert memory and all(h.startswith(("allocated ", "peak ")) for h in memory), memory
    frame = pd.read_csv(RESULTS / "sharding.csv")
    ok = frame[frame["status"] == "ok"].reset_index(drop=True)
    assert list(table.data["allocated after init (MiB)"]) == list(ok["mem_after_init_mib"])


# ---- 4. torch_compile (b): the trend of the block-compiled speed-up is the table's -----------------------------
def _compile_trend(table: NumericTable) -> str:
    from cs336_systems.report.sections.benchmarking import _speedup_by_size

    return _speedup_by_size(Quotes(table), "speed-up, blocks", lambda t: pd.Series(True, index=t.index))


def test_compile_speedup_trend_is_named_only_where_every_size_continues_it():
    table = NumericTable.load(RESULTS / "tables" / "compile_timing.json")
    text = _compile_trend(table)
    for mode, rows in table.data.groupby("mode", sort=False):
        steps = rows["speed-up, blocks"].diff().dropna()
        trend = ("falls with size" if (steps < 0).all() else "grows with size" if (steps > 0).all()
                 else "no steady trend with size")
        assert f"{mode} ({trend}): " + ", ".join(
            f"{v:.2f}× ({size})" for v, size in zip(rows["speed-up, blocks"], rows["size"])) in text
    assert ("Where it falls with size" in text) == ("falls with size)" in text)
    # a table whose forward speed-ups fall at every size: the sentence says so
    forward = table.data["mode"] == "forward"
    falling = table.data.copy()
    falling.loc[forward, "speed-up, blocks"] = [3.0 - 0.3 * i for i in range(int(forward.sum()))]
    text = _compile_trend(NumericTable(falling, table.columns, table.status))
    assert "forward (falls with size): 3.00× (small)" in text and "Where it falls with size" in text


# ---- 5. 2.2: what overlapping recovers is what the table shows ----------------------------------------------
def test_ddp_naive_overlap_claim_follows_torch_ddps_forward_backward(tmp_path):
    from cs336_systems.report.sections.distributed import overlap_in_this_table

    table = NumericTable.load(RESULTS / "tables" / "ddp_naive.json")
    q = Quotes(table)
    text = overlap_in_this_table(table, q, "bf16")
    frame = pd.read_csv(RESULTS / "ddp_naive.csv").set_index(["precision", "config"])
    extra = frame.loc[("bf16", "torch_ddp"), "forward_backward_ms"] - frame.loc[("bf16", "none"), "forward_backward_ms"]
    wait = frame.loc[("bf16", "naive"), "communication_ms"]
    assert f"{extra:.1f} ms longer than none's, against naive's wait of {wait:.1f} ms" in text
    assert ("hid at most half" in text) == (extra >= wait / 2)
    assert "recovers" not in text

    def hidden(name, rows):  # torch DDP's forward+backward barely above none's: the overlap hid the wait
        chosen = (rows["precision"] == "bf16") & (rows["config"] == "torch_ddp")
        none = rows.loc[(rows["precision"] == "bf16") & (rows["config"] == "none"), "forward_backward_ms"].iloc[0]
        return rows.assign(forward_backward_ms=rows["forward_backward_ms"].where(~chosen, none + 2.0))

    changed = results_copy(tmp_path, "ddp_naive", change=hidden).numeric("ddp_naive")
    text = overlap_in_this_table(changed, Quotes(changed), "bf16")
    assert "2.0 ms longer than none's" in text and "overlapping hid most of that wait here" in text


# ---- 6. end to end: whether the xl measurements rank the wrappers -------------------------------------------
DDP_TABLES = ("ddp_naive", "ddp_individual", "ddp_bucketed")


def _with_spread(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "ddp_spread.csv", tmp_path)


def test_xl_ranking_states_the_rounds_and_the_spread_of_torch_ddp_across_runs(tmp_path):
    from cs336_systems.analysis.ddp import rounds_needed
    from cs336_systems.report.sections.training import xl_ranking

    text = xl_ranking(committed_context())
    need = rounds_needed(pd.read_csv(RESULTS / "ddp_spread.csv"))["rounds"]
    steps = {name: pd.read_csv(RESULTS / f"{name}.csv").set_index(["precision", "config"]).loc[
        ("bf16", "torch_ddp"), "step_ms"] for name in DDP_TABLES}
    assert text.startswith("Nor do the xl measurements") and f"where {need} are needed" in text
    assert all(f"{step:.1f} ms" in text for step in steps.values())

    def slower(name, rows):  # another torch DDP step in the bucketed run
        chosen = (rows["precision"] == "bf16") & (rows["config"] == "torch_ddp")
        return rows.assign(step_ms=rows["step_ms"].where(~chosen, 171.5)) if name == "ddp_bucketed" else rows

    _with_spread(tmp_path)
    assert "171.5 ms (2.3 bucketed)" in xl_ranking(results_copy(tmp_path, *DDP_TABLES, change=slower))

    def enough(name, rows):
        return rows.assign(rounds=need)

    assert xl_ranking(results_copy(tmp_path, *DDP_TABLES, change=enough)).startswith(
        "The xl measurements of 2.2–2.3 rank them")


# ---- 9. end to end: which steps the speeds are medians of, and how much that choice moves them ---------------
def test_train_matrix_states_its_steps_and_the_all_step_medians(tmp_path):
    from cs336_systems.report.sections.training import render_train_matrix

    def render(ctx):
        return render_train_matrix(ctx)

    raw = pd.read_csv(RESULTS / "train_matrix.csv")
    body = render(committed_context())
    assert unquoted(body) == []
    last = int(raw["step"].max())
    assert f"medians over steps {last // 2 + 1}–{last}, the second half" in body.parts[0]
    change = {}
    for key, run in raw.groupby(["attention", "wrapper"]):
        half = run[run["step"] > last // 2]["step_ms"].median()
        change[key] = half / run["step_ms"].median() - 1  # tokens/s over every step relative to the second half's
    worst = max(change, key=lambda k: abs(change[k]))
    said = next(p for p in body.checked if p.startswith("Medians over every step"))
    assert f"by up to {100 * abs(change[worst]):.0f}%" in said
    assert f"({worst[1]} with {worst[0]} attention:" in said

    def slow_start(name, rows):  # single-GPU naive-attention run: its first half three times slower
        chosen = (rows["attention"] == "naive") & (rows["wrapper"] == "none") & (rows["step"] <= last // 2)
        return rows.assign(step_ms=rows["step_ms"].where(~chosen, rows["step_ms"] * 3))

    changed = render(results_copy(tmp_path, "train_matrix", change=slow_start))
    said = next(p for p in changed.checked if p.startswith("Medians over every step"))
    assert "(single GPU with naive attention:" in said
    assert unquoted(changed) == []
    # the committed sentence no longer fits the changed table: the check fails
    assert unquoted(replace(changed, checked=body.checked, derived=body.derived))


# ---- 8. flash benchmarking: the short-sequence backward is the bf16 rows' -----------------------------------
def test_flash_short_backward_median_is_of_the_dtype_the_paragraph_is_about():
    from cs336_systems.report.sections.flash_sweep import render_flash_sweep

    body = render_flash_sweep(committed_context())
    raw = pd.read_csv(RESULTS / "flash_sweep.csv")
    ours = raw[(raw["provider"] == "flash_triton") & (raw["pass"] == "backward") & (raw["seq_len"] <= 1024)
               & (raw["status"] == "ok")]
    bf16 = ours[ours["dtype"] == "bf16"]["median_ms"].median()
    paragraph = next(p for p in body.checked if p.startswith("Against PyTorch SDPA"))
    assert f"our bf16 backward alone takes a median {bf16:.3f} ms" in paragraph
    assert unquoted(body) == []

    def scaled(dtype: str) -> Section:
        data = body.table.data.copy()
        rows = (data["dtype"] == dtype) & (data["pass"] == "backward")
        data.loc[rows, "flash_triton"] *= 2
        return replace(body, table=NumericTable(data, body.table.columns, body.table.status))

    assert not [p for p in unquoted(scaled("fp32")) if "short backward" in p]  # fp32 rows are not pooled in
    assert [p for p in unquoted(scaled("bf16")) if "short backward" in p]


# ---- 10. memory_profiling: the forward's rise is the forward's own peak less the level before it ---------------
def test_memory_forward_rise_is_the_forwards_own_peak(tmp_path):
    from cs336_systems.report.sections.memory import render_memory

    raw = pd.read_csv(RESULTS / "memory.csv")
    point = raw[(raw["mode"] == "train_step") & (raw["precision"] == "fp32")
                & (raw["context_length"] == raw["context_length"].max())].iloc[0]
    rise = point["forward_peak_mib"] - point["forward_start_mib"]
    body = render_memory(committed_context())
    timelines, peaks = body.checked[0], body.checked[1]
    assert f"({rise:,.0f} MiB in fp32 at context" in timelines
    assert f"the forward raises memory by {rise:,.0f} MiB (its peak less the level before it)" in peaks
    fwd_bwd = max(point["forward_peak_mib"], point["backward_peak_mib"]) - point["forward_start_mib"]
    assert f"{fwd_bwd:,.0f}" not in timelines + peaks  # the forward+backward rise is not called the forward's

    def higher(name, rows):  # the forward's peak 500 MiB higher
        chosen = (rows["mode"] == "train_step") & (rows["precision"] == "fp32") & (
            rows["context_length"] == rows["context_length"].max())
        return rows.assign(forward_peak_mib=rows["forward_peak_mib"].where(~chosen, rows["forward_peak_mib"] + 500))

    shutil.copy(RESULTS / "memory_allocations.csv", tmp_path)
    changed = render_memory(results_copy(tmp_path, "memory", change=higher))
    assert f"the forward raises memory by {rise + 500:,.0f} MiB" in changed.checked[1]
    assert unquoted(changed) == []


# ---- 11. all-reduce: sizes in MiB, as the bench allocates them --------------------------------------------
def test_allreduce_sizes_are_mebibytes(tmp_path):
    from cs336_systems.report.sections.distributed import render_allreduce

    source = (ROOT / "cs336_systems" / "bench" / "allreduce.py").read_text()
    assert "size_mb * 2**20" in source  # the bench's 'MB' are 2**20 bytes
    body = render_allreduce(committed_context())
    assert "size (MiB)" in body.table.headers and " MB" not in body.markdown()
    largest = pd.read_csv(RESULTS / "allreduce.csv")["size_mb"].max()

    def doubled(name, rows):
        return rows.assign(size_mb=rows["size_mb"].where(rows["size_mb"] != largest, 2 * largest))

    assert f"{largest:g} MiB all-reduced in" in body.checked[0]
    changed = render_allreduce(results_copy(tmp_path, "allreduce", change=doubled))
    assert f"{2 * largest:g} MiB all-reduced in" in changed.checked[0]


# ---- 12. the DDP figure says what `none` ran ---------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 4])
def test_ddp_figure_axis_names_the_ranks_none_ran_on(ranks):
    from cs336_systems.report.figures import ddp_wrapper_axis_label

    rows = pd.DataFrame({"config": ["none", "naive", "torch_ddp"], "world_size": ranks})
    label = ddp_wrapper_axis_label(rows)
    assert f"none = {ranks} ranks training alone" in label and "one process" not in label
    assert ddp_wrapper_axis_label(rows[rows["config"] != "none"]) == "wrapper"
    committed = pd.read_csv(RESULTS / "ddp_naive.csv")
    none_ranks = committed.loc[committed["config"] == "none", "world_size"].iloc[0]
    assert f"none = {none_ranks} ranks" in ddp_wrapper_axis_label(committed)
