"""Report helpers on synthetic inputs with known answers: allocator snapshots (real ones need CUDA),
profiler traces and the training-matrix table."""

import os
import pickle
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from cs336_systems.analysis import snapshot as snapshots
from cs336_systems.report import memory
from cs336_systems.report.__main__ import make_tables
from cs336_systems.report.appendix import appendix
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Quotes, Section, column_values, formula_frame
from cs336_systems.report.sections import DELIVERABLES

MiB = 2**20


def _event(action, size, filename="/x/cs336_systems/model/transformer.py", line=10, name="forward"):
    return {"action": action, "addr": 0, "size": size, "frames": [
        {"filename": "/torch/nn/module.py", "line": 1, "name": "_call_impl"},
        {"filename": filename, "line": line, "name": name}]}


# 100 MiB made before recording stays live; an 8 MiB tensor made before recording is freed in it.
SNAPSHOT = {"segments": [{"device": 0, "blocks": [
    {"size": 100 * MiB, "state": "active_allocated"}, {"size": 4 * MiB, "state": "active_allocated"},
    {"size": 60 * MiB, "state": "inactive"}]}], "device_traces": [[
    _event("free_completed", 8 * MiB),
    _event("alloc", 4 * MiB), _event("alloc", 16 * MiB, line=42, name="attention"),
    _event("free_requested", 16 * MiB), _event("free_completed", 16 * MiB),
    _event("alloc", 4 * MiB), _event("segment_alloc", 64 * MiB), _event("free_completed", 4 * MiB),
]]}


def test_active_timeline_starts_from_what_was_live_before_recording():
    xs, ys = snapshots.active_timeline(SNAPSHOT)
    assert ys == [100, 104, 120, 104, 108, 104]  # ends at the 104 MiB the segments hold at the dump
    assert xs == [0, 1, 2, 4, 5, 7]


def test_largest_allocations_name_our_code():
    rows = memory.largest_allocations(SNAPSHOT, n=2)
    assert rows[0] == {"size_mib": 16, "count": 1, "origin": "transformer.py:42 (attention)"}
    assert rows[1] == {"size_mib": 4, "count": 2, "origin": "transformer.py:10 (forward)"}


def test_cli_draws_and_tabulates(tmp_path):
    path = tmp_path / "forward_fp32_128.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    memory.main([str(path), "--figures-dir", str(tmp_path / "figs"), "--out", str(tmp_path / "a.csv")])
    assert (tmp_path / "figs" / "forward_fp32_128.png").stat().st_size > 1000
    table = pd.read_csv(tmp_path / "a.csv")
    assert table["size_mib"].tolist()[:2] == [16, 4]


def test_trace_lanes_and_overlap():
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 110, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 150, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 160, "dur": 20},
    ]
    lanes = traces.lanes(events)
    assert lanes["backward"] == [(100.0, 200.0)] and lanes["compute"] == [(110.0, 160.0)]
    assert len(lanes["communication"]) == 2
    # merged communication 150..250 (100 µs), of which 150..200 is inside backward
    assert traces.overlap_fraction(lanes["communication"], lanes["backward"]) == 0.5


def test_trace_exposed_communication():
    """Communication while no compute runs, overall and inside the forward / backward ranges; an
    all-gather (gloo's CPU op name too) counts as communication."""
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "forward", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 0, "dur": 30},  # 0..20 exposed
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 20, "dur": 70},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum", "ts": 80, "dur": 40},  # 90..100, 100..120
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 110, "dur": 5},  # covers 110..115
    ]
    lanes = traces.lanes(events)
    assert lanes["forward"] == [(0.0, 100.0)] and len(lanes["communication"]) == 2
    assert traces.exposed_ms(lanes["communication"], lanes["compute"]) == (20 + 10 + 15) / 1e3
    assert traces.exposed_ms(lanes["communication"], lanes["compute"], lanes["forward"]) == (20 + 10) / 1e3
    assert traces.exposed_ms(lanes["communication"], lanes["compute"], lanes["backward"]) == 15 / 1e3
    assert traces.COMMUNICATION.search("c10d::allgather_") and traces.COMMUNICATION.search("ReduceScatter")


def test_trace_host_side_of_backward():
    """Collectives called during backward are counted with their CPU time; GPU busy share of backward."""
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 120, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 170, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 300, "dur": 10},  # after backward
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 110, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 90, "dur": 30},  # 100..120 inside
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 150, "dur": 20},
    ]
    found = traces.host_side(events, traces.lanes(events)["backward"])
    assert found == {"collectives_in_backward": 2, "host_collective_ms_in_backward": 0.04, "backward_ms": 0.1,
                     "gpu_busy_in_backward": 0.4}


def test_train_matrix_table_speed_and_loss_drift():
    """Speed from the second half of the steps; drift is the largest per-step gap to torch DDP."""
    from cs336_systems.report.tables import train_matrix

    def run(wrapper, world, losses, ms):
        return pd.DataFrame({"step": [1, 2, 3, 4], "loss": losses, "step_ms": ms, "attention": "sdpa",
                             "wrapper": wrapper, "world_size": world, "tokens_per_step": 1000,
                             "peak_memory_mib": float("nan")})

    frame = pd.concat([run("torch_ddp", 2, [4.0, 3.0, 2.0, 1.0], [900, 10, 10, 10]),
                       run("none", 1, [4.0, 3.0, 2.5, 1.0], [900, 20, 20, 20])])
    numeric = train_matrix(frame)
    table = numeric.data.set_index("wrapper")
    assert table.loc["torch_ddp", "step (ms, median)"] == 10 and table.loc["torch_ddp", "tokens/s"] == 100_000
    assert table.loc["single GPU", "max |loss − torch DDP|"] == 0.5
    assert table.loc["single GPU", "ranks"] == 1 and table.loc["single GPU", "final loss"] == 1.0
    # no peak memory off CUDA: printed as a dash, and tokens/s with thousands separators
    assert numeric.quote("peak memory (MiB)", wrapper="torch_ddp") == "—"
    assert numeric.quote("tokens/s", wrapper="torch_ddp") == "100,000"


def test_writeup_html_keeps_tables_and_figure_links(tmp_path):
    from cs336_systems.report import html

    source = tmp_path / "writeup.md"
    source.write_text("# Results & more\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![fig](../figures/x.png)\n")
    html.main([str(source), "--out", str(tmp_path / "writeup.html")])
    page = (tmp_path / "writeup.html").read_text()
    assert "<title>Results &amp; more</title>" in page
    assert "<table>" in page and "<td>2</td>" in page
    assert '<img alt="fig" src="../figures/x.png"' in page


def test_kernel_labels_name_the_operation():
    from cs336_systems.report.profile_tables import kernel_label

    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
           "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor"
           "<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)")
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, "
            "at::native::Sqrt<float> >(at::native::(anonymous namespace)::TensorListMetadata<2>)")
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>(float*, int, bool)"
    assert kernel_label(mul) == "vectorized_elementwise_kernel<MulFunctor>"
    assert kernel_label(adam) == "multi_tensor_apply_kernel<Sqrt>"
    assert kernel_label(softmax) == "(anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>"
    assert kernel_label("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"


def test_profile_kernels_drop_ranges_and_merge_instances():
    """torch.optim's `Optimizer.step#AdamW.step` range shows up on the GPU timeline; it is not a kernel."""
    from cs336_systems.report.profile_tables import profile_kernels_of

    rows = pd.DataFrame({
        "kind": ["kernel"] * 4 + ["harness"], "phase": ["optimizer"] * 3 + ["forward"] * 2,
        "name": ["Optimizer.step#AdamW.step", "void at::native::elementwise_kernel<128, at::native::MulFunctor<float> >(int)",
                 "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float> >(int)",
                 "gemm", "forward"],
        "calls_per_step": [1, 2, 3, 4, 1], "ms_per_step": [10.0, 1.0, 2.0, 5.0, 6.0], "size": "xl"})
    kernels = profile_kernels_of(rows).set_index(["phase", "name"])["ms_per_step"]
    assert kernels.to_dict() == {("forward", "gemm"): 5.0, ("optimizer", "elementwise_kernel<MulFunctor>"): 1.0,
                                 ("optimizer", "vectorized_elementwise_kernel<MulFunctor>"): 2.0}


# --- Each section's prose quotes the table it embeds --------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])(%?)")


def prose_numbers(paragraph: str) -> list[tuple[str, bool]]:
    """The numbers a paragraph states, each with whether it is a percentage (code spans are names, not data)."""
    text = re.sub(r"`[^`]*`", " ", paragraph)
    return [(found[0].removesuffix("%"), bool(found[1])) for found in NUMBER.finditer(text)]


def printed(token: str) -> str:
    return token.replace(",", "").replace("−", "-").lstrip("+")


def printed_by_cells(table: NumericTable) -> set[tuple[str, bool]]:
    """Every number a numeric table's cells print, as the prose would state it (with whether it is a
    percentage): a number of the prose must be one of these exactly, printed by the cell's own format."""
    return {(printed(token).lstrip("-"), percent) for cell in table.cell_texts() for token, percent in prose_numbers(cell)}


def in_table(token: str, percent: bool, table: NumericTable) -> bool:
    """Whether some cell of the table prints `token` exactly (a prose 125.7 does not quote a cell 125.72)."""
    return (printed(token).lstrip("-"), percent) in printed_by_cells(table)


def unquoted(section: Section) -> list[str]:
    """What in a section's checked prose is not its table's: numbers that are neither a cell nor a declared
    derived value nor wording, and derived values the table no longer gives."""
    frame = formula_frame(section.table)
    problems = [f"{d.what}: the prose says {d.text}, the table gives {format(d.formula(frame), d.fmt)}"
                for d in section.derived if format(d.formula(frame), d.fmt) != d.text]
    declared = {printed(d.text).lstrip("-") for d in section.derived} | {printed(w) for w in section.wording}
    for paragraph in section.checked:
        for token, percent in prose_numbers(paragraph):
            if printed(token).lstrip("-") not in declared and not in_table(token, percent, section.table):
                problems.append(f"{token}{'%' if percent else ''} in: {paragraph[:100]}…")
    return problems


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def committed(request):
    """The sections rendered from the committed GPU results (as results/writeup.md is)."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.writeup import render

    here = Path.cwd()
    os.chdir(ROOT)  # figure links are relative to the working directory
    try:
        ctx = Context(Path("results"), Path("figures"), Path("results"))
        # sections whose data is not measured yet render as the writeup shows them: a pending line
        yield {item.section: item.render(ctx) if all(ctx.frame(name) is not None for name in item.data)
               else render(item, ctx) for item in DELIVERABLES}
    finally:
        os.chdir(here)


# The sections whose prose is picked from the table they embed; the others still compute their text
# from the results rows (each is a Section once converted, and is then checked below).
QUOTING = ["1.1.3 (b)", "1.1.3 (c)", "1.1.4 (a–e)", "1.1.5 (c) fp32", "1.1.6 (a–e)", "1.2.1", "1.3.1 (a)", "1.3.1 (b) torch_compile",
           "1.3.2 flash_forward", "1.3.2 (e) flash_benchmarking", "1.3.2 (e), continued", "1.3.3",
           "1.3.3, continued", "2.1",
            "2.2", "2.3 ddp_overlap_individual_parameters_benchmarking (a)", "2.3 ddp_bucketed", "End to end",
           "2026 §9 leaderboard:", "2026 §9 leaderboard, continued", "1.3.1 (b), continued: the optimizer step",
           "2026 §3.1", "2026 §3.2 gradient_checkpointing (a)",
           "2026 §3.2 gradient_checkpointing (b)", "2026 §9 leaderboard parts", "2026 §7 fsdp_accounting (a)"]


@pytest.mark.parametrize("section", [item.section for item in DELIVERABLES])
def test_section_prose_quotes_the_table_it_embeds(committed, section):
    body = committed[section]
    if not isinstance(body, Section):
        assert not section.startswith(tuple(QUOTING))
        item = next(item for item in DELIVERABLES if item.section == section)
        pytest.skip("embeds no table" if not item.tables else
                    "prose computed from the results rows, not yet from its table")
    # the table checked is the one shown: the embedded Markdown is this frame's
    assert body.table.to_markdown(index=False) in body.markdown()
    assert body.checked and all(paragraph in body.parts for paragraph in body.checked)
    assert unquoted(body) == []
    embeds = ("|", "_", "![")
    others = [p for p in body.parts if p not in body.checked and not p.lstrip().startswith(embeds)]
    print(f"{section}: {len(body.checked)} paragraphs checked; from other data:", *others, sep="\n  ")


def test_every_quoting_section_is_a_section(committed):
    quoting = [s for s in committed if s.startswith(tuple(QUOTING))]
    assert len(quoting) == len(QUOTING) and all(isinstance(committed[s], Section) for s in quoting)


def test_compile_prose_states_the_block_speedup_column(committed):
    """The compile section quotes its table's 'speed-up, blocks' range, and a changed number is caught."""
    body = committed["1.3.1 (b) torch_compile: compiled versus vanilla Transformer"]
    speedups = column_values(body.table, "speed-up, blocks").dropna()
    lead = body.checked[0]
    assert f"{speedups.min():.2f}–{speedups.max():.2f}×" in lead
    assert f"median {speedups.median():.2f}×" in lead

    wrong = f"{speedups.max() + 0.07:.2f}"  # e.g. a range copied from another scope or an earlier run
    perturbed = replace(body, checked=[lead.replace(f"{speedups.max():.2f}", wrong), *body.checked[1:]])
    assert any(problem.startswith(wrong) for problem in unquoted(perturbed))


def test_a_table_that_no_longer_gives_a_derived_number_is_caught(committed):
    body = committed["1.3.1 (b) torch_compile: compiled versus vanilla Transformer"]
    data = body.table.data.assign(**{"speed-up, blocks": body.table.data["speed-up, blocks"] * 1.1})
    problems = unquoted(replace(body, table=NumericTable(data, body.table.columns, body.table.status)))
    assert any("block-compiled speed-up" in problem for problem in problems)


def test_prose_check_on_a_known_table():
    """Cells match exactly as printed, derived numbers are recomputed, anything else is reported."""
    table = NumericTable(pd.DataFrame({"size": ["small", "xl"], "step (ms)": [20.8412, 125.7189],
                                       "std (ms)": [0.28, 18.5111], "MFU": [0.205, 0.284]}),
                         (Col("size"), Col("step (ms)", ".2f", second="std (ms)"), Col("MFU", ".1%")))
    quotes = Quotes(table)
    ratio = quotes.derive(lambda t: column_values(t, "step (ms)").iloc[1] / column_values(t, "step (ms)").iloc[0],
                          ".2f", "xl over small")
    good = f"xl takes 125.72 ms (std 18.51), {ratio}× small's 20.84 ms, at 28.4% MFU; `nvjet_sm90_128x64` is a name."
    section = Section([good], table, [good], quotes.derived)
    assert unquoted(section) == []
    assert unquoted(replace(section, checked=[good.replace("125.72", "125.92")])) == ["125.92 in: " + good.replace(
        "125.72", "125.92")[:100] + "…"]
    assert unquoted(replace(section, checked=[good.replace("125.72", "125.7")]))  # a cell at another precision
    assert unquoted(replace(section, checked=[good.replace("28.4%", "28.4")]))  # 28.4 is no cell; 28.4% is
    assert unquoted(replace(section, checked=[good + " It ran 3 times."]))  # a number the table does not hold
    assert unquoted(replace(section, checked=[good + " It ran 3 times."], wording=("3",))) == []


def test_ddp_specs_come_from_the_rows_columns():
    """The report reads each DDP config from its row's dp_kind / bucket_mb / optimizer_sharding columns
    (written by the benchmark from its spec) as the library's DataParallelSpec, not from the config string."""
    from cs336_systems.distributed import DataParallelSpec
    from cs336_systems.report.sections.distributed import ddp_specs

    frame = pd.DataFrame({"config": ["bucketed:100+sharded", "torch_ddp+zero", "individual-thread", "torch_ddp:1"],
                          "dp_kind": ["bucketed", "torch_ddp", "individual-thread", "torch_ddp"],
                          "bucket_mb": [100.0, None, None, 1.0],
                          "optimizer_sharding": ["sharded", "zero", "none", "none"]})
    specs = ddp_specs(frame)
    assert specs["bucketed:100+sharded"] == DataParallelSpec("bucketed", 100.0, "sharded")
    assert specs["torch_ddp+zero"] == DataParallelSpec("torch_ddp", None, "zero")
    assert specs["individual-thread"] == DataParallelSpec("individual-thread")
    assert str(specs["bucketed:100+sharded"].wrapper) == "bucketed:100" and str(specs["torch_ddp:1"].wrapper) == "torch_ddp:1"
    for path in ("sharding.csv", "ddp_naive.csv", "ddp_individual.csv", "ddp_bucketed.csv"):
        for config, spec in ddp_specs(pd.read_csv(ROOT / "results" / path)).items():
            assert spec == DataParallelSpec.parse(config), (path, config)  # columns and text agree
    with pytest.raises(ValueError, match="unknown data-parallel kind 'individual-inline'"):
        ddp_specs(frame.assign(dp_kind="individual-inline"))


def test_sections_without_data_say_pending_naming_their_rule(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.writeup import render

    ctx = Context(tmp_path, tmp_path, tmp_path)
    for item in DELIVERABLES:
        body = render(item, ctx, device="cpu")
        if item.data and item.cuda_only:
            assert body.startswith("not measured at this scale, which runs on the cpu"), item.section
        elif item.data:
            assert body.startswith(f"pending: rule `{item.rule}` has not produced {tmp_path / item.data[0]}.csv"), body


def test_each_section_embeds_only_the_tables_and_figures_it_owns():
    """The registry's tables and figures (which the workflow builds) are the ones the sections embed."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections import FIGURES

    class Recording(Context):
        def table(self, name):
            self.embedded.append(("table", name))
            return super().table(name)

        def figure(self, name, caption):
            self.embedded.append(("figure", name))
            return super().figure(name, caption)

    here = Path.cwd()
    os.chdir(ROOT)
    try:
        for item in DELIVERABLES:
            ctx = Recording(Path("results"), Path("figures"), Path("results"))
            ctx.embedded = []
            if any(ctx.frame(name) is None for name in item.data):
                continue  # not measured yet (the writeup says pending); the smoke run renders it
            body = item.render(ctx)
            if isinstance(body, str) and "Pending:" in body:
                continue  # its rows are not in the shared results file yet (the leaderboard's own test)
            tables = {name for kind, name in ctx.embedded if kind == "table"}
            figures = {name for kind, name in ctx.embedded if kind == "figure" and name in FIGURES}
            assert tables == {t.name for t in item.tables}, item.section
            assert figures == {f.name for f in item.figures}, item.section
    finally:
        os.chdir(here)


# ---- figures: what each drawing shows, checked on the figure object before it is written -----------
@pytest.fixture
def drawn(monkeypatch):
    """The figures the figure functions would save (save_figure captured), keyed by title."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import figures, memory, traces
    from cs336_systems.report.sections import checkpointing

    captured = {}

    def capture(fig, path, title, rows=None):
        captured[title] = (fig, None if rows is None else figures.provenance_stamp(rows))

    for module in (figures, memory, traces, checkpointing):  # every module that draws a figure
        monkeypatch.setattr(module, "save_figure", capture)
    yield captured
    for fig, _ in captured.values():
        plt.close(fig)


def _labels(fig) -> set[str]:
    return {label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]} | {
        t.get_text() for legend in fig.legends for t in legend.get_texts()}


def test_provenance_stamp_lists_every_device_and_short_commit():
    from cs336_systems.report.figures import provenance_stamp

    rows = pd.DataFrame({"device_name": ["NVIDIA H200", "NVIDIA H200", "cpu (x86_64, 32 cores)"],
                         "git_commit": ["004f3b2ff7aa2787", "dea68a894e45d1cc+dirty", None]})
    assert provenance_stamp(rows) == "NVIDIA H200, cpu (x86_64, 32 cores) · commit 004f3b2, dea68a8+dirty"
    assert provenance_stamp(pd.DataFrame({"x": [1]})) == "? · commit ?"


def test_every_committed_figure_is_stamped_and_has_no_bars_on_a_log_axis(drawn):
    """Drawn from the committed results as the figure rule does (extra inputs included)."""
    from matplotlib.container import BarContainer

    from cs336_systems.report.sections import FIGURES

    for name, figure in FIGURES.items():
        paths = [ROOT / "results" / f"{data}.csv" for data in (figure.data, *figure.also)]
        if not paths[0].exists():
            continue
        frame = pd.concat([pd.read_csv(p).assign(results_file=p.stem) for p in paths if p.exists()],
                          ignore_index=True)
        drawn.clear()
        figure.draw(frame, "unused.png")
        (fig, stamp), = drawn.values()
        assert stamp is not None and "commit ?" not in stamp and not stamp.startswith("?"), name
        for ax in fig.axes:
            if ax.get_yscale() == "log":
                assert not any(isinstance(c, BarContainer) for c in ax.containers), name


def _ddp_rows(run, configs, precision="bf16", commit="a" * 40):
    return pd.DataFrame({"config": configs, "precision": precision, "status": "ok", "results_file": run,
                         "step_ms": [100.0 + i for i in range(len(configs))], "step_std_ms": [5.0] * len(configs),
                         "step_median_ms": [90.0 + i for i in range(len(configs))],  # not what the figure draws
                         "device_name": "NVIDIA H200", "git_commit": commit})


def test_ddp_bucketed_figure_shows_the_baselines_with_means_and_stds(drawn):
    from cs336_systems.report import figures

    frame = pd.concat([_ddp_rows("ddp_naive", ["none", "naive", "flat", "torch_ddp"], commit="1" * 40),
                       _ddp_rows("ddp_individual", ["individual", "torch_ddp"], commit="2" * 40),
                       _ddp_rows("ddp_bucketed", ["bucketed:1", "bucketed:100", "torch_ddp"], commit="3" * 40)])
    figures.ddp_bucketed(frame, "unused.png")
    (fig, stamp), = drawn.values()
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["none", "naive", "flat", "torch_ddp", "individual", "bucketed:1", "bucketed:100"]
    assert _labels(fig) == {"ddp_naive run (1111111)", "ddp_individual run (2222222)", "ddp_bucketed run (3333333)"}
    assert stamp == "NVIDIA H200 · commit 1111111, 2222222, 3333333"
    # the DDP tables' statistic: the points are the mean steps, the whiskers ± their standard deviation
    means = sorted(y for c in ax.containers for y in c.lines[0].get_ydata() if not np.isnan(y))
    assert means == sorted(frame["step_ms"])
    segments = [np.asarray(seg) for c in ax.containers for seg in c.lines[2][0].get_segments()]
    whiskers = {tuple(np.round(seg[:, 1], 6)) for seg in segments if seg.ndim == 2 and not np.isnan(seg).any()}
    assert whiskers == {(m - 5.0, m + 5.0) for m in frame["step_ms"]}
    assert "mean ± std" in ax.get_ylabel()


def test_compile_figure_has_one_series_per_scope(drawn):
    from cs336_systems.report import figures

    rows = [{"size": size, "mode": "forward", "phase": "step", "status": "ok", "attention": "sdpa",
             "precision": "bf16", "compile_scope": scope, "compile": scope != "none", "mean_ms": 50.0 + i,
             "std_ms": 1.0, "median_ms": 10.0 + i, "device_name": "NVIDIA H100 80GB HBM3", "git_commit": "f" * 40}
            for size in ("small", "medium") for i, scope in enumerate(("none", "blocks", "model"))]
    figures.compile_timing(pd.DataFrame(rows), "unused.png")
    (fig, _), = drawn.values()
    assert _labels(fig) == {"eager", "compiled: each block", "compiled: whole model"}
    # medians, the statistic of the table's speed-ups and of the prose, and the axis says so
    ax = fig.axes[0]
    drawn_y = sorted(y for c in ax.containers for y in c.lines[0].get_ydata() if not np.isnan(y))
    assert drawn_y == sorted(r["median_ms"] for r in rows) and "median" in ax.get_ylabel()


def test_peak_lines_follow_the_device_and_dtype():
    from cs336_systems.report.figures import peak_lines

    assert peak_lines(["NVIDIA H100 80GB HBM3"], "bf16") == [(989.0, "H100 bf16 dense peak")]
    assert peak_lines(["NVIDIA H200"], "fp32") == [(67.0, "H200 FP32 (no tensor cores) peak"),
                                                   (494.5, "H200 TF32 dense peak")]
    assert peak_lines(["cpu (x86_64, 2 cores)"], "bf16") == []


def test_train_matrix_figure_plots_the_difference_to_torch_ddp(drawn):
    from cs336_systems.report import figures

    steps = np.arange(1, 6)
    reference = 10 - 0.1 * steps
    frame = pd.concat([
        pd.DataFrame({"attention": "sdpa", "wrapper": "torch_ddp", "step": steps, "loss": reference}),
        pd.DataFrame({"attention": "sdpa", "wrapper": "naive", "step": steps, "loss": reference}),
        pd.DataFrame({"attention": "sdpa", "wrapper": "none", "step": steps, "loss": reference + 1e-3 * steps})])
    figures.train_matrix(frame.assign(device_name="NVIDIA H200", git_commit="c" * 40), "unused.png")
    (fig, _), = drawn.values()
    ax = fig.axes[0]
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    np.testing.assert_allclose(lines["single GPU"], 1e-3 * steps, rtol=1e-9)
    np.testing.assert_array_equal(lines["naive"], figures.LOSS_DIFF_FLOOR)  # 0 drawn at the floor ...
    assert any("bitwise equal" in t.get_text() and "naive" in t.get_text() for t in ax.texts)  # ... and said
    assert ax.get_ylim()[0] < figures.LOSS_DIFF_FLOOR


def test_memory_phases_from_our_marks_or_pytorch_annotations():
    ours = {"phases": [{"phase": "backward", "start_us": 20, "end_us": 30},
                       {"phase": "forward", "start_us": 5, "end_us": 15}]}
    assert snapshots.phase_spans(ours) == [("forward", 5.0, 15.0), ("backward", 20.0, 30.0)]
    theirs = {"external_annotations": [
        {"stage": "START", "name": "forward", "time_us": 5}, {"stage": "END", "name": "forward", "time_us": 15},
        {"stage": "START", "name": "measured_step", "time_us": 4},
        {"stage": "START", "name": "optimizer", "time_us": 40}]}  # no END: dropped
    assert snapshots.phase_spans(theirs) == [("forward", 5.0, 15.0)]


def test_memory_timeline_marks_phases_on_a_time_axis(drawn):
    t0 = 1_700_000_000_000_000
    events = [dict(e, time_us=t0 + 1000 * i) for i, e in enumerate(SNAPSHOT["device_traces"][0])]
    snapshot = {**SNAPSHOT, "device_traces": [events],
                "phases": [{"phase": "forward", "start_us": t0, "end_us": t0 + 3500},
                           {"phase": "backward", "start_us": t0 + 3600, "end_us": t0 + 7000}]}
    xs, ys, start = snapshots.timed_timeline(snapshot)
    assert start == t0 and xs == [0.0, 1.0, 2.0, 4.0, 5.0, 7.0] and ys == [100, 104, 120, 104, 108, 104]
    memory.draw_timeline(snapshot, "unused.png", "t", rows=pd.DataFrame({"device_name": ["NVIDIA H200"]}))
    (fig, stamp), = drawn.values()
    assert [t.get_text() for t in fig.axes[0].texts] == ["forward", "backward"]
    assert stamp.startswith("NVIDIA H200")
    drawn.clear()
    memory.draw_timeline(SNAPSHOT, "unused.png", "no stamps")  # old snapshots: event index, no phases
    (fig, _), = drawn.values()
    assert len(fig.axes[0].texts) == 0 and "phases cannot be placed" in fig.axes[0].get_xlabel()


def test_memory_levels_at_each_phase_start_peak_and_end():
    """Levels per phase from the host time stamps: an event at a phase's boundary belongs to it, a phase's
    peak counts the level it starts at, and a phase with no event keeps the level before it."""
    t0 = 1_700_000_000_000_000
    events = [dict(e, time_us=t0 + 1000 * i) for i, e in enumerate(SNAPSHOT["device_traces"][0])]
    xs, ys, _ = snapshots.timed_timeline({**SNAPSHOT, "device_traces": [events]})  # levels after each event
    at = dict(zip(xs, ys))  # ms -> MiB: 0 -> 100, 1 -> 104, 2 -> 120, 4 -> 104, 5 -> 108, 7 -> 104
    snapshot = {**SNAPSHOT, "device_traces": [events],
                "phases": [{"phase": "forward", "start_us": t0 + 1000, "end_us": t0 + 3500},
                           {"phase": "backward", "start_us": t0 + 3600, "end_us": t0 + 5000},
                           {"phase": "optimizer", "start_us": t0 + 5500, "end_us": t0 + 6500}]}
    assert snapshots.phase_levels(snapshot) == {
        "forward_start_mib": at[1], "forward_peak_mib": at[2], "forward_end_mib": at[2],
        "backward_start_mib": at[2], "backward_peak_mib": at[2], "backward_end_mib": at[5],
        "optimizer_start_mib": at[5], "optimizer_peak_mib": at[5], "optimizer_end_mib": at[5]}
    # before the first event: what was live at the dump less the window's net change (108 MiB here)
    early = {**snapshot, "phases": [{"phase": "forward", "start_us": t0 - 10, "end_us": t0 - 5}]}
    live = snapshots.allocated_at_dump(SNAPSHOT) / MiB - sum(
        (e["size"] if e["action"] == "alloc" else -e["size"]) / MiB for e in events
        if e["action"] in ("alloc", "free_completed"))
    assert snapshots.phase_levels(early) == {"forward_start_mib": live, "forward_peak_mib": live,
                                          "forward_end_mib": live}
    assert snapshots.phase_levels(SNAPSHOT) == {}  # no time stamps, no phases: nothing to place


def test_trace_figures_share_their_time_axis_and_mark_phases(tmp_path, drawn):
    import json

    from cs336_systems.report import traces

    def trace(length):
        return {"traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "forward", "ts": 0, "dur": length / 4},
            {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": length / 4, "dur": length / 2},
            {"ph": "X", "cat": "user_annotation", "name": "optimizer", "ts": 3 * length / 4, "dur": length / 4},
            {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 10, "dur": length / 2},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": length / 2, "dur": length / 4}]}
    for name, length in (("short", 1000), ("long", 4000)):
        (tmp_path / f"{name}.json").write_text(json.dumps(trace(length)))
    rows = tmp_path / "rows.csv"
    pd.DataFrame({"device_name": ["NVIDIA H200"], "git_commit": ["d" * 40]}).to_csv(rows, index=False)
    traces.main([str(tmp_path / "short.json"), str(tmp_path / "long.json"), "--figures-dir", str(tmp_path),
                 "--out", str(tmp_path / "o.csv"), "--rows", str(rows)])
    assert len(drawn) == 2
    for fig, stamp in drawn.values():
        ax = fig.axes[0]
        assert ax.get_xlim() == (0.0, 4.0)  # the longer trace's 4 ms, for both
        assert [t.get_text() for t in ax.texts] == ["forward", "backward", "optimizer"]
        assert stamp == "NVIDIA H200 · commit ddddddd"
    out = pd.read_csv(tmp_path / "o.csv")  # each trace's row carries the run's provenance, for the table's caption
    assert list(out["device_name"]) == ["NVIDIA H200"] * 2 and list(out["git_commit"]) == ["d" * 40] * 2


def test_recorded_snapshot_carries_the_phase_marks(tmp_path, monkeypatch):
    """bench.e2e writes each recorded phase's wall-clock span into the snapshot (the CUDA allocator calls
    are stood in for, so this runs on the CPU), in order and inside the step."""
    import time

    import torch

    from cs336_systems.bench import e2e

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]})
    path = tmp_path / "train_step.pickle"
    before = time.time_ns() // 1000
    e2e.measure(e2e.RunSpec(size="tiny", mode="train_step", precision="fp32", attention="naive", batch_size=2,
                            context_length=16, warmup=1, steps=1, device="cpu", memory_snapshot=str(path)))
    spans = snapshots.phase_spans(pickle.loads(path.read_bytes()))
    assert [name for name, _, _ in spans] == ["forward", "backward", "optimizer"]
    bounds = [t for _, start, end in spans for t in (start, end)]
    assert bounds == sorted(bounds) and bounds[0] >= before and bounds[-1] <= time.time_ns() // 1000

def test_baseline_and_kernel_time_sections_quote_their_tables(tmp_path):
    """The two sections whose data awaits a GPU run, rendered from CPU rows of the same benches: every number
    of their prose is a cell of (or a formula over) the table they embed, and no typed reference remains."""
    from cs336_systems.bench import e2e
    from cs336_systems.bench.profile import ProfileConfig, profile_rows
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections import benchmarking
    from cs336_systems.results import write_rows

    e2e.sweep(e2e.Sweep(sizes=("tiny",), modes=("train_step",), precisions=("bf16",), attention=("sdpa",),
                        optimizers=("foreach",), models=("ours", "plain"), weights=("float32", "bf16-master"),
                        context_length=16, batch_size=2, warmups=(1,), steps=2, rounds=2, device="cpu"),
              tmp_path / "e2e_baseline.csv")
    write_rows(profile_rows(ProfileConfig(sizes=("tiny", "mini"), context_lengths=(16,), batch_size=2, precision="bf16",
                                          warmup=1, steps=1, device="cpu", tool="torch")),
               tmp_path / "profile_bf16.csv")
    make_tables(tmp_path, ["baseline_timing", "kernel_vs_wall"])  # what the `table` rule writes, the sections read
    ctx = Context(tmp_path, tmp_path, tmp_path)
    baseline = benchmarking.render_baseline(ctx)
    host = benchmarking.render_host_bound(ctx)
    for body in (baseline, host):
        assert unquoted(body) == []
        assert "issue" not in body.markdown() and "anchor" not in body.markdown()
    ratio, models = column_values(baseline.table, "÷ plain"), baseline.table.data["model"]
    assert set(models) == {"ours", "plain"} and (ratio[models == "plain"] == 1).all()
    rows = pd.read_csv(tmp_path / "e2e_baseline.csv").query("phase == 'step'")
    assert rows["round"].tolist() == [0, 0, 0, 1, 1, 1]  # every point once per round, in the same order
    for i, point in baseline.table.data.iterrows():  # each median pools the point's steps of both rounds
        steps = rows[(rows["model"] == point["model"]) & (rows["weights"] == point["weights"])]
        pooled = np.median([float(t) for s in steps["samples_ms"] for t in s.split()])
        assert point["rounds"] == 2 and point["median (ms)"] == pytest.approx(pooled, rel=1e-9)
    assert "the whole grid run 2 times interleaved" in baseline.markdown()
    weights = baseline.table.data.loc[models == "ours", "weights"]
    assert sorted(weights) == ["bf16-master", "float32"]  # each described in the prose
    assert "ours (sdpa attention, our multi-tensor AdamW) with " in baseline.markdown()
    assert all(f"with {benchmarking.WEIGHT_NAMES[w]} " in baseline.markdown() for w in weights)
    share = column_values(host.table, "kernel share of step")
    # kernel time and wall time come from two calls of the phase (profiled, timed), so on a shared CPU the
    # share can exceed 1; only its presence for every size is checked here
    assert list(host.table.data["size"]) == ["tiny", "mini"] and (share > 0).all()


@pytest.mark.parametrize("ratio,word", [(0.893, "faster"), (0.9994, "faster"), (1.0004, "the same time"),
                                        (0.99951, "the same time"), (1.0006, "slower"), (1.053, "slower")])
def test_the_baseline_ratio_is_worded_as_printed(ratio, word):
    """Faster or slower is judged on the ratio as the prose prints it (3 decimals): a printed 1.000 is neither
    (the baseline's and the 8B step's sentences both say it this way)."""
    from cs336_systems.report.section import faster_or_slower

    assert faster_or_slower(ratio) == word


def test_no_typed_reference_numbers_or_issue_numbers_in_the_benchmarking_text(committed):
    """The writeup compares with measurements of the same run, not quoted figures or team-internal references."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert "anchors" not in config  # no place for quoted reference numbers
    for section, body in committed.items():
        if section.startswith(("1.1.", "1.3.1")):
            text = body.markdown() if isinstance(body, Section) else body
            assert not re.search(r"issue #\d|\banchor\b", text), section


def test_warmup_text_follows_the_per_step_times(tmp_path):
    """With every measured step recorded, the warm-up section names the slow steps from them and quotes its table."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections import benchmarking
    from cs336_systems.results import write_rows

    base = {"mode": "forward_backward", "phase": "step", "status": "ok", "precision": "fp32", "attention": "naive",
            "device_name": "GPU", "torch_version": "t", "triton_version": "t", "git_commit": "c" * 12,
            "timestamp": "2026-11-23T00:00:00+00:00"}
    times = {0: [600.0, 55.0, 54.0, 54.0], 1: [54.0, 70.0, 54.0, 54.0], 5: [54.0, 54.5, 54.0, 54.2]}
    rows = [{**base, "size": size, "warmup": w, "samples_ms": " ".join(str(x * scale) for x in t),
             "mean_ms": np.mean(t) * scale, "std_ms": np.std(t, ddof=1) * scale, "median_ms": np.median(t) * scale}
            for size, scale in (("small", 1.0), ("xl", 10.0)) for w, t in times.items()]
    write_rows(rows, tmp_path / "e2e_warmup.csv")
    make_tables(tmp_path, ["e2e_warmup"])
    body = benchmarking.render_warmup(Context(tmp_path, tmp_path, tmp_path))
    assert "pending" not in body.markdown() and unquoted(body) == []
    per_step = body.checked[1]
    # warm-up 0: the first step carries the excess, at both sizes (600 ms against a warmed mean of ~54 ms)
    assert "more than 10% above it at: small, xl)" in per_step
    first_over_warm = 600.0 / np.mean(times[5])
    assert f"{first_over_warm:.2f}–{first_over_warm:.2f}× the mean step of 5 warm-up steps" in per_step
    # warm-up 1: its first measured step is normal, but a later one stands out, which 0 and 5 do not show
    assert "no more than 10% above that mean at: small, xl," in per_step
    assert "at some size, after 1 warm-up steps)" in per_step
    assert body.table.value("warmup=1 slowest later (ms)", size="small") == 70.0


def test_profile_text_compares_gemm_kernels_with_softmax(tmp_path):
    from cs336_systems.bench.profile import ProfileConfig, profile_rows
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections import profiling
    from cs336_systems.results import write_rows

    rows = profile_rows(ProfileConfig(sizes=("tiny",), context_lengths=(16,), batch_size=2, warmup=1, steps=1,
                                      device="cpu", tool="torch"))
    oom = {**rows[0], "size": "mini", "kind": "point", "status": "oom"}
    write_rows([*rows, oom], tmp_path / "profile.csv")
    make_tables(tmp_path, ["profile_grid", "profile_kernels"])
    ctx = Context(tmp_path, tmp_path, tmp_path)
    body = profiling.render_profile(ctx)
    assert unquoted(body) == []  # (a) quotes the grid's cells
    text = body.markdown()
    assert "the GEMM kernels (scores and final matmul) take" in text and "at most" not in text
    assert "Out of memory: mini at 16." in text


def test_profile_non_matmul_answer_is_the_forward_pass(committed):
    """1.1.4(c) asks about the forward pass: every kernel it names, and its share, is of forward kernel time
    (shares of forward+backward time were quoted once), and no forward kernel above the threshold is left out."""
    from cs336_systems.report.profile_tables import MATMUL, profile_kernels_of, profile_point

    text = committed["1.1.4 (a–e) nsys_profile: kernel summaries per range"].markdown()
    answer = next(p for p in text.split("\n\n") if p.startswith("(c) "))
    frame = pd.read_csv(ROOT / "results" / "profile.csv")
    size, context = profile_point(frame)
    kernels = profile_kernels_of(frame[(frame["size"] == size) & (frame["context_length"] == context)])
    forward = kernels[kernels["phase"] == "forward"]
    other = forward[~forward["name"].str.contains(MATMUL, case=False, regex=True)]
    shares = other.groupby("name")["ms_per_step"].sum() / forward["ms_per_step"].sum()
    named = dict(re.findall(r"`([^`]+)` \(([\d.]+)%\)", answer))
    assert named == {n[:60]: f"{100 * v:.1f}" for n, v in shares[shares >= 0.01].items()}
    assert f"take {shares.sum():.0%} of the kernel time" in answer


def test_checkpointed_blocks_sentence_counts_every_saved_tensor(committed):
    """3.1: what the checkpointed four blocks keep is the sum of every tensor the saved-tensor list holds for
    that case (one hidden state per checkpoint call: 160 MiB for the handout's two calls, not one's 80 MiB)."""
    text = committed["2026 §3.1 autograd residuals: saved tensors"].markdown()
    listed = pd.read_csv(ROOT / "results" / "saved_tensors_list.csv")
    rows = listed[(listed["case"] == "four_blocks_checkpointed") & (listed["mode"] == "eager")]
    hidden = rows[rows["tensor_bytes"] == rows["tensor_bytes"].max()]
    assert f"keep {rows['tensor_bytes'].sum() / 2**20:,.2f} MiB" in text
    assert f" {len(hidden)} checkpoint calls" in text and f"({len(hidden)} × " in text


def test_checkpointing_model_state_is_weights_and_moments_of_the_swept_model(committed):
    """3.2(b): the part of the peak no policy touches is what each step starts with: the float32 weights and
    AdamW's two moments of the swept model (12 B per parameter; the gradients are freed between steps), which
    the start-of-step allocation must hold with little to spare."""
    from cs336_systems.model import MODEL_SIZES_2026

    text = committed[CHECKPOINTING].markdown()
    frame = pd.read_csv(ROOT / "results" / "checkpointing.csv")
    config = MODEL_SIZES_2026[frame["size"].iloc[0]]
    d, f = config.d_model, config.d_ff
    params = 2 * config.vocab_size * d + config.num_layers * (4 * d * d + 3 * d * f + 2 * d) + d
    state_gib = 12 * params / 2**30
    start = frame.loc[frame["status"] == "ok", "baseline_mib"] / 1024
    assert f"{params:,} parameters" in text and f"= {state_gib:.2f} GiB" in text
    assert start.min() - 0.5 < state_gib <= start.min()  # state fills the start, with under 0.5 GiB besides
    assert "gradients and AdamW" not in text


def test_checkpointing_answer_a_picks_the_policy_with_the_least_modelled_peak(committed):
    """3.2(a) names the chain as the least memory (compute ignored) and recursive halving as the one run: the
    latter must have the least modelled peak of the policies shown, within one block plus two boundaries per level
    (the model's upper bound, which the prose calls one)."""
    import math

    from cs336_systems.model import CheckpointPolicy, checkpoint_cost

    body = committed[COST_MODEL]
    answer = next(p for p in body.parts if p.startswith("(a) "))
    assert "O(N^2)" in answer and "at most two segment inputs per level" in answer
    assert "is the chain; recursive halving" in body.checked[2] and "an upper bound" in body.checked[2]
    saved = pd.read_csv(ROOT / "results" / "saved_tensors.csv").query("mode == 'eager' and case == 'block'")
    block = saved.loc[saved["kind"] == "activation", "storage_mib"].item()
    boundary = saved.loc[saved["kind"] == "input", "storage_mib"].item()
    for n in (8, 32, 128, 512):
        peaks = {name: checkpoint_cost(policy, n, block, boundary).peak_bytes for name, policy in
                 {"none": CheckpointPolicy(), "every": CheckpointPolicy.every(1),
                  "sqrt": CheckpointPolicy.sqrt(n), "binary": CheckpointPolicy.binary(n)}.items()}
        assert min(peaks, key=peaks.get) == "binary", n
        assert peaks["binary"] <= block + 2 * math.ceil(math.log2(n)) * boundary, n


def _stored_starts(levels: tuple[int, ...], start: int, n: int, block: int) -> set[int]:
    """The distinct segment inputs (as block indices) nested checkpoints keep while `block`'s backward runs,
    counted here independently of the cost model: the backward visits a level's segments last to first, so the
    inputs of the segments up to the one holding `block` are stored; then the same inside that segment."""
    if not levels:
        return set()
    starts = [s for s in range(start, start + n, levels[0]) if s <= block]
    inner = _stored_starts(levels[1:], starts[-1], min(levels[0], start + n - starts[-1]), block)
    return set(starts) | inner


def test_checkpointing_a_states_the_cost_model_table(committed):
    """3.2(a) is checked prose over the cost-model table: the block and boundary sizes it states are 3.1's eager
    block (results/saved_tensors.csv), the counts it derives hold for recursive halving at every N of the table
    (two modelled boundaries per level, log2 N + 1 distinct ones counted from the nesting, N·(log2 N + 3)/2 block
    forwards), and a changed number is caught."""
    import math

    from cs336_systems.model import CheckpointPolicy, checkpoint_cost

    body = committed[COST_MODEL]
    assert isinstance(body, Section) and unquoted(body) == []
    numbers = body.checked[2]
    saved = pd.read_csv(ROOT / "results" / "saved_tensors.csv").query("mode == 'eager' and case == 'block'")
    block = saved.loc[saved["kind"] == "activation", "storage_mib"].item()
    boundary = saved.loc[saved["kind"] == "input", "storage_mib"].item()
    for n in (8, 32, 128, 512):
        policy = CheckpointPolicy.binary(n)
        cost = checkpoint_cost(policy, n, block, boundary)
        assert cost.block_forwards == n * (math.log2(n) + 3) / 2, n
        assert cost.peak_bytes == pytest.approx(block + 2 * math.log2(n) * boundary), n
        assert max(len(_stored_starts(policy.segments, 0, n, b)) for b in range(n)) == math.log2(n) + 1, n
    n = 512
    distinct = math.log2(n) + 1
    said = [f"residuals {block:,.2f} MiB", f"boundary {boundary:,.2f} MiB", f"one block and {2 * math.log2(n):.0f} "
            "boundaries", f"the boundaries are {distinct:.0f}", f"stores {distinct - 2:.0f} fewer",
            f"{(distinct - 2) * boundary:,.0f} MiB"]
    for part in said:
        assert part in numbers, part
        assert perturbed_number(body, numbers, part), part


def test_checkpointing_nesting_sentence_quotes_how_little_it_buys(committed):
    """3.2(b): what nesting buys against every:1 is the table's every:1 peak less its lowest nested peak, and a
    changed one is caught."""
    body = committed[CHECKPOINTING]
    sentence = next(p for p in body.checked if p.startswith("Nesting costs compute"))
    frame = pd.read_csv(ROOT / "results" / "checkpointing.csv").query("status == 'ok'")
    peaks = frame.set_index("policy")["peak_memory_mib"] / 1024
    below = peaks["every:1"] - peaks[frame.loc[frame["policy_kind"] == "nested", "policy"]].min()
    assert round(below, 2) > 0
    said = f"at most {below:.2f} GiB"
    assert said in sentence and "(a) predicts" not in sentence
    wrong = sentence.replace(said, f"at most {below + 0.01:.2f} GiB")
    assert unquoted(replace(body, checked=[wrong if p == sentence else p for p in body.checked]))


def test_fsdp_accounting_a_quotes_its_table(committed):
    """2026 §7 fsdp_accounting (a) is checked prose over the accounting table: the bytes per parameter and ranks
    are its cells or formulas, the savings equal the closed forms recomputed here from the model's weight tensors
    (16·P_sharded·(N−1)/N against DDP, 8·(P_sharded − P_norms)·(N−1)/N against ZeRO-1), and a changed number
    is caught."""
    from cs336_systems.analysis.fsdp_accounting import units
    from cs336_systems.model import get_config

    body = committed[FSDP_ACCOUNTING]
    assert isinstance(body, Section) and unquoted(body) == []
    intro, answer = body.checked[1], body.checked[2]
    u, world = units(get_config("xl")), 2
    sharded, norms = sum(u.sharded), u.replicated
    against_ddp = 16 * sharded * (world - 1) / world / MiB
    against_zero = 8 * (sharded - norms) * (world - 1) / world / MiB
    for paragraph, said in ((intro, f"{world} ranks"), (intro, "(16 B per parameter)"),
                            (answer, f"{world} ranks, {against_ddp:,.0f} MiB against DDP"),
                            (answer, f"and {against_zero:,.0f} MiB against ZeRO-1")):
        assert said in paragraph, said
        assert perturbed_number(body, paragraph, said), said
    gathered = 2 * (2 * max(u.sharded) + max(u.sharded)) / MiB  # two units in flight and one gradient, BF16
    assert f"about {gathered:,.0f} MiB of gathered BF16 buffers" in answer


SAVED = "2026 §3.1 autograd residuals: saved tensors"
CHECKPOINTING = "2026 §3.2 gradient_checkpointing (b)"
COST_MODEL = "2026 §3.2 gradient_checkpointing (a)"
FSDP_ACCOUNTING = "2026 §7 fsdp_accounting (a)"


def perturbed_number(body: Section, paragraph: str, said: str) -> list[str]:
    """What the prose check reports once the first number of `said`, in `paragraph`, is one more."""
    number = re.search(r"\d[\d,]*", said)[0]
    wrong = paragraph.replace(said, said.replace(number, f"{int(number.replace(',', '')) + 1:,}", 1))
    assert wrong != paragraph, said
    return unquoted(replace(body, checked=[wrong if p == paragraph else p for p in body.checked]))


def test_saved_tensors_intro_states_the_benchs_settings(committed):
    """3.1: the intro is checked prose. The batch, contexts (the blocks' and RMSNorm's own), d_model, d_ff and heads
    it states are the bench's columns of the committed rows, and a changed one is caught."""
    body = committed[SAVED]
    intro = body.checked[0]
    assert intro.startswith("Answers the 2026 handout, section 3.1") and unquoted(body) == []
    frame = pd.read_csv(ROOT / "results" / "saved_tensors.csv")
    block, norm = (frame[frame["case"] == case].iloc[0] for case in ("block", "rmsnorm"))
    settings = [f"batch {block['batch_size']}", f"context {block['context_length']}",
                f"RMSNorm alone: {norm['context_length']}", f"d_model {block['d_model']}", f"d_ff {block['d_ff']}",
                f"{block['num_heads']} heads"]
    for said in settings:
        assert said in intro
        assert perturbed_number(body, intro, said), said


def test_saved_tensors_checkpoint_calls_agree_with_the_list(committed):
    """3.1: the checkpoint calls, the hidden state's MiB and the positions' bytes are formulas over the table's
    cells (batch × context × d_model float32 values; context int64 values), and equal what the saved-tensor list
    holds: one hidden state and one positions tensor per call. A changed count or size is caught."""
    body = committed[SAVED]
    sentence = next(p for p in body.checked if p.startswith("The saved-tensor list shows"))
    listed = pd.read_csv(ROOT / "results" / "saved_tensors_list.csv")
    rows = listed[(listed["case"] == "four_blocks_checkpointed") & (listed["mode"] == "eager")]
    hidden = rows[rows["tensor_bytes"] == rows["tensor_bytes"].max()]
    positions = rows[rows["dtype"] == "int64"]
    said = [f"{len(hidden)} checkpoint calls", f"{len(hidden)} × {hidden['tensor_bytes'].iloc[0] / 2**20:,.2f} MiB",
            f"{len(positions)} × {positions['tensor_bytes'].iloc[0]:,} B"]
    for part in said:
        assert part in sentence, part
        assert perturbed_number(body, sentence, part), part
    assert len(rows) == len(hidden) + len(positions) + (rows["tensor_bytes"] == 0).sum()  # nothing else weighs


def test_checkpointing_states_the_sweeps_setting_and_parameters(committed):
    """3.2: the intro and (b) are checked prose; (b)'s blocks, batch and context are the sweep's columns, and the
    parameter count is the 'weights + moments' cell over 3 × 4 B; a changed one is caught."""
    body = committed[CHECKPOINTING]
    assert body.checked[0].startswith("Answers the 2026 handout, section 3.2") and unquoted(body) == []
    answer = next(p for p in body.checked if p.startswith("(b) "))
    first = pd.read_csv(ROOT / "results" / "checkpointing.csv").iloc[0]
    from cs336_systems.model import get_config, parameter_count

    params = parameter_count(get_config(first["size"], str(first["size_table"])))
    for said in (f"({first['num_layers']} blocks)", f"batch {first['batch_size']}",
                 f"context {first['context_length']}", f"model's {params:,} parameters"):
        assert said in answer, said
        assert perturbed_number(body, answer, said), said


def test_flash_shapes_compiled_ratio_ranges_cover_every_row_of_their_pass(committed):
    """'up to 2.48×' was once quoted for all points while only forward+backward rows gave it (forward: 29.4×):
    each pass's quoted compiled-over-eager range must be that pass's min and max over all its rows, and the
    'fixed cost' column must flag exactly the times some 4×-larger point of the same pass did not exceed."""
    body = committed["1.3.3, continued: FlashAttention at Transformer training shapes"]
    table = body.table.data  # the numbers: the flags are computed on unrounded times
    paragraph = next(p for p in body.checked if p.startswith("Under torch.compile"))
    work = (table["batch"] * table["heads"] * table["seq"] ** 2 * table["d"]
            * np.where(table["causal"].astype(bool), 0.5, 1.0)).to_numpy()
    for pass_, name in (("forward", "forward"), ("forward_backward", "forward+backward")):
        ratios = column_values(table, "compiled ÷ eager", lambda t: t["pass"] == pass_).dropna()
        assert f"{ratios.min():.2f}–{ratios.max():.2f}× {name}" in paragraph
    for flag, column in (("eager", "ours (ms)"), ("compiled", "ours compiled (ms)")):
        times, passes = table[column].to_numpy(dtype=float), table["pass"].to_numpy()
        expected = [bool(((passes == passes[i]) & (work >= 4 * work[i]) & (times <= times[i])).any())
                    for i in range(len(table))]
        assert [flag in str(cell).split(", ") for cell in table["fixed cost"]] == expected, flag


def test_flash_shapes_intro_names_each_head_dims_commit(committed):
    """The grid runs as one device call per head dim: where the rows' commits differ, the intro names each head dim's
    as the rows give it (it once gave a reason that belonged to an earlier grid's second commit)."""
    from cs336_systems.results import read_table

    intro = committed["1.3.3, continued: FlashAttention at Transformer training shapes"].parts[0]
    rows = read_table(ROOT / "results" / "flash_llm_shapes.csv")
    assert intro.startswith("Answers no handout question")
    for head_dim, commits in rows.groupby("head_dim")["git_commit"].unique().items():
        assert (f"head dim {head_dim} at {commits[0]}" in intro) == (rows["git_commit"].nunique() > 1), intro


def test_flash_tflops_figure_draws_full_matrix_providers_at_their_executed_count(drawn):
    """Naive attention computes the full masked matrix: its line must not use FlashAttention-2's causal-halved
    count. Each provider's line is checked against FLOPs counted here, per product, over the median time."""
    from cs336_systems.report import figures

    frame = pd.DataFrame([{"provider": p, "pass": "forward_backward", "status": "ok", "dtype": "bf16",
                           "head_dim": 64, "seq_len": 1024, "batch": 16, "causal": True, "median_ms": 2.0,
                           "device_name": "NVIDIA H100 80GB HBM3", "git_commit": "a" * 40}
                          for p in ("naive", "sdpa_flash")])
    product = 2 * 16 * 1024 * 1024 * 64  # one (seq × seq × d) matrix product, 16 batch·heads
    frame["tflops"] = 7 * product / 2 / 2e-3 / 1e12  # FA2's count: 2 + 5 products, halved when causal
    figures.flash_tflops(frame, "unused.png")
    (fig, _), = drawn.values()
    lines = {line.get_label(): line.get_ydata()[0] for line in fig.axes[0].get_lines()}
    assert lines["naive (executed count)"] == pytest.approx(6 * product / 2e-3 / 1e12)  # 2 + 4 products, in full
    assert lines["sdpa_flash"] == pytest.approx(7 * product / 2 / 2e-3 / 1e12)


LEADERBOARD = "2026 §9 leaderboard: the 8B training step on one H200"


def _paragraph(body: Section, start: str) -> str:
    return next(p for p in body.checked if p.startswith(start))


def _render_leaderboard(tmp_path, frame: pd.DataFrame) -> Section:
    """The 8B section rendered from `frame` as the `table` rule and the writeup do (no check CSV, no profile)."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.leaderboard import render_leaderboard

    frame.to_csv(tmp_path / "leaderboard_8b.csv", index=False)
    make_tables(tmp_path, ["leaderboard_8b", "leaderboard_8b_ablations", "leaderboard_8b_runs", "leaderboard_8b_verdict"])
    return render_leaderboard(Context(tmp_path, tmp_path, tmp_path))


def _quoted_ours(frame: pd.DataFrame, batch: int = 2) -> pd.Series:
    return frame[(frame["provider"] == "ours") & (frame["batch"] == batch) & frame["quoted"]].iloc[-1]


def test_leaderboard_8b_prose_is_its_cells_and_ratios_are_the_rows(committed):
    """The 8B step section: every prose number is a cell or a recomputed formula over cells (a changed ratio is
    caught); each ratio cell is the row's mean step over the SAC anchor's of the same run and batch, recomputed
    here from the CSV; OOM rows print OOM; the quoted run's verdict follows its cells."""
    from cs336_systems.report.sections.leaderboard_steps import ablation_table

    body = committed[LEADERBOARD]
    assert isinstance(body, Section) and unquoted(body) == []
    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    timed = frame[frame["status"].isin(["ok", "oom"])]
    assert len(body.table) == len(timed)
    for (_, row), (_, cells) in zip(timed.iterrows(), body.table.display().iterrows()):
        anchor = timed[(timed["run_id"] == row["run_id"]) & (timed["provider"] == "torch_plain_sac")]["step_ms"].iloc[0]
        if row["status"] == "oom":
            assert cells["step (ms, mean ± std)"] == "OOM" and cells["÷ SAC anchor"] == "—"
        else:
            assert abs(float(cells["÷ SAC anchor"]) - row["step_ms"] / anchor) < 2e-3, row["provider"]
    ours = _quoted_ours(frame)
    sac = frame[(frame["run_id"] == ours["run_id"]) & (frame["provider"] == "torch_plain_sac")].iloc[0]
    ratio, mfu = ours["step_ms"] / sac["step_ms"], ours["mfu"]
    gap = _paragraph(body, "Against the strongest")
    assert f"{ratio:.3f}×" in gap and f"at {100 * mfu:.2f}% MFU" in gap  # 53.98% is not "54.0%"
    assert ("missed at batch 2" in gap) == (ratio > 0.9 or mfu < 0.54)
    assert ("missed at batch 2 (by its MFU)" in gap) == (ratio <= 0.9 and mfu < 0.54)
    ablations = ablation_table(frame)
    sdpa = int(ablations.data.index[ablations.data["ablation"] == "ours-sdpa_attention"][-1])
    batch, run = int(ablations.data.at[sdpa, "batch"]), ablations.data.at[sdpa, "run"]
    ours_b = timed[(timed["provider"] == "ours") & (timed["batch"] == batch)
                   & timed["run_id"].str.startswith(run)]["step_ms"].iloc[0]
    assert abs(ablations.value("÷ ours", sdpa) - ablations.value("step (ms, mean ± std)", sdpa) / ours_b) < 2e-3
    wrong = gap.replace(f"{ratio:.3f}", f"{ratio - 0.07:.3f}")
    assert unquoted(replace(body, checked=[wrong if p == gap else p for p in body.checked]))


def test_leaderboard_8b_answers_first_and_lists_its_runs_last(committed):
    """The section opens with the deliverable (ours' step at the leaderboard's batch in the quoted run, from the
    CSV) in a few sentences with no commit hash; the run list is the runs table at the end, one row per run with its
    commit; the prose names each checkpoint choice once, with the runs that share it."""
    body = committed[LEADERBOARD]
    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    answer, gap = body.parts[0], _paragraph(body, "Against the strongest")
    assert answer.startswith("Answers the 2026 handout, section 9") and answer in body.checked
    assert f"Ours takes {_quoted_ours(frame)['step_ms']:,.1f} ms per step at batch 2" in answer
    assert len(re.findall(r"[.!?](?:\s|$)", answer)) <= 4  # the handout asks for one number
    commits = set(frame["git_commit"].str[:7])
    assert not [c for c in commits if c in answer or c in gap]
    runs = (ROOT / "results" / "tables" / "leaderboard_8b_runs.md").read_text()
    # the run list ends the section, marked for the appendix (report/appendix.py)
    assert body.parts[-1] == appendix("the 8B step: the runs, their commits and settings", runs)
    assert not [p for p in body.parts[:-1] if runs.strip() in p]
    for run, commit in frame.groupby("run_id", sort=False)["git_commit"].first().items():
        assert f"| {run[:6]} | {commit[:7]}" in runs, run
    setup = _paragraph(body, "Setup and runs.")
    chosen = frame[(frame["provider"] == "ours") & (frame["status"] == "ok")].dropna(subset=["matmul_blocks"])
    assert len(chosen)  # the committed runs chose their blocks themselves
    for (checkpoint, batch), group in chosen.groupby(["checkpoint", "batch"]):
        runs_said = ", ".join(group["run_id"].str[:6])
        said = f"{checkpoint} at batch {batch} (run{'s' if len(group) > 1 else ''} {runs_said})"
        once = sum(setup.count(f"{sep} {checkpoint} at batch {batch} (") for sep in ":;")  # each choice said once
        assert once == 1 and said in setup, said
        blocks = int(group["matmul_blocks"].iloc[0])
        wrong = setup.replace(said, said.replace(f"0,{blocks}", f"0,{blocks + 3}"))
        assert unquoted(replace(body, checked=[wrong if p == setup else p for p in body.checked]))


def test_leaderboard_8b_section_renders_at_smoke_scale(tmp_path):
    """At smoke scale (CPU: no MFU, no peak memory, one run with one ablation) the section still renders, says
    so instead of printing nan, and its prose is still its cells."""
    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    smoke = frame[frame["provider"].isin(["ours", "torch_plain_sac", "torch_plain_ac", "ours-full_ac"])
                  & (frame["batch"] == 1)].assign(mfu=np.nan, tflops=np.nan, peak_mem_gib=np.nan,
                                                   device_name="cpu (x86_64, 2 cores)")
    body = _render_leaderboard(tmp_path, smoke)
    assert unquoted(body) == [] and "nan" not in body.markdown()
    assert "this device measures no MFU" in body.markdown()
    # the ablations are counted, not restated row by row: the table beside the sentence gives each one
    assert "1 of the 1 rows compared with ours are slower than ours" in body.markdown()
    assert "SDPA attention in place" not in body.markdown()  # no such ablation in this run


LM_HEAD = "2026 §9 leaderboard parts: the fused LM head + cross-entropy"


def test_linear_ce_intro_states_the_benchs_settings(committed):
    """2026 §9 LM head: the intro is checked prose. The head's shape and the fused op's chunk it states are the
    bench's columns of the committed rows (one run: every row shares them), the handout's sample (batch 2 at
    context 32,768, its §9 config) is named by the table's rows of that many tokens, and a changed setting is
    caught."""
    body = committed[LM_HEAD]
    intro = body.checked[0]
    assert intro.startswith("Part of the 2026 handout's section 9") and unquoted(body) == []
    frame = pd.read_csv(ROOT / "results" / "linear_ce.csv")
    assert all(frame[c].nunique() == 1 for c in ("d_model", "vocab", "dtype"))
    fused = frame[frame["provider"] == "fused"]
    settings = [f"d_model {frame['d_model'].iloc[0]}", f"vocab {frame['vocab'].iloc[0]}",
                f"chunks of {fused.loc[fused['tokens'].idxmax(), 'chunk_tokens']} tokens"]
    assert f"{settings[1]}, {frame['dtype'].iloc[0]}, on {frame['device_name'].iloc[0]}" in intro
    assert (f"the table's {2 * 32768}-token rows" in intro) == bool((frame["tokens"] == 2 * 32768).any())
    for said in settings:
        assert said in intro
        number = re.search(r"\d+", said)[0]
        wrong = intro.replace(said, said.replace(number, str(int(number) + 1)))
        assert unquoted(replace(body, checked=[wrong, *body.checked[1:]]))


def _linear_ce_rows(rng: np.random.Generator, tokens: list[int], chunk: int, d_models: list[int]) -> pd.DataFrame:
    """Rows as bench/linear_ce writes them, at a CPU's settings: random timings, peaks and losses, the fused op's
    chunk min(chunk, tokens), the plain loss's the whole call; d_models[i % len] per token count; the plain eager
    loss out of memory at the largest count."""
    provenance = pd.read_csv(ROOT / "results" / "linear_ce.csv").iloc[0]
    rows = []
    for i, n in enumerate(tokens):
        for provider in ("fused", "plain_compiled", "plain_eager"):
            oom = provider == "plain_eager" and n == max(tokens)
            rows.append({**provenance.to_dict(), "provider": provider, "tokens": n,
                         "d_model": d_models[i % len(d_models)],
                         "vocab": 37, "dtype": "fp32", "chunk_tokens": min(chunk, n) if provider == "fused" else n,
                         "status": "oom" if oom else "ok", "device_name": "cpu (x86_64, 2 cores)",
                         **{c: np.nan if oom else rng.uniform(0.1, 100)
                            for c in ("median_ms", "peak_mib", "loss", "tflops")}})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("mixed", [False, True])
def test_linear_ce_section_renders_other_settings(tmp_path, mixed):
    """At a CPU's settings (no 8B shape, the handout's sample not measured, a call smaller than the chunk, an OOM
    point, a device name with a number in it) the prose is still the table's cells; where the rows differ in
    d_model the intro states none and points at the columns, and where no peak was measured it says so."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.linear_ce import render_linear_ce

    rng = np.random.default_rng(5 + mixed)
    d_models = [16, 24] if mixed else [int(rng.integers(8, 64))]
    rows = _linear_ce_rows(rng, [6, 24], 16, d_models)
    if mixed:  # and no peaks, as on a CPU
        rows["peak_mib"] = np.nan
    rows.to_csv(tmp_path / "linear_ce.csv", index=False)
    make_tables(tmp_path, ["linear_ce"])  # as the `table` rule does
    body = render_linear_ce(Context(tmp_path, tmp_path, tmp_path))
    intro = body.checked[0]
    assert unquoted(body) == [] and "nan" not in body.markdown()
    assert "chunks of 16 tokens" in intro and "-token rows" not in intro and "8B size's" not in intro
    assert "- 24 tokens: out of memory for plain_eager." in body.checked[1]
    assert ("no peak memory" in body.checked[1]) == mixed and ("MiB against" in body.checked[1]) != mixed
    shape = f"d_model {d_models[0]} and vocab 37, fp32"
    assert (shape in intro) != mixed and ("each row's d_model, vocab and dtype" in intro) == mixed


def _profile_results(tmp_path: Path, dropped: bool) -> Path:
    from tests.test_report_frames import _step_profile_rows

    _step_profile_rows(np.random.default_rng(3 + dropped), dropped).to_csv(tmp_path / "leaderboard_8b_profile.csv",
                                                                            index=False)
    make_tables(tmp_path, ["leaderboard_8b_profile", "leaderboard_8b_memory"])  # as the `table` rule does
    return tmp_path


@pytest.mark.parametrize("dropped", [True, False])
def test_leaderboard_profile_section_quotes_its_time_table(tmp_path, dropped):
    """2026 §9, continued: the failed providers are named; where the profile dropped our AdamW's kernels the
    prose states how much the categories miss of the total (min–max over providers, recomputed here from the
    rows) and that `optimizer` reads 0, as formulas over the time table's cells (a table that no longer gives
    them is caught); a complete profile says neither. Both tables are embedded as built."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.leaderboard_profile import PROFILE_CATEGORIES, render_profile

    results = _profile_results(tmp_path, dropped)
    body = render_profile(Context(results, results, results))
    assert isinstance(body, Section) and unquoted(body) == []
    assert body.table.to_markdown() in body.markdown()
    assert (results / "tables" / "leaderboard_8b_memory.md").read_text() in body.markdown()
    assert "The profiled steps of `torch_plain_sac` failed" in body.markdown()
    rows = pd.read_csv(results / "leaderboard_8b_profile.csv")
    times = rows[rows["kind"] == "time"].pivot(index="category", columns="provider", values="value")
    short = times.loc["profiled ops (total)"] - times.loc[list(PROFILE_CATEGORIES)].sum()
    said = f"add up to {short.min():,.1f}–{short.max():,.1f} ms less than"
    assert (said in body.markdown()) == dropped and ("`optimizer` reads 0)" in body.markdown()) == dropped
    if dropped:
        data = body.table.data.copy()
        total = data.index[data["category"] == "profiled ops (total)"][0]
        data.loc[total, ["ours", "ours-mm:6"]] += 1.0  # a rebuilt table whose totals moved
        moved = replace(body, table=NumericTable(data, body.table.columns, body.table.status))
        assert any("miss of the total" in problem for problem in unquoted(moved))


@pytest.mark.parametrize("swapped", [True, False])
def test_leaderboard_profile_compares_our_attention_with_sdpas_in_the_step(tmp_path, swapped):
    """Where the profiled run has ours beside `ours-sdpa_attention`, the section states ours' attention device time
    over SDPA's (forward, backward, both), recomputed here from the rows, as formulas over the time table's cells (a
    moved cell is caught); without that ablation it says nothing of it."""
    from tests.test_report_frames import _step_profile_rows
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.leaderboard_profile import render_profile

    rows = _step_profile_rows(np.random.default_rng(11), dropped=False)
    if swapped:
        rows["provider"] = rows["provider"].replace("ours-mm:6", "ours-sdpa_attention")
    rows.to_csv(tmp_path / "leaderboard_8b_profile.csv", index=False)
    make_tables(tmp_path, ["leaderboard_8b_profile", "leaderboard_8b_memory"])
    body = render_profile(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == []
    said = [p for p in body.checked if p.startswith("Ours' attention against SDPA's")]
    assert len(said) == int(swapped)
    if not swapped:
        return
    times = rows[rows["kind"] == "time"].pivot(index="category", columns="provider", values="value")
    ours, sdpa = times["ours"], times["ours-sdpa_attention"]
    both = ["attention forward", "attention backward"]
    assert (f"takes {ours[both].sum() / sdpa[both].sum():.3f}× SDPA's device time (forward "
            f"{ours['attention forward'] / sdpa['attention forward']:.3f}×, backward "
            f"{ours['attention backward'] / sdpa['attention backward']:.3f}×)") in said[0]
    data = body.table.data.copy()
    data.loc[data["category"] == "attention backward", "ours"] *= 0.5  # a rebuilt table whose cell moved
    moved = replace(body, table=NumericTable(data, body.table.columns, body.table.status))
    assert any("SDPA's in the step" in problem for problem in unquoted(moved))


@pytest.mark.parametrize("bf16_change", [+500.0, -500.0])
def test_memory_section_quotes_the_recorded_phase_columns(tmp_path, bf16_change):
    """With the columns bench/memory.py now records (phase levels, what the forward saves), the 1.1.6 table
    carries them and (c) quotes them instead of a pending line, its verdict following the data; every number
    stays a cell or a recorded formula."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections import memory as section

    rows = pd.read_csv(ROOT / "results" / "memory.csv")
    train = rows["mode"] == "train_step"
    rng = np.random.default_rng(0)
    rows = rows.assign(**{name: np.where(train, rng.uniform(1e3, 4e4, len(rows)), np.nan) for name in section.RECORDED})
    # the forward+backward peak: bf16's is fp32's plus bf16_change at each context (the backward's lower)
    fp32 = rows[train & (rows["precision"] == "fp32")].set_index("context_length")["forward_peak_mib"]
    bf16 = train & (rows["precision"] == "bf16")
    rows.loc[bf16, "forward_peak_mib"] = rows.loc[bf16, "context_length"].map(fp32) + bf16_change
    rows.loc[train, "backward_peak_mib"] = 0.0
    (tmp_path / "tables").mkdir()
    rows.to_csv(tmp_path / "memory.csv", index=False)
    section.memory_peaks(rows).save(tmp_path / "tables" / "memory_peaks.json")
    body = section.render_memory(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == []
    point = rows[bf16 & (rows["context_length"] == rows["context_length"].max())].iloc[0]
    precision = next(p for p in body.checked if p.startswith("(c)"))
    assert f"{point['forward_peak_mib']:,.0f} MiB in bf16 ({bf16_change:+,.0f} MiB)" in precision
    assert f"{point['saved_weight_copies_mib']:,.0f} MiB of bf16 weight copies" in precision
    assert "pending" not in precision
    assert ("does not lower this peak" in precision) == (bf16_change >= 0)


def _fsdp_overlap_rows(rng: np.random.Generator) -> pd.DataFrame:
    """Rows in the columns report/traces.py writes (taken from its trace_row on a tiny trace), random values: two
    FSDP wrappers, and a baseline with no communication (zeros and NaN, as trace_row writes for it)."""
    from cs336_systems.report import traces

    events = [{"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 110, "dur": 50},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_f32", "ts": 150, "dur": 100}]
    columns = list(traces.trace_row("x", events, traces.lanes(events)))
    rows = [{c: rng.uniform(0.1, 100) for c in columns} | {"trace": trace, "gpu_busy_in_backward": rng.uniform(0.05, 1)}
            for trace in ("torch_fsdp2", "fsdp")]
    rows.append({c: 0.0 for c in columns} | {"trace": "none_baseline", "host_ms_per_collective": np.nan})
    return pd.DataFrame(rows, columns=columns)


def test_fsdp_overlap_section_quotes_its_table(tmp_path):
    """2026 §7 fsdp_accounting (b): pending, it states no number; measured (a synthetic CSV in the columns the
    traces' report writes), each wrapper's line is its cells as the table prints them, the baseline without
    communication says so, and a changed number is caught."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.distributed import render_fsdp_overlap
    from cs336_systems.report.writeup import render

    item = next(item for item in DELIVERABLES if item.section.startswith("2026 §7 fsdp_accounting (b)"))
    ctx = Context(tmp_path, tmp_path, tmp_path)
    assert render(item, ctx) == f"pending: rule `fsdp_overlap` has not produced {tmp_path / 'fsdp_overlap.csv'} yet\n"

    rows = _fsdp_overlap_rows(np.random.default_rng(7))
    rows.to_csv(tmp_path / "fsdp_overlap.csv", index=False)
    make_tables(tmp_path, ["fsdp_overlap"])  # as the `table` rule does
    body = render_fsdp_overlap(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == [] and "nan" not in body.markdown()
    lines = body.checked[1]
    assert "- none_baseline: no communication kernels." in lines
    for _, row in rows[rows["communication_ms"] > 0].iterrows():
        said = (f"- {row['trace']}: {row['communication_ms']:.1f} ms of communication, "
                f"{row['exposed_in_forward_ms']:.1f} ms exposed in the forward, {row['exposed_in_backward_ms']:.1f} ms "
                f"in the backward ({row['exposed_communication_ms']:.1f} ms in the whole step); GPU kernels run in "
                f"{row['gpu_busy_in_backward']:.0%} of its {row['backward_ms']:.1f} ms backward.")
        assert said in lines
        for number in re.findall(r"\d+\.\d", said):
            wrong = lines.replace(said, said.replace(number, f"{float(number) + 1000:.1f}"))  # no cell's number
            assert unquoted(replace(body, checked=[body.checked[0], wrong, *body.checked[2:]])), number


@pytest.mark.parametrize("busy", [(0.26, 0.34), (0.9, 0.95), (0.3, 0.8)])
def test_fsdp_overlap_verdict_follows_the_gpu_busy_share(tmp_path, busy):
    """fsdp_accounting (b) calls exposed communication 'the time a layer waited for its weights' only where the GPU
    is busy in the backward; where it runs kernels in under half of it (the committed traces: 26% and 34%), the step
    is host-bound and the section says the measurement cannot tell that wait. The shares are the table's cells."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.distributed import render_fsdp_overlap

    rows = _fsdp_overlap_rows(np.random.default_rng(3))
    rows.loc[rows["trace"] != "none_baseline", "gpu_busy_in_backward"] = busy
    rows.to_csv(tmp_path / "fsdp_overlap.csv", index=False)
    make_tables(tmp_path, ["fsdp_overlap"])
    body = render_fsdp_overlap(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == []
    verdict = body.checked[2]
    host_bound = [f"{share:.0%} ({trace})" for trace, share in zip(rows["trace"], rows["gpu_busy_in_backward"])
                  if trace != "none_baseline" and share < 0.5]
    assert ("step is host-bound" in verdict) == bool(host_bound)
    assert ("cannot tell how long a layer waited for its weights" in verdict) == bool(host_bound)
    assert ("exposed communication is time the compute waited" in verdict) == (max(busy) >= 0.5)
    assert all(share in verdict for share in host_bound)
    assert "the time a layer waited for its weights" not in body.checked[0]  # the intro claims no interpretation
    committed = pd.read_csv(ROOT / "results" / "fsdp_overlap.csv")
    if (committed["gpu_busy_in_backward"] < 0.5).all():
        assert "cannot tell how long a layer waited" in (ROOT / "results" / "writeup.md").read_text()


def test_fsdp_section_quotes_its_table(tmp_path):
    """2026 §7 fsdp, from a synthetic CSV: the committed DDP bench's columns (results/sharding.csv, the same
    bench) with random times and peaks for our FSDP, torch FSDP2 and bucketed DDP at two sizes and precisions.
    The intro's ranks, batch and context are the table's cells, each size's line its cells and ratio, and a
    changed number is caught."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.distributed import render_fsdp

    rng = np.random.default_rng(11)
    template = pd.read_csv(ROOT / "results" / "sharding.csv").iloc[0]
    setting = {"world_size": int(rng.integers(2, 9)), "batch_per_rank": int(rng.integers(1, 9)),
               "context_length": int(rng.choice([128, 256, 512]))}
    measured = [c for c in template.index if c.endswith("_ms") or c.endswith("_mib")]
    rows = pd.DataFrame([{**template.to_dict(), **setting, "size": size, "precision": precision, "config": config,
                          **{c: rng.uniform(1, 5000) for c in measured}}
                         for size in ("small", "2.7B") for precision in ("fp32", "bf16")
                         for config in ("fsdp", "torch_fsdp2", "bucketed:100")])
    rows.to_csv(tmp_path / "fsdp.csv", index=False)
    make_tables(tmp_path, ["fsdp"])  # as the `table` rule does
    body = render_fsdp(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == [] and "nan" not in body.markdown()
    intro = body.checked[0]
    for said in (f"{setting['world_size']} ranks", f"batch {setting['batch_per_rank']} per rank",
                 f"context {setting['context_length']}"):
        assert said in intro
        assert perturbed_number(body, intro, said), said
    assert len(body.checked) == 1 + 4  # one line per size and precision
    for line in body.checked[1:]:
        size, precision = line.split(":")[0].split(", ")
        ours = rows[(rows["size"] == size) & (rows["precision"] == precision) & (rows["config"] == "fsdp")].iloc[0]
        said = f"ours {ours['step_ms']:.1f} ms per step"
        assert said in line
        assert perturbed_number(body, line, said), said


def _recipe(frame: pd.DataFrame, batch: int = 2) -> pd.DataFrame:
    """Ours' rows at `batch` with the quoted run's checkpoint and sequences per pass, each with its anchor's step."""
    rows = frame[(frame["status"] == "ok") & (frame["batch"] == batch)]
    ours, last = rows[rows["provider"] == "ours"], _quoted_ours(frame, batch)
    same = ours[(ours["checkpoint"] == last["checkpoint"]) & (ours["microbatch"] == last["microbatch"])]
    sac = rows[rows["provider"] == "torch_plain_sac"].set_index("run_id")["step_ms"]
    return same.assign(ratio=[step / sac[run] for step, run in zip(same["step_ms"], same["run_id"])])


SPREAD = re.compile(r"At batch 2, the (\d+) runs of the latest run's recipe .*? were made (at (\d+) (different )?commits|"
                    r"all at one commit), so their spread (mixes code changes with run-to-run noise|is run-to-run noise): "
                    r"ours took ([\d.]+)–([\d.]+)× the anchor's step at ([\d.]+)–([\d.]+)% MFU, and the target held "
                    r"(in every one|in none|in (\d+) of them)\.( These runs support no verdict)?")


def _spread_said(frame: pd.DataFrame) -> dict:
    """What the batch-2 spread sentence must say, recomputed from the raw rows."""
    same = _recipe(frame)
    met = int(((same["ratio"] <= 0.9) & (same["mfu"] >= 0.54)).sum())
    commits = same["git_commit"].str[:7].nunique()
    return {"runs": len(same), "commits": commits, "ratios": (round(same["ratio"].min(), 3), round(same["ratio"].max(), 3)),
            "mfu": (round(100 * same["mfu"].min(), 2), round(100 * same["mfu"].max(), 2)),
            "held": "in every one" if met == len(same) else "in none" if met == 0 else f"in {met} of them",
            "unsettled": 0 < met < len(same)}


def _spread_found(text: str) -> dict:
    found = SPREAD.search(text)
    assert found, "the batch-2 spread sentence is missing"
    commits = int(found[3]) if found[3] else 1
    assert (found[5] == "is run-to-run noise") == (commits == 1)
    return {"runs": int(found[1]), "commits": commits, "ratios": (float(found[6]), float(found[7])),
            "mfu": (float(found[8]), float(found[9])), "held": found[10], "unsettled": bool(found[12])}


def test_leaderboard_states_the_spread_of_its_recipes_runs(committed):
    """The 8B verdict names how ours over the anchor and ours' MFU varied across the runs of the quoted run's recipe
    (same checkpoint policy, same sequences per pass), at how many commits they were made, and in how many the target
    held, all recomputed here from the raw CSV; where it held in some but not all, the prose claims no verdict."""
    from cs336_systems.results import read_table

    frame = read_table(ROOT / "results/leaderboard_8b.csv")
    said = _spread_said(frame)
    assert said["runs"] >= 2 and _spread_found(committed[LEADERBOARD].markdown()) == said


def test_leaderboard_spread_follows_the_commits_and_mfu_cells(tmp_path):
    """Changing cells changes the sentence: the recipe's runs put at one commit, then at two, and one run's MFU
    raised past the others' (the range and the count of runs meeting the target follow)."""
    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    same = _recipe(frame).index
    one = frame.assign(git_commit=frame["git_commit"].where(~frame.index.isin(same), "a" * 40))
    body = _render_leaderboard(tmp_path, one)
    assert unquoted(body) == [] and "all at one commit, so their spread is run-to-run noise" in body.markdown()
    two = one.copy()
    two.loc[same[:2], "git_commit"] = "b" * 40
    assert _spread_found(_render_leaderboard(tmp_path, two).markdown())["commits"] == 2
    worst = _recipe(frame)["mfu"].idxmin()
    raised = frame.copy()
    raised.loc[worst, "mfu"] = 0.6
    said = _spread_said(raised)
    assert _spread_found(_render_leaderboard(tmp_path, raised).markdown()) == said and said["mfu"][1] == 60.0


def test_leaderboard_states_each_points_statistic_from_its_columns(committed, tmp_path):
    """Each point is the mean of the rows' timed steps after their warm-up steps (columns n_steps, warmup): the
    committed rows' counts, and other counts once the cells change (a range where rows differ)."""
    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    ok = frame[frame["status"] == "ok"]
    assert ok["n_steps"].nunique() == ok["warmup"].nunique() == 1
    said = f"the mean of {ok['n_steps'].iloc[0]:.0f} timed steps after {ok['warmup'].iloc[0]:.0f} untimed warm-up"
    assert said in committed[LEADERBOARD].parts[0]
    changed = frame.assign(n_steps=frame["n_steps"] + 4)
    changed.loc[changed.index[-1], "warmup"] = 5
    body = _render_leaderboard(tmp_path, changed)
    assert unquoted(body) == []
    assert f"the mean of {ok['n_steps'].iloc[0] + 4:.0f} timed steps after {ok['warmup'].iloc[0]:.0f}–5 untimed" \
        in body.parts[0]


def test_leaderboard_mfu_counts_causal_attention_as_half_and_the_best_entry_by_one_b200_peak(committed, monkeypatch,
                                                                                           tmp_path):
    """The MFU paragraph says causal attention counts half, that the leaderboard ranks wall time, and the best
    entry's MFU by our count: the quoted batch-2 row's FLOPs (the CSV's `flops`) over 3,837 ms on two B200s at the
    peak the §8 analysis uses (parallelism_render.B200). A changed peak or TFLOP/s cell changes the sentence."""
    from cs336_systems.report import parallelism_render

    body = committed[LEADERBOARD]
    text = _paragraph(body, "MFU counts")
    assert "half of full attention's" in text and "causal masking" in text and "ranks wall time" in text
    ours = _quoted_ours(pd.read_csv(ROOT / "results" / "leaderboard_8b.csv"))

    def entry(peak: float) -> str:
        return f"at {peak / 1e12:,.0f} TFLOP/s each", f"makes that {100 * ours['flops'] / 3.837 / (2 * peak):.1f}% MFU"

    assert all(said in text for said in entry(parallelism_render.B200.flops))
    assert "27%" not in text and "2.25" not in text
    data = body.table.data.assign(**{"TFLOP/s": body.table.data["TFLOP/s"] * 1.1})
    assert any("best entry's MFU" in p for p in unquoted(replace(body, table=NumericTable(data, body.table.columns,
                                                                                           body.table.status))))
    monkeypatch.setattr(parallelism_render, "B200", replace(parallelism_render.B200, flops=2.25e15))
    text = _paragraph(_render_leaderboard(tmp_path, pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")), "MFU counts")
    assert all(said in text for said in entry(2.25e15))


@pytest.mark.parametrize("wall_s", [412.0, 731.0])
def test_leaderboard_handout_test_is_its_cells_beside_the_bench_run_before_it(tmp_path, wall_s):
    """The do_bench rows (timer do_bench) leave the step table to a table of their own: each beside ours' step in
    the bench's latest run before it at the same batch and commit; the prose is its cells, the ratio of the two is
    the rows', and the wall time is said within or over the leaderboard's 600 s by its cell. No do_bench row: a
    pending line naming the command."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.leaderboard_steps import step_table
    from cs336_systems.report.sections.leaderboard_handout import COMMAND, render_handout

    frame = pd.read_csv(ROOT / "results" / "leaderboard_8b.csv")
    pending = _render_handout(tmp_path, frame, render_handout, Context)
    assert "Pending" in pending and COMMAND in pending
    bench = frame[(frame["provider"] == "ours") & (frame["batch"] == 2) & (frame["status"] == "ok")].iloc[-1]
    rng = np.random.default_rng(int(wall_s))
    mean = bench["step_ms"] * rng.uniform(0.95, 1.1)
    handout = {**bench.to_dict(), "run_id": "d0be7c4a11ed", "timer": "do_bench", "step_ms": mean,
               "step_std_ms": mean * 0.01, "n_steps": 3, "first_step_s": rng.uniform(60, 200), "run_wall_s": wall_s,
               "cold_cache": True, "timestamp": bench["timestamp"] + "Z", "quoted": True}
    both = pd.concat([frame, pd.DataFrame([handout])], ignore_index=True)
    assert len(step_table(both)) == len(frame)  # the bench's table keeps only its own rows
    body = _render_handout(tmp_path, both, render_handout, Context)
    assert isinstance(body, Section) and unquoted(body) == []
    text = body.checked[1]
    assert f"{mean / bench['step_ms']:.3f}× the {bench['step_ms']:,.1f} ms" in text
    assert f"run {bench['run_id'][:6]} just before it" in text and f"took {wall_s:,.0f} s" in text
    assert ("within the leaderboard's limit" in text) == (wall_s <= 600)
    wrong = text.replace(f"{mean:,.1f}", f"{mean + 50:,.1f}")
    assert unquoted(replace(body, checked=[body.checked[0], wrong]))


def _render_handout(tmp_path, frame, render_handout, context):
    frame.to_csv(tmp_path / "leaderboard_8b.csv", index=False)
    make_tables(tmp_path, ["leaderboard_8b_handout"])
    return render_handout(context(tmp_path, tmp_path, tmp_path))


def test_memory_2026_says_which_points_ran_out_of_memory(tmp_path):
    """2026 memory_profiling (a-c), from a synthetic CSV in the memory bench's columns (the committed 2025 rows as
    template, random peaks): every prose number is a cell or a recomputed formula; (b) gives each context's two
    peaks in fp32, the naive training step at 2048 out of memory and the fallback attention's point after it; (c)
    gives bf16 less fp32 for each peak measured in both; a changed cell is caught."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.memory import render_memory_2026

    rng = np.random.default_rng()
    template = pd.read_csv(ROOT / "results" / "memory.csv").iloc[0].to_dict()
    points = [(precision, context, attention, mode) for precision in ("fp32", "bf16")
              for context, attention, modes in ((128, "naive", ("forward", "train_step")),
                                                (2048, "naive", ("forward", "train_step")),
                                                (2048, "flash_triton", ("train_step",)))
              for mode in modes]
    rows = pd.DataFrame([{**template, "size": "xl", "size_table": 2026, "precision": precision, "attention": attention,
                          "context_length": context, "mode": mode, "peak_memory_mib": rng.uniform(1e3, 1e5),
                          "status": "oom" if (context, attention, mode) == (2048, "naive", "train_step") else "ok"}
                         for precision, context, attention, mode in points])
    rows.loc[rows["status"] == "oom", "peak_memory_mib"] = float("nan")
    rows.to_csv(tmp_path / "memory_2026.csv", index=False)
    make_tables(tmp_path, ["memory_peaks_2026"])  # as the `table` rule does
    body = render_memory_2026(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(body) == []

    def peak(precision, context, attention, mode):
        row = rows[(rows["precision"] == precision) & (rows["context_length"] == context)
                   & (rows["attention"] == attention) & (rows["mode"] == mode)]
        return row["peak_memory_mib"].iloc[0]

    answer = next(p for p in body.checked if p.startswith("(b)"))
    said = (f"(b) In fp32, context 128: forward {peak('fp32', 128, 'naive', 'forward'):,.0f} MiB, training step "
            f"{peak('fp32', 128, 'naive', 'train_step'):,.0f} MiB; context 2048: forward "
            f"{peak('fp32', 2048, 'naive', 'forward'):,.0f} MiB, training step out of memory; with `flash_triton`, "
            f"{peak('fp32', 2048, 'flash_triton', 'train_step'):,.0f} MiB.")
    assert answer.startswith(said)
    assert perturbed_number(body, answer, f"{peak('fp32', 128, 'naive', 'forward'):,.0f} MiB")
    mixed = next(p for p in body.checked if p.startswith("(c)"))
    for mode, context in (("forward", 128), ("forward", 2048), ("train_step", 128)):
        assert f"{peak('bf16', context, 'naive', mode) - peak('fp32', context, 'naive', mode):+,.0f} MiB at context " \
               f"{context}" in mixed
    assert "nan" not in body.markdown()


def test_leaderboard_profile_tables_name_the_profiled_runs_commit_alone(tmp_path):
    """The profile tables show the quoted run's rows only, so their captions' provenance names that run's commit and
    date, not those of the earlier profiled runs merged into the same file."""
    from tests.test_report_frames import _step_profile_rows

    quoted = _step_profile_rows(np.random.default_rng(), dropped=False)
    earlier = quoted.assign(run_id="earlier_run", quoted=False, git_commit="e" * 40, timestamp="2099-01-01T00:00:00")
    quoted = quoted.assign(git_commit="d" * 40, timestamp="2099-02-02T00:00:00")
    pd.concat([earlier, quoted], ignore_index=True).to_csv(tmp_path / "leaderboard_8b_profile.csv", index=False)
    make_tables(tmp_path, ["leaderboard_8b_profile", "leaderboard_8b_memory"])
    for name in ("leaderboard_8b_profile", "leaderboard_8b_memory"):
        caption = (tmp_path / "tables" / f"{name}.md").read_text().strip().splitlines()[-1]
        assert f"commit {'d' * 12}; 2099-02-02." in caption and "e" * 7 not in caption
