"""Report helpers on synthetic inputs with known answers: allocator snapshots (real ones need CUDA),
profiler traces and the training-matrix table."""

import os
import pickle
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cs336_systems.report import memory
from cs336_systems.report.section import Quotes, Section, column_values
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
    xs, ys = memory.active_timeline(SNAPSHOT)
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
    table = train_matrix(frame).set_index("wrapper")
    assert table.loc["torch_ddp", "step (ms, median)"] == 10 and table.loc["torch_ddp", "tokens/s"] == 100_000
    assert table.loc["single GPU", "max |loss − torch DDP|"] == 0.5
    assert table.loc["single GPU", "ranks"] == 1 and table.loc["single GPU", "final loss"] == 1.0


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


def test_optimizer_table_bandwidth_and_oom():
    from cs336_systems.model import get_config, parameter_count
    from cs336_systems.report.tables import optimizer_timing

    params = parameter_count(get_config("small"))
    base = {"size": "small", "status": "ok", "std_ms": 0.1}
    frame = pd.DataFrame([
        {**base, "optimizer": "fused", "phase": "optimizer", "mean_ms": 2.0, "median_ms": 2.0},
        {**base, "optimizer": "fused", "phase": "step", "mean_ms": 30.0, "median_ms": 30.0},
        {**base, "size": "2.7B", "optimizer": "fused", "phase": "step", "status": "oom"},
    ])
    table = optimizer_timing(frame).set_index("size")
    assert table.loc["small", "GB/s at 28 B/param"] == round(params * 28 / 2e-3 / 1e9)
    assert table.loc["small", "optimizer step (ms)"] == "2.00 ± 0.10"
    assert table.loc["2.7B", "optimizer step (ms)"] == "OOM"
    assert pd.isna(table.loc["2.7B", "GB/s at 28 B/param"])


# --- Each section's prose quotes the table it embeds --------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])(%?)")


def prose_numbers(paragraph: str) -> list[tuple[str, bool]]:
    """The numbers a paragraph states, each with whether it is a percentage (code spans are names, not data)."""
    text = re.sub(r"`[^`]*`", " ", paragraph)
    return [(found[0].removesuffix("%"), bool(found[1])) for found in NUMBER.finditer(text)]


def printed(token: str) -> str:
    return token.replace(",", "").replace("−", "-").lstrip("+")


def in_table(token: str, percent: bool, table: pd.DataFrame) -> bool:
    """Whether some number the table prints is `token` at the token's precision (a prose 125.7 quotes a
    cell 125.72 ± 18.51), or, for a percentage, a fraction the table prints."""
    target = printed(token)
    if "e" in target:  # a number printed in scientific notation: compare its significant digits
        mantissa = target.split("e")[0].lstrip("-")
        significant = len(mantissa.replace(".", "").lstrip("0"))
        return any(f"{v:.{significant - 1}e}" == f"{abs(float(target)):.{significant - 1}e}"
                   for v in table_numbers(table))
    digits = len(token.split(".")[1]) if "." in token else 0
    for value in table_numbers(table):
        candidates = (value, value * 100) if percent else (value,)
        if any(f"{abs(v):.{digits}f}" == target.lstrip("-") for v in candidates):
            return True
    return False


def table_numbers(table: pd.DataFrame) -> list[float]:
    """Every number the table's cells print (both of 'mean ± std'), as magnitudes."""
    return [abs(float(v.replace(",", "").replace("−", "-"))) for cell in table.to_numpy().ravel()
            for v in re.findall(r"[-−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", str(cell))]


def unquoted(section: Section) -> list[str]:
    """What in a section's checked prose is not its table's: numbers that are neither a cell nor a declared
    derived value nor wording, and derived values the table no longer gives."""
    problems = [f"{d.what}: the prose says {d.text}, the table gives {format(d.formula(section.table), d.fmt)}"
                for d in section.derived if format(d.formula(section.table), d.fmt) != d.text]
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

    anchors = yaml.safe_load((ROOT / "config.yaml").read_text())["anchors"]
    here = Path.cwd()
    os.chdir(ROOT)  # figure links are relative to the working directory
    try:
        ctx = Context(Path("results"), Path("figures"), Path("results"), anchors)
        # sections whose data is not measured yet render as the writeup shows them: a pending line
        yield {item.section: item.render(ctx) if all(ctx.frame(name) is not None for name in item.data)
               else render(item, ctx) for item in DELIVERABLES}
    finally:
        os.chdir(here)


# The sections whose prose is picked from the table they embed; the others still compute their text
# from the results rows (each is a Section once converted, and is then checked below).
QUOTING = ["1.1.5 (c)", "1.2.1", "1.3.1 (a)", "1.3.1 (b) torch_compile", "1.3.2 flash_forward",
           "1.3.2 (e) flash_benchmarking", "1.3.2 (e), continued", "1.3.3", "2.1",
            "2.2", "2.3 ddp_overlap_individual_parameters_benchmarking (a)", "2.3 ddp_bucketed", "End to end"]


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
    table = body.table.copy()
    table["speed-up, blocks"] = [f"{v * 1.1:.2f}" for v in column_values(table, "speed-up, blocks")]
    problems = unquoted(replace(body, table=table))
    assert any("block-compiled speed-up" in problem for problem in problems)


def test_prose_check_on_a_known_table():
    """Cells match at the prose's precision, derived numbers are recomputed, anything else is reported."""
    table = pd.DataFrame({"size": ["small", "xl"], "step (ms)": ["20.84 ± 0.28", "125.72 ± 18.51"],
                          "MFU": [0.205, 0.284]})
    quotes = Quotes(table)
    ratio = quotes.derive(lambda t: column_values(t, "step (ms)").iloc[1] / column_values(t, "step (ms)").iloc[0],
                          ".2f", "xl over small")
    good = f"xl takes 125.7 ms (std 18.5), {ratio}× small's 20.84 ms, at 28.4% MFU; `nvjet_sm90_128x64` is a name."
    section = Section([good], table, [good], quotes.derived)
    assert unquoted(section) == []
    assert unquoted(replace(section, checked=[good.replace("125.7", "125.9")])) == ["125.9 in: " + good.replace(
        "125.7", "125.9")[:100] + "…"]
    assert unquoted(replace(section, checked=[good.replace("28.4%", "28.4")]))  # 28.4 is no cell; 0.284 is
    assert unquoted(replace(section, checked=[good + " It ran 3 times."]))  # a number the table does not hold
    assert unquoted(replace(section, checked=[good + " It ran 3 times."], wording=("3",))) == []


def test_ddp_specs_come_from_the_rows_columns():
    """The report reads each DDP config from its row's dp_kind / bucket_mb / optimizer_sharding columns
    (written by the benchmark's parser), not from the config string."""
    from cs336_systems.report.sections.distributed import DdpConfig, ddp_specs

    frame = pd.DataFrame({"config": ["bucketed:100+sharded", "torch_ddp+zero", "individual-thread", "torch_ddp:1"],
                          "dp_kind": ["bucketed", "torch_ddp", "individual-thread", "torch_ddp"],
                          "bucket_mb": [100.0, None, None, 1.0],
                          "optimizer_sharding": ["sharded", "zero", "none", "none"]})
    specs = ddp_specs(frame)
    assert specs["bucketed:100+sharded"] == DdpConfig("bucketed", 100.0, "sharded")
    assert specs["torch_ddp+zero"] == DdpConfig("torch_ddp", None, "zero")
    assert specs["individual-thread"] == DdpConfig("individual-thread", None, None)
    assert specs["bucketed:100+sharded"].wrapper == "bucketed:100" and specs["torch_ddp:1"].wrapper == "torch_ddp:1"
    committed = ddp_specs(pd.read_csv(ROOT / "results" / "sharding.csv"))
    assert committed["bucketed:1000+sharded"] == DdpConfig("bucketed", 1000.0, "sharded")


def test_sections_without_data_say_pending_naming_their_rule(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.writeup import render

    ctx = Context(tmp_path, tmp_path, tmp_path, {})
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

    anchors = yaml.safe_load((ROOT / "config.yaml").read_text())["anchors"]
    here = Path.cwd()
    os.chdir(ROOT)
    try:
        for item in DELIVERABLES:
            ctx = Recording(Path("results"), Path("figures"), Path("results"), anchors)
            ctx.embedded = []
            if any(ctx.frame(name) is None for name in item.data):
                continue  # not measured yet (the writeup says pending); the smoke run renders it
            item.render(ctx)
            tables = {name for kind, name in ctx.embedded if kind == "table"}
            figures = {name for kind, name in ctx.embedded if kind == "figure" and name in FIGURES}
            assert tables == {t.name for t in item.tables}, item.section
            assert figures == {f.name for f in item.figures}, item.section
    finally:
        os.chdir(here)
