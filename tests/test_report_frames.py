"""Numeric tables (cs336_systems/report/frame.py): one formatter for Markdown, LaTeX and prose; the frame
the `table` rule writes is the one the writeup quotes and embeds."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cs336_systems.report.frame import MISSING, Col, NumericTable, format_value
from cs336_systems.report.section import Quotes, formula_frame

ROOT = Path(__file__).resolve().parents[1]


def random_table(rng: np.random.Generator, rows: int = 7) -> NumericTable:
    """Fresh random numbers of awkward magnitudes, NaN holes, an OOM cell, a mean ± std pair, a range and a
    ratio with a suffix."""
    mean = rng.lognormal(3, 2, rows)
    data = pd.DataFrame({
        "config": [f"c{i}" for i in range(rows)], "n": rng.integers(1, 10**6, rows),
        "mean (ms)": mean, "std (ms)": mean * rng.uniform(0, 0.5, rows),
        "low": rng.uniform(0, 1, rows), "high": rng.uniform(1, 2, rows),
        "ratio": rng.lognormal(0, 1, rows), "share": rng.uniform(0, 1, rows), "tiny": rng.lognormal(-12, 2, rows)})
    data.loc[1, "ratio"] = float("nan")
    data.loc[2, "std (ms)"] = float("nan")  # a mean without a std prints alone
    return NumericTable(data, (Col("config"), Col("n", ",d"), Col("mean (ms)", ".2f", second="std (ms)"),
                               Col("low", ".1f", second="high", joiner="–"), Col("ratio", ".3f", suffix="×"),
                               Col("share", ".1%"), Col("tiny", ".2e")),
                        status={"mean (ms)": {3: "oom"}})


def expected_cell(table: NumericTable, row: int, header: str) -> str:
    """The cell written out from the rules, independently of NumericTable.cell_text."""
    data = table.data
    if header == "mean (ms)" and row == 3:
        return "OOM"
    value = data.at[row, header]
    if header == "config":
        return value
    if isinstance(value, float) and math.isnan(value):
        return "—"
    if header == "n":
        return f"{int(value):,}"
    if header == "mean (ms)":
        std = data.at[row, "std (ms)"]
        return f"{value:.2f}" + ("" if math.isnan(std) else f" ± {std:.2f}")
    if header == "low":
        return f"{value:.1f}–{data.at[row, 'high']:.1f}"
    if header == "ratio":
        return f"{value:.3f}×"
    if header == "share":
        return f"{100 * value:.1f}%"
    return f"{value:.2e}"


def markdown_cells(markdown: str) -> list[list[str]]:
    lines = markdown.splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def assert_prints_agree(table: NumericTable, tmp_path: Path) -> None:
    """The Markdown, the LaTeX, the JSON read back and the prose quotes print the same cells."""
    table.save(tmp_path / "t.json")
    assert NumericTable.load(tmp_path / "t.json").to_markdown() == table.to_markdown()
    assert markdown_cells(table.to_markdown()) == table.display().values.tolist()
    latex = table.to_latex("caption")
    assert all(cell.replace("%", r"\%").replace("_", r"\_") in latex for cell in table.cell_texts())
    for header in (c.header for c in table.columns if c.numeric):
        assert all(table.cell_text(r, header).startswith(table.quote(header, r)) for r in range(len(table)))


@pytest.mark.parametrize("seed", range(3))
def test_markdown_latex_and_prose_print_the_same_cells(seed):
    table = random_table(np.random.default_rng(seed))
    expected = [[expected_cell(table, r, h) for h in table.headers] for r in range(len(table))]
    assert table.display().values.tolist() == expected
    # Markdown: exactly the cell texts (tabulate must not reprint '0.10' as '0.1')
    assert markdown_cells(table.to_markdown()) == expected
    # LaTeX: every cell text, escaped as LaTeX escapes it
    latex = table.to_latex("a caption_with underscore")
    for row in expected:
        for cell in row:
            assert cell.replace("%", r"\%").replace("_", r"\_") in latex
    assert r"a caption\_with underscore" in latex
    # prose: a quote is the cell's first number, printed by the cell's own format
    for r in range(len(table)):
        assert table.quote("ratio", r) == expected[r][4]
        if r != 3:
            assert expected[r][2].startswith(table.quote("mean (ms)", r))
    assert table.quote("mean (ms)", 3) == "OOM" and table.quote("ratio", 1) == MISSING


def test_json_round_trip_keeps_numbers_formats_and_statuses(tmp_path):
    table = random_table(np.random.default_rng(7))
    table.save(tmp_path / "t.json")
    back = NumericTable.load(tmp_path / "t.json")
    assert back.columns == table.columns and back.status == table.status
    assert back.to_markdown() == table.to_markdown()
    pd.testing.assert_frame_equal(back.data, table.data)  # exact floats: JSON keeps repr's 17 digits
    json.loads((tmp_path / "t.json").read_text())  # plain JSON (NaN stored as null)


def test_nan_and_status_render_as_dash_and_upper_case():
    table = NumericTable(pd.DataFrame({"x": [1.0, float("nan"), 3.0], "who": ["a", None, "c"]}),
                         (Col("who"), Col("x", ".1f")), status={"x": {2: "oom"}})
    assert table.display().values.tolist() == [["a", "1.0"], ["—", "—"], ["c", "OOM"]]
    frame = formula_frame(table)  # formulas see NaN where a cell has a status, and the status beside it
    assert math.isnan(frame.at[2, "x"]) and frame["x: status"].tolist() == ["", "", "oom"]
    assert format_value(float("nan"), ".2f") == "—" and format_value(3.0, "d") == "3"


def test_bad_columns_are_named():
    with pytest.raises(ValueError, match="'missing'"):
        NumericTable(pd.DataFrame({"a": [1]}), (Col("a", "d", second="missing"),))
    with pytest.raises(ValueError, match="unknown columns"):
        NumericTable(pd.DataFrame({"a": [1]}), (Col("a", "d"),), status={"b": {0: "oom"}})
    table = NumericTable(pd.DataFrame({"k": ["x", "x"], "a": [1, 2]}), (Col("k"), Col("a", "d")))
    with pytest.raises(KeyError, match="2 rows match"):
        table.quote("a", k="x")
    with pytest.raises(KeyError, match="no column 'b'"):
        table.col("b")


def test_quotes_read_numbers_not_display_strings():
    table = NumericTable(pd.DataFrame({"k": ["a", "b"], "ms": [2.0, 3.14159], "sd": [0.5, 0.25]}),
                         (Col("k"), Col("ms", ".2f", second="sd")))
    q = Quotes(table)
    assert q.cell("ms", k="b") == "3.14"
    ratio = q.derive(lambda t: t.loc[t["k"] == "b", "ms"].iloc[0] / t.loc[t["k"] == "a", "ms"].iloc[0], ".4f", "b/a")
    assert ratio == f"{3.14159 / 2:.4f}"  # from the unrounded numbers, not the printed 3.14


# --- each table is built once: the writeup embeds and quotes the frame the table rule wrote ------------------

def built_tables() -> list[str]:
    return sorted(p.stem for p in (ROOT / "results" / "tables").glob("*.md"))


@pytest.mark.parametrize("name", built_tables())
def test_every_committed_table_has_its_frame_and_prints_it(name):
    """The .md of a table is its frame's Markdown (plus caption): what the section quotes is what it embeds."""
    md = (ROOT / "results" / "tables" / f"{name}.md").read_text()
    table = NumericTable.load(ROOT / "results" / "tables" / f"{name}.json")
    assert md.startswith(table.to_markdown() + "\n\n_")


def test_the_writeup_embeds_the_frames_it_quotes():
    """Every converted section's Section.table is the frame read back from JSON, its Markdown is in the
    section, and that Markdown is the .md file the table rule wrote (so there is one build per table)."""
    import os

    from cs336_systems.report.section import Context, Section
    from cs336_systems.report.sections import DELIVERABLES

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        ctx = Context(Path("results"), Path("figures"), Path("results"))
        numeric = 0
        for item in DELIVERABLES:
            if not item.data or any(ctx.frame(n) is None for n in item.data):
                continue
            body = item.render(ctx)
            if isinstance(body, Section) and isinstance(body.table, NumericTable):
                numeric += 1
                markdown = body.table.to_markdown()
                assert markdown in body.markdown(), item.section
                assert any(markdown in (ROOT / "results" / "tables" / f"{t.name}.md").read_text()
                           for t in item.tables), item.section
    finally:
        os.chdir(here)
    # every measured section with a table (28 of 28 today, the 8B step breakdown included)
    assert numeric >= 28


def test_table_rule_writes_the_frame(tmp_path):
    """`python -m cs336_systems.report table` writes .md, .tex and .json of one build."""
    from cs336_systems.report.__main__ import main

    rows = pd.DataFrame({"backend": "gloo", "world_size": [2, 2], "size_mb": [1.0, 10.0], "mean_ms": [1.0, 2.0],
                         "std_ms": 0.1, "median_ms": [0.9, 1.95], "algbw_gbps": [1.1, 5.0], "busbw_gbps": [1.1, 5.0],
                         "iters": 5, "status": "ok", "device_name": "cpu"})
    rows.to_csv(tmp_path / "allreduce.csv", index=False)
    out = {ext: tmp_path / f"t.{ext}" for ext in ("md", "tex", "json")}
    main(["table", "allreduce", str(tmp_path / "allreduce.csv"), *[f"--{e}={p}" for e, p in out.items()]])
    table = NumericTable.load(out["json"])
    assert out["md"].read_text().startswith(table.to_markdown())
    assert table.quote("median (ms)", processes=2, **{"size (MiB)": 10}) == "1.950"
    assert re.search(r"1\.950", out["tex"].read_text())


def test_converted_sections_never_rebuild_their_tables(monkeypatch):
    """One build per table: with every numeric table's builder made to fail, the sections that quote numeric
    tables still render from the committed results (they read results/tables/NAME.json)."""
    import importlib
    import os

    from cs336_systems.report.section import Context, Section
    from cs336_systems.report.sections import DELIVERABLES

    def refuse(*args, **kwargs):
        raise AssertionError("a section rebuilt a table the `table` rule already built")

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        ctx = Context(Path("results"), Path("figures"), Path("results"))
        converted = [item for item in DELIVERABLES if item.tables and all(
            (ROOT / "results" / "tables" / f"{t.name}.json").exists() and
            any(c.numeric for c in NumericTable.load(ROOT / "results" / "tables" / f"{t.name}.json").columns)
            for t in item.tables) and all(ctx.frame(n) is not None for n in item.data)]
        for item in converted:
            for table in item.tables:  # the builder by the name its module calls it
                monkeypatch.setattr(importlib.import_module(table.build.__module__), table.build.__name__, refuse)
        rendered = [item.render(ctx) for item in converted]
    finally:
        os.chdir(here)
    assert len(rendered) >= 23 and sum(isinstance(body, Section) for body in rendered) >= 23


def test_phase_tables_keep_numbers_and_print_mean_std_oom_and_dashes():
    """e2e_timing as numbers (mean, std, an OOM status), printed as 'mean ± std' cells, 'OOM', and '—' where
    nothing ran; Markdown, LaTeX and prose print the same cells."""
    from cs336_systems.report.tables import e2e_timing

    rng = np.random.default_rng(3)
    rows = []
    for size in ("small", "medium", "large"):
        for attention in ("naive", "sdpa"):
            for phase in ("forward", "backward"):
                rows.append({"size": size, "attention": attention, "phase": phase, "precision": "fp32",
                             "mode": "forward_backward", "status": "ok", "mean_ms": rng.lognormal(3, 1),
                             "std_ms": rng.uniform(0, 1)})
    rows = [r for r in rows if not (r["size"] == "medium" and r["attention"] == "naive")
            and not (r["size"] == "large" and r["attention"] == "sdpa")]  # large sdpa: never ran
    rows.append({"size": "medium", "attention": "naive", "phase": "step", "precision": "fp32",
                 "mode": "forward_backward", "status": "oom", "mean_ms": float("nan"), "std_ms": float("nan")})
    frame = pd.DataFrame(rows)
    table = e2e_timing(frame)
    small = frame[(frame["size"] == "small") & (frame["attention"] == "sdpa") & (frame["phase"] == "backward")].iloc[0]
    assert table.value("sdpa backward (ms)", size="small") == small["mean_ms"]  # the number, not its print
    assert math.isnan(table.value("naive forward (ms)", size="medium"))
    assert table.status == {"naive forward (ms)": {1: "oom"}, "naive backward (ms)": {1: "oom"}}
    shown = table.display().set_index("size")
    assert shown.loc["small", "sdpa backward (ms)"] == f"{small['mean_ms']:.2f} ± {small['std_ms']:.2f}"
    assert shown.loc["medium", "naive forward (ms)"] == "OOM" and shown.loc["large", "sdpa forward (ms)"] == MISSING
    assert markdown_cells(table.to_markdown()) == table.display().values.tolist()
    assert table.quote("sdpa backward (ms)", size="small") == f"{small['mean_ms']:.2f}"


def _profile_rows(rng: np.random.Generator) -> pd.DataFrame:
    """Profiler rows of two sizes at two lengths (the larger size's longer length out of memory): per phase a
    few kernels with fresh random times and whole call counts, two instantiations of one label, and the
    harness's wall time per phase."""
    rows = []
    base = {"context_length": 0, "batch_size": 2, "precision": "bf16", "steps": 1, "tool": "torch", "status": "ok"}
    names = ["gemm_a", "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>(int)",
             "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<c10::Half>>(int)",
             "softmax_warp_forward"]  # (a bare "softmax" is an attention-stage range, not a kernel)
    for size in ("tiny", "mini"):
        for context in (16, 32):
            point = {**base, "size": size, "context_length": context}
            if size == "mini" and context == 32:
                rows.append({**point, "kind": "point", "phase": "step", "status": "oom"})
                continue
            for phase in ("forward", "backward", "optimizer"):
                rows += [{**point, "kind": "kernel", "phase": phase, "name": name,
                          "calls_per_step": float(rng.integers(1, 500)), "ms_per_step": rng.lognormal(0, 1.5)}
                         for name in names]
                rows.append({**point, "kind": "harness", "phase": phase, "name": phase,
                             "ms_per_step": rng.lognormal(1, 1)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(2))
def test_profile_tables_are_numeric_and_print_the_same_cells_everywhere(seed, tmp_path):
    """profile_grid, profile_kernels and kernel_vs_wall against sums computed here from the rows: numbers kept,
    the OOM point's times '—' with its status 'OOM'; the Markdown, the LaTeX, the JSON read back and the
    prose quotes print the same cells."""
    from cs336_systems.report.profile_tables import kernel_label, kernel_vs_wall, profile_grid, profile_kernels

    rows = _profile_rows(np.random.default_rng(seed))
    kernels = rows[rows["kind"] == "kernel"].assign(label=lambda f: f["name"].map(kernel_label))
    for build in (profile_grid, profile_kernels, kernel_vs_wall):
        assert_prints_agree(build(rows), tmp_path)

    grid = profile_grid(rows)
    oom = grid.row(size="mini", context=32)
    assert grid.cell_text(oom, "status") == "OOM" and grid.cell_text(oom, "forward kernels (ms)") == MISSING
    point = kernels[(kernels["size"] == "tiny") & (kernels["context_length"] == 16)]
    for phase in ("forward", "backward", "optimizer"):
        expected = point.loc[point["phase"] == phase, "ms_per_step"].sum()
        assert grid.value(f"{phase} kernels (ms)", size="tiny", context=16) == pytest.approx(expected, rel=1e-12)
        assert grid.quote(f"{phase} kernels (ms)", size="tiny", context=16) == f"{expected:.2f}"

    top = profile_kernels(rows)  # the discussed point: the largest size that ran at its longest context
    forward = kernels[(kernels["size"] == "mini") & (kernels["context_length"] == 16) & (kernels["phase"] == "forward")]
    summed = forward.groupby("label")[["ms_per_step", "calls_per_step"]].sum().sort_values("ms_per_step")
    first = top.data.index[top.data["phase"] == "forward"][0]
    assert top.data.at[first, "kernel"] == summed.index[-1][:70]
    assert top.quote("share of phase", first) == f"{summed['ms_per_step'].iloc[-1] / forward['ms_per_step'].sum():.1%}"
    assert top.quote("calls per step", first) == f"{summed['calls_per_step'].iloc[-1]:.0f}"  # a count: no '.0'

    wall = kernel_vs_wall(rows)
    harness = rows[(rows["kind"] == "harness") & (rows["size"] == "tiny") & (rows["context_length"] == 16)]
    share = point["ms_per_step"].sum() / harness["ms_per_step"].sum()
    assert wall.quote("kernel share of step", size="tiny", context=16) == f"{share:.2f}"
    assert wall.cell_text(wall.row(size="mini", context=32), "kernel share of step") == MISSING


@pytest.mark.parametrize("seed", range(3))
def test_optimizer_table_prints_medians_bandwidth_and_ratio_to_torch(seed, tmp_path):
    """One statistic, the median (means drawn apart from it, so a mean in a cell is caught); the bandwidth
    and the ratio to torch's fused AdamW from it; OOM cells, and '—' where torch's fused AdamW did not run."""
    from cs336_systems.model import get_config, parameter_count
    from cs336_systems.report.tables import OPTIMIZER_STEP, TRAINING_STEP, VERSUS_TORCH, optimizer_timing

    rng = np.random.default_rng(seed)
    rows = []
    for size, ran in (("small", ("foreach", "fused", "torch_fused")), ("medium", ("foreach", "fused")),
                      ("2.7B", ())):
        for optimizer in ("foreach", "fused", "torch_fused"):
            if optimizer not in ran:  # an out-of-memory point has one 'step' row with that status
                rows.append({"size": size, "optimizer": optimizer, "phase": "step", "status": "oom"})
                continue
            for phase in ("optimizer", "step"):
                median = rng.lognormal(2, 1.5)
                rows.append({"size": size, "optimizer": optimizer, "phase": phase, "status": "ok",
                             "median_ms": median, "mean_ms": median * rng.uniform(1.1, 2), "std_ms": rng.uniform(0, 9)})
    frame = pd.DataFrame(rows).sample(frac=1, random_state=seed)  # the builder orders the rows itself
    table = optimizer_timing(frame)
    assert table.display()[["size", "optimizer"]].values.tolist() == [
        [s, o] for s in ("small", "medium", "2.7B") for o in ("foreach", "fused", "torch_fused")]
    ok = frame[frame["status"] == "ok"].set_index(["size", "optimizer", "phase"])["median_ms"]
    torch_small = ok[("small", "torch_fused", "optimizer")]
    for (size, optimizer, phase), median in ok.items():
        keys = {"size": size, "optimizer": optimizer}
        header = OPTIMIZER_STEP if phase == "optimizer" else TRAINING_STEP
        assert table.cell_text(table.row(**keys), header) == f"{median:.2f}"
        if phase == "optimizer":
            bandwidth = parameter_count(get_config(size)) * 28 / (median / 1e3) / 1e9
            assert table.quote("GB/s at 28 B/param", **keys) == f"{bandwidth:.0f}"
            ratio = f"{median / torch_small:.2f}" if size == "small" else MISSING
            assert table.quote(VERSUS_TORCH, **keys) == ratio
    for keys in ({"size": "medium", "optimizer": "torch_fused"}, {"size": "2.7B", "optimizer": "fused"}):
        assert table.quote(OPTIMIZER_STEP, **keys) == "OOM" and table.quote(TRAINING_STEP, **keys) == "OOM"
        assert table.quote("GB/s at 28 B/param", **keys) == MISSING and table.quote(VERSUS_TORCH, **keys) == MISSING
    assert_prints_agree(table, tmp_path)


def _saved_rows(rng: np.random.Generator) -> pd.DataFrame:
    """saved_tensors rows of one block, eager and compiled, with every kind's MiB per tensor above its MiB per
    storage (views counted once): fresh random sizes, none equal, so reading the wrong row or column shows."""
    rows = []
    for mode in ("eager", "compiled"):
        for kind in ("activation", "input", "parameter"):
            storage = rng.uniform(1, 5000)
            rows.append({"case": "block", "mode": mode, "kind": kind, "storage_mib": storage,
                         "tensor_mib": storage * rng.uniform(1, 2), "batch_size": 4, "context_length": 64,
                         "d_model": 32, "d_ff": 128, "num_heads": 4, "precision": "fp32"})  # the bench's settings
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed", range(2))
def test_checkpoint_cost_table_models_the_eager_blocks_measured_sizes(seed, tmp_path):
    """3.2 (a)'s table: the cost model at the eager block's residuals and boundary, each storage once; no rows
    where the results hold no eager block."""
    from cs336_systems.model import CheckpointPolicy, checkpoint_cost
    from cs336_systems.report.sections.checkpointing import cost_model_table

    rows = _saved_rows(np.random.default_rng(seed))
    eager = rows[rows["mode"] == "eager"].set_index("kind")["storage_mib"]
    table = cost_model_table(rows)
    policies = {"none": CheckpointPolicy(), "every block": CheckpointPolicy.every(1),
                "recursive halving": CheckpointPolicy.binary(32)}
    for name, policy in policies.items():
        cost = checkpoint_cost(policy, 32, eager["activation"], eager["input"])
        assert table.value("peak activations (GiB)", N=32, policy=name) == pytest.approx(cost.peak_bytes / 1024)
        assert table.quote("block forwards / N", N=32, policy=name) == f"{cost.block_forwards / 32:.2f}"
    assert table.quote("block forwards / N", N=8, policy="none") == "1.00"  # no recomputation
    assert_prints_agree(table, tmp_path)
    assert len(cost_model_table(rows[rows["mode"] == "compiled"])) == 0


def test_checkpointing_table_prints_the_model_state_in_every_row(tmp_path):
    """The sweep's table: medians and peaks where a policy ran ('—' where it ran out of memory), and beside them
    the float32 weights and two AdamW moments of the swept model in every row (12 B per parameter, counted
    here from the config's shapes)."""
    from cs336_systems.model import MODEL_SIZES_2026
    from cs336_systems.report.sections.checkpointing import checkpointing_table

    rng = np.random.default_rng(5)
    policies = [("none", "none", 0, "oom"), ("every:1", "every", 1, "ok"), ("every:4", "every", 4, "ok"),
                ("nested:4,2", "nested", 4, "ok")]
    frame = pd.DataFrame([{"policy": p, "policy_kind": kind, "segment_blocks": k, "status": status,
                           "block_forwards": 2 * 12, "size": "small", "size_table": "2026",
                           "num_layers": 12, "batch_size": 4, "context_length": 256,
                           "median_ms": rng.lognormal(5, 1) if status == "ok" else float("nan"),
                           "peak_memory_mib": rng.uniform(1e3, 9e4), "peak_fwd_bwd_mib": rng.uniform(1e3, 9e4),
                           "baseline_mib": rng.uniform(1e3, 9e4)} for p, kind, k, status in policies])
    table = checkpointing_table(frame)
    config = MODEL_SIZES_2026["small"]
    d, f = config.d_model, config.d_ff
    params = 2 * config.vocab_size * d + config.num_layers * (4 * d * d + 3 * d * f + 2 * d) + d
    assert table.display()["weights + moments (GiB)"].tolist() == [f"{12 * params / 2**30:.2f}"] * len(policies)
    ran = frame.iloc[1]
    assert table.quote("step (ms, median)", policy="every:1") == f"{ran['median_ms']:.1f}"
    assert table.quote("allocated at step start (GiB)", policy="every:1") == f"{ran['baseline_mib'] / 1024:.2f}"
    assert table.quote("peak memory (GiB)", policy="none") == MISSING
    assert_prints_agree(table, tmp_path)


def test_mixed_precision_speedup_is_a_ratio_of_the_means_its_table_prints(tmp_path):
    """1.1.5 (c): the times are means ± std, so the speed-up is fp32's mean step over bf16's (medians drawn
    apart from the means, so a speed-up of medians is caught); '—' for a size with one precision only."""
    from cs336_systems.report.tables import mixed_precision

    rng = np.random.default_rng(11)
    rows = [{"size": size, "precision": precision, "phase": phase, "attention": "naive", "mode": "forward_backward",
             "status": "ok", "mean_ms": rng.lognormal(3, 1), "std_ms": rng.uniform(0, 2)}
            for size in ("small", "large") for precision in ("fp32", "bf16")
            for phase in ("forward", "backward", "step") if (size, precision) != ("large", "bf16")]
    frame = pd.DataFrame(rows).assign(median_ms=lambda f: f["mean_ms"] * rng.uniform(0.5, 0.9, len(f)))
    table = mixed_precision(frame)
    step = frame[frame["phase"] == "step"].set_index(["size", "precision"])["mean_ms"]
    assert table.quote("bf16 speed-up", size="small") == f"{step[('small', 'fp32')] / step[('small', 'bf16')]:.2f}"
    assert table.quote("bf16 speed-up", size="large") == MISSING
    assert_prints_agree(table, tmp_path)


def _leaderboard_rows(rng: np.random.Generator, clocks: bool = False) -> pd.DataFrame:
    """Two runs of the 8B step at fresh random times, as merged (the check rows go to their own file): the anchors,
    ours, a sized ablation and an out-of-memory ablation; the second run measured on a CPU (no MFU, no peak, no clock).
    clocks: the GPU run's rows carry the SM clock and power columns."""
    rows = []
    for run, batch, cpu in (("a1b2c3d4e5f6", 2, False), ("9f8e7d6c5b4a", 1, True)):
        for provider, checkpoint, status in (("ours", f"selective:0,{rng.integers(1, 34)}", "ok"),
                                             ("torch_plain_sac", "sac", "ok"), ("torch_plain_ac", "ac", "ok"),
                                             ("ours-mm:6", "selective:0,6", "ok"),
                                             ("ours-no_fused_ce", "selective", "oom")):
            mean = rng.lognormal(8, 0.3)
            rows.append({"run_id": run, "provider": provider, "batch": batch, "status": status,
                         "checkpoint": checkpoint, "param_dtype": "bf16", "optimizer_state_dtype": "bf16",
                         "microbatch": batch, "git_commit": run[::-1], "warmup": 2, "quoted": True,
                         "n_steps": np.nan if status == "oom" else 3,
                         **({} if status == "oom" else {
                             "step_ms": mean, "step_std_ms": mean * rng.uniform(0, 0.01),
                             "step_median_ms": mean * rng.uniform(0.99, 1.01), "first_step_s": rng.uniform(5, 40),
                             "tflops": rng.uniform(300, 600), "mfu": np.nan if cpu else rng.uniform(0.3, 0.6),
                             "peak_mem_gib": np.nan if cpu else rng.uniform(60, 140),
                             **({"sm_clock_mhz": np.nan if cpu else rng.uniform(1400, 1980),
                                 "power_w": np.nan if cpu else rng.uniform(300, 700)} if clocks else {})})})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("seed,clocks", [(0, False), (1, True), (2, False), (3, True)])
def test_leaderboard_tables_print_the_same_cells_and_each_rows_checkpointing(seed, clocks, tmp_path):
    """The 8B step and ablation tables against the rows: each timed row's checkpointing is its cell (the intro
    quotes ours' choice from it), the ratio is the mean over the SAC anchor's mean of the same run, OOM rows
    print OOM and a CPU's MFU '—'; the SM clock and power columns exactly when some row has them, '—' where a row
    has none; the Markdown, the LaTeX, the JSON read back and the prose quotes agree."""
    from cs336_systems.report.sections.leaderboard_steps import ablation_table, step_table

    rows = _leaderboard_rows(np.random.default_rng(seed), clocks)
    steps = step_table(rows)
    assert ({"SM clock (MHz)", "power (W)"} <= set(steps.headers)) == clocks
    timed = rows[rows["status"] != "check_ok"].reset_index(drop=True)
    assert steps.display()["checkpoint"].tolist() == timed["checkpoint"].tolist()
    for i, row in timed.iterrows():
        anchor = timed[(timed["run_id"] == row["run_id"]) & (timed["provider"] == "torch_plain_sac")]["step_ms"].iloc[0]
        if row["status"] == "oom":
            assert steps.cell_text(i, "step (ms, mean ± std)") == "OOM" and steps.cell_text(i, "MFU") == "OOM"
            assert steps.cell_text(i, "÷ SAC anchor") == MISSING
            continue
        assert steps.quote("÷ SAC anchor", i) == f"{row['step_ms'] / anchor:.3f}"
        assert steps.quote("MFU", i) == (MISSING if np.isnan(row["mfu"]) else f"{row['mfu']:.3f}")
        if clocks:
            assert steps.quote("SM clock (MHz)", i) == (MISSING if np.isnan(row["sm_clock_mhz"])
                                                        else f"{row['sm_clock_mhz']:,.0f}")
    assert_prints_agree(steps, tmp_path)
    ablations = ablation_table(rows)
    assert ablations.data["ablation"].tolist() == ["ours-mm:6", "ours-no_fused_ce"] * 2
    assert_prints_agree(ablations, tmp_path)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_leaderboard_power_sentence_is_the_powered_runs_cells(seed):
    """The gap paragraph's power sentence: the latest run with the GPU's power recorded (the CPU run after it has
    none), its lowest-highest power, whether that is at the board's limit, and ours' and the anchor's energy per step
    as mean step × mean power from the rows; no sentence where no row has the columns."""
    from cs336_systems.report.section import Quotes
    from cs336_systems.report.sections.leaderboard import POWER_LIMIT_W, _gap_paragraph
    from cs336_systems.report.sections.leaderboard_steps import step_table

    rng = np.random.default_rng(seed)
    rows = _leaderboard_rows(rng, clocks=True)
    gpu = rows[(rows["run_id"] == "a1b2c3d4e5f6") & rows["step_ms"].notna()]
    if seed == 6:  # every provider at the limit
        rows.loc[gpu.index, "power_w"] = rng.uniform(0.96, 0.99, len(gpu)) * POWER_LIMIT_W
        gpu = rows.loc[gpu.index]
    text = _gap_paragraph(Quotes(step_table(rows)), [2, 1])
    assert "In run a1b2c3 " in text and f"{gpu['power_w'].min():,.0f}" in text
    for provider in ("ours", "torch_plain_sac"):
        row = gpu[gpu["provider"] == provider].iloc[0]
        assert f"{row['step_ms'] * row['power_w'] / 1e6:.2f} kJ" in text, provider
    assert ("runs at the power limit" in text) == (gpu["power_w"].min() >= 0.95 * POWER_LIMIT_W)
    plain = _gap_paragraph(Quotes(step_table(_leaderboard_rows(np.random.default_rng(seed)))), [2, 1])
    assert "kJ" not in plain and " W " not in plain


def _step_profile_rows(rng: np.random.Generator, dropped: bool) -> pd.DataFrame:
    """A profiled step of two providers at fresh random times (ms): the categories, their total summed another way
    (short of them by the AdamW kernels the profiler linked to no op where `dropped`, whose `optimizer` then
    reads 0), the wall time; the memory split with a CPU's NaN peak for one provider; a failed provider's error."""
    from cs336_systems.report.sections.leaderboard_profile import MEMORY_PARTS, PROFILE_CATEGORIES

    rows = []
    for provider in ("ours", "ours-mm:6"):
        times = {c: rng.lognormal(5, 1.5) for c in PROFILE_CATEGORIES}
        missing = rng.uniform(5, 50) if dropped else 0.0
        if dropped:
            times["optimizer"] = 0.0
        total = sum(times.values()) + missing
        times |= {"profiled ops (total)": total, "step (wall)": total + rng.uniform(0, 20)}
        rows += [{"provider": provider, "kind": "time", "category": c, "value": v} for c, v in times.items()]
        parts = {part: rng.uniform(1, 40) for part in MEMORY_PARTS}
        if provider != "ours":
            parts["peak"] = parts["activations + workspace"] = np.nan
        rows += [{"provider": provider, "kind": "memory", "category": c, "value": v} for c, v in parts.items()]
    rows.append({"provider": "torch_plain_sac", "kind": "error", "category": "error", "value": np.nan})
    return pd.DataFrame(rows).assign(run_id="a1b2c3d4e5f6", batch=2, quoted=True)  # one run, as merged (bench.merge)


@pytest.mark.parametrize("dropped", [True, False])
def test_step_profile_tables_are_the_rows_and_print_the_same_cells(dropped, tmp_path):
    """The profiled step's time table (category × provider) and memory table (provider × part) hold the rows'
    numbers, a missing peak prints '—', and every printing of them agrees."""
    from cs336_systems.report.sections.leaderboard_profile import memory_table, profile_table

    rows = _step_profile_rows(np.random.default_rng(int(dropped)), dropped)
    times, memory = profile_table(rows), memory_table(rows)
    for (provider, category), value in rows[rows["kind"] == "time"].set_index(["provider", "category"])["value"].items():
        assert times.quote(provider, category=category) == f"{value:,.1f}"
    for (provider, part), value in rows[rows["kind"] == "memory"].set_index(["provider", "category"])["value"].items():
        assert memory.quote(part, provider=provider) == (MISSING if np.isnan(value) else f"{value:,.2f}")
    assert "torch_plain_sac" not in times.headers  # its profiled step failed: no column
    assert_prints_agree(times, tmp_path)
    assert_prints_agree(memory, tmp_path)
