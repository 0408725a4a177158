"""The attention sections' arithmetic (analysis/attention_math.py), the flash correctness tables and the
accuracy check's verdict, on inputs with known answers."""

import math

import pandas as pd
import pytest

from cs336_systems.bench.flash_accuracy import failures
from cs336_systems.analysis import attention_math
from cs336_systems.analysis.attention_math import attention_flops, executed_tflops, oom_seq_len, peak_mib
from cs336_systems.report import tables
from cs336_systems.report.__main__ import make_tables
from cs336_systems.report.section import formula_frame
from tests.test_report import unquoted


def test_convention_is_the_benchmarks_and_fa2s():
    """FA2 §4.1: forward 4·seq²·d per head, halved if causal; backward 2.5× the forward. The benchmark
    counts with this one function (it has no count of its own)."""
    from cs336_systems.bench import flash_bench

    assert flash_bench.attention_flops is attention_math.attention_flops
    for causal in (True, False):
        forward = 4 * 3 * 100 * 100 * 64 * (0.5 if causal else 1.0)
        expected = {"forward": forward, "backward": 2.5 * forward, "forward_backward": 3.5 * forward}
        for pass_ in attention_math.PASSES:
            assert attention_flops("convention", pass_, 3, 100, 64, causal) == expected[pass_]
    assert attention_flops("convention", "forward", 1, 10, 8, False) == 4 * 10 * 10 * 8


def test_executed_products_per_provider():
    product = 2 * 1 * 64 * 64 * 16  # one 64x64x16 matrix product
    assert attention_flops("flash_triton", "backward", 1, 64, 16, True) == 7 * product / 2
    assert attention_flops("sdpa_flash", "backward", 1, 64, 16, True) == 5 * product / 2
    assert attention_flops("naive", "forward_backward", 1, 64, 16, True) == 6 * product  # no causal skipping
    assert attention_flops("flash_pytorch", "forward_backward", 1, 64, 16, True) == product + 5 * product
    with pytest.raises(ValueError, match="unknown provider 'flash_cuda'"):
        attention_flops("flash_cuda", "forward", 1, 8, 8, True)
    with pytest.raises(ValueError, match="unknown pass 'both'"):
        attention_flops("naive", "both", 1, 8, 8, True)


def test_executed_tflops_uses_the_rows_column_where_written():
    base = {"batch": 1, "seq_len": 1024, "head_dim": 64, "causal": True, "median_ms": 2.0, "status": "ok"}
    frame = pd.DataFrame([{**base, "provider": "flash_triton", "pass": "backward"},
                          {**base, "provider": "flash_triton", "pass": "forward", "executed_tflops": 9.5},
                          {**base, "provider": "naive", "pass": "forward", "status": "oom"}])
    got = executed_tflops(frame)
    assert got[0] == pytest.approx(7 * 2 * 1024**2 * 64 / 2 / 2e-3 / 1e12)
    assert got[1] == 9.5 and math.isnan(got[2])
    assert executed_tflops(frame.drop(columns="executed_tflops"))[1] == pytest.approx(
        2 * 2 * 1024**2 * 64 / 2 / 2e-3 / 1e12)


def test_out_of_memory_length_solves_the_peak_model():
    assert oom_seq_len(1.0, 0.0, 0.0, capacity_mib=300.0) == pytest.approx(10.0)  # 3·seq² = 300
    seq = oom_seq_len(3e-5, 0.03, 64.0)
    assert peak_mib(3e-5, 0.03, 64.0, seq) == pytest.approx(80 * 1024)
    assert attention_math.remainder_line([1, 2, 4], [12, 14, 18]) == pytest.approx((2.0, 10.0))
    with pytest.raises(ValueError, match="capacity 10 MiB"):
        oom_seq_len(1.0, 0.0, 20.0, capacity_mib=10)


def _attention_rows(seqs=(256, 1024, 4096), d=16, batch=8):
    """Naive attention rows whose measured memory is P + 8 (batch, seq, d) tensors + 64 MiB."""
    rows = []
    for seq in seqs:
        p = attention_math.square_mib(batch, seq)
        measured = p + 8 * attention_math.vector_mib(batch, seq, d) + 64
        for phase in ("forward", "backward"):
            rows.append({"impl": "eager", "head_dim": d, "seq_len": seq, "batch": batch, "phase": phase,
                         "status": "ok", "mean_ms": 1.0, "memory_before_backward_mib": measured,
                         "saved_for_backward_bytes": (p + 3 * attention_math.vector_mib(batch, seq, d)) * 2**20,
                         "device_name": "GPU"})
    return pd.DataFrame(rows)


def test_attention_memory_working_recovers_the_known_line():
    from cs336_systems.report.sections.attention import _memory_model

    table = tables.attention(_attention_rows())
    per_token2, slope, intercept = _memory_model(formula_frame(table), 16)  # the numbers, not their prints
    assert per_token2 == pytest.approx(8 * 4 / 2**20, rel=1e-9)
    assert slope == pytest.approx(8 * 8 * 16 * 4 / 2**20, rel=1e-9) and intercept == pytest.approx(64, rel=1e-9)
    last = len(table) - 1
    before = table.value("memory before backward (MiB)", last)
    assert table.value("backward peak, + dP and dS (MiB)", last) == before + 2 * 512
    assert table.cell_text(last, "P saved (MiB)") == "512.0"


def test_attention_section_quotes_its_table(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.attention import render_attention

    _attention_rows().to_csv(tmp_path / "attention.csv", index=False)
    make_tables(tmp_path, ["attention"])
    section = render_attention(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(section) == []
    assert any("seq ≈" in p for p in section.checked) and "pending" in section.markdown()  # no measured peak


def test_flash_correctness_counts_runs_per_test():
    frame = pd.DataFrame({"test": ["a", "a", "b", "b", "c"], "repeat": [0, 1, 0, 1, 0],
                          "outcome": ["passed", "passed", "passed", "skipped", "skipped"], "seconds": [1, 3, 2, 2, 0]})
    table = tables.flash_correctness(frame).data.set_index("test")
    assert table.loc["a", ["passed", "runs", "skipped", "seconds (median)"]].tolist() == [2, 2, 0, 2.0]
    assert table.loc["b", ["passed", "skipped"]].tolist() == [1, 1]
    assert tables.flash_correctness(frame.drop(columns="repeat")).data["runs"].tolist() == [2, 2, 1]


def _accuracy_rows(ratio: float) -> list[dict]:
    return [{"impl": "flash_triton", "reference": "sdpa_flash", "dtype": "bfloat16", "shape": "1x2x64x16",
             "causal": True, "seed": seed, "tensor": tensor, "ours_error": ratio * 4e-3, "sdpa_error": 4e-3,
             "allowed_factor": 1.1, "allowed_slack": 2e-4} for seed in range(2) for tensor in ("O", "dQ")]


def test_accuracy_verdict_and_section(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.attention import render_flash_accuracy

    assert failures(_accuracy_rows(1.1)) == []  # within 1.1x + 2e-4
    worse = failures(_accuracy_rows(1.2))  # 4.8e-3 > 4.6e-3
    assert len(worse) == 2 and "ours 4.800e-03, SDPA 4.000e-03" in worse[0]

    pd.DataFrame(_accuracy_rows(1.05)).to_csv(tmp_path / "flash_accuracy.csv", index=False)
    make_tables(tmp_path, ["flash_accuracy"])
    section = render_flash_accuracy(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(section) == [] and "1.05–1.05× SDPA's" in section.checked[0]


def test_flash_check_repeats_draw_fresh_seeds_and_failures_name_the_repeat(tmp_path):
    """Each repeat runs with its own CS336_FLASH_SEED; a test failing in one repeat fails the check."""
    from cs336_systems.bench.flash_check import flash_check_rows

    tests = tmp_path / "tests" / "test_seeded.py"
    tests.parent.mkdir()
    tests.write_text("import os\n\ndef test_seed():\n    assert os.environ['CS336_FLASH_SEED'] == '0'\n")
    with pytest.raises(SystemExit, match=r"test_seed \(repeat 1\)"):
        flash_check_rows("cpu", tests=tests, repeats=2)


def test_attention_section_quotes_a_measured_backward_peak(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.attention import render_attention

    rows = _attention_rows()
    rows["peak_memory_mib"] = rows["memory_before_backward_mib"] + 2 * 8 * rows["seq_len"] ** 2 * 4 / 2**20 + 3
    rows.to_csv(tmp_path / "attention.csv", index=False)
    make_tables(tmp_path, ["attention"])
    section = render_attention(Context(tmp_path, tmp_path, tmp_path))
    assert "measured backward peak (MiB)" in section.table.headers and unquoted(section) == []
    assert "; measured: 1619 MiB." in section.checked[1]  # 512 + 8 × 2 + 64 MiB before, + 2 × 512 + 3


def test_correctness_section_counts_repeated_runs(tmp_path):
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.attention import render_flash_correctness

    rows = [{"test": test, "repeat": r, "outcome": "passed", "seconds": 1.0 + r, "device_name": "NVIDIA H100"}
            for r in range(5) for test in ("test_a[triton-cuda]", "test_b[pytorch-cuda]")]
    pd.DataFrame(rows).to_csv(tmp_path / "flash_correctness.csv", index=False)
    make_tables(tmp_path, ["flash_correctness"])
    section = render_flash_correctness(Context(tmp_path, tmp_path, tmp_path))
    assert unquoted(section) == []
    text = section.checked[0]
    assert text.startswith("2 of 2 tests") and "in each of their 5 runs" in text and "(10 of 10 runs passed)" in text
    assert "Pending" not in text and "CPU-device cases" in text
