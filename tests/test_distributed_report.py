"""The distributed measurements' new parts (issue #20): phase timing in bench.ddp, burst all-reduces,
the rounds a comparison needs, the trace columns for the overlap question, the correctness counts, and
the report text built on them (CPU; two ranks on gloo where a collective is needed)."""

import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from cs336_systems.results import write_rows

ROOT = Path(__file__).resolve().parents[1]


# --- bench.ddp: phases, rounds -------------------------------------------------------------------------


def test_phase_clock_on_cpu_reads_host_clocks_between_marks():
    import time

    from cs336_systems.bench.ddp import PhaseClock

    clock = PhaseClock(torch.device("cpu"))
    assert clock.timer == "host_clock"
    clock.mark("start")
    time.sleep(0.02)
    clock.mark("forward_backward")
    clock.mark("communication")
    phases = clock.phases()
    assert list(phases) == ["forward_backward", "communication"]
    assert 15 < phases["forward_backward"] < 500 and 0 <= phases["communication"] < phases["forward_backward"]


def test_summarize_keeps_the_timer_the_phase_peaks_and_every_round_median():
    from cs336_systems.bench.ddp import summarize
    from cs336_systems.distributed import DataParallelSpec

    def round_(steps):
        times = {"forward_backward": steps, "communication": [1.0] * len(steps), "optimizer": [2.0] * len(steps),
                 "step": steps, "host_forward_backward": steps}
        return {"times": times, "memory": {"after_init": (1.0, 2.0), "before_step": (3.0, 5.0), "after_step": (3.0, 4.0)},
                "at_start": 0.0, "loss": 1.0, "param_bytes": 2**20, "timer": "host_clock"}

    row = summarize(DataParallelSpec.parse("individual"), [round_([10.0, 12.0, 11.0]), round_([20.0, 22.0])], 2)
    assert row["timer"] == "host_clock" and row["peak_scope"] == "phase" and row["rounds"] == 2
    assert row["step_round_medians_ms"] == "11.000 21.000"
    assert (row["step_round_median_min_ms"], row["step_round_median_max_ms"]) == (11.0, 21.0)
    assert row["step_median_ms"] == 12.0 and row["peak_before_step_mib"] == 5.0 and row["peak_after_step_mib"] == 4.0


def test_ddp_bench_on_gloo_times_phases_with_host_clocks(tmp_path):
    """Two ranks, eager: every config gets the host-clock timer, naive waits for all its communication
    after backward and `none` for none, and every round's median is listed."""
    out = tmp_path / "ddp.csv"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "cs336_systems.bench.ddp", "--backend", "gloo", "--size", "tiny", "--batch-size", "2",
                    "--context-length", "16", "--attention", "naive", "--warmup", "1", "--steps", "2", "--rounds", "2",
                    "--precisions", "fp32", "--configs", "none", "naive", "--out", str(out)],
                   check=True, capture_output=True, timeout=600, cwd=ROOT)
    rows = pd.read_csv(out).set_index("config")
    assert (rows["timer"] == "host_clock").all() and (rows["peak_scope"] == "phase").all()
    assert rows.loc["naive", "communication_ms"] > 10 * rows.loc["none", "communication_ms"]
    assert all(len(str(v).split()) == 2 for v in rows["step_round_medians_ms"])
    # the phases lie inside the step (the step's clock also covers the synchronizes around it)
    parts = rows["forward_backward_ms"] + rows["communication_ms"] + rows["optimizer_ms"]
    assert (parts <= rows["step_ms"] * 1.01).all()
    assert (rows["host_forward_backward_ms"] <= rows["forward_backward_ms"] * 1.01).all()


def test_rounds_needed_follows_the_standard_error_of_the_round_medians():
    from cs336_systems.analysis.ddp import RANGE_D2, rounds_needed

    listed = pd.DataFrame({"config": ["a", "b"], "status": "ok", "rounds": 4,
                           "step_round_medians_ms": ["100 104 98 102", "110 101 107 98"],
                           "step_median_ms": [101.0, 104.0]})
    need = rounds_needed(listed)
    sa, sb = statistics.stdev([100, 104, 98, 102]), statistics.stdev([110, 101, 107, 98])
    assert need["sigma_ms"] == pytest.approx((sa, sb))
    assert need["rounds"] == math.ceil((2 * math.hypot(sa, sb) / (0.05 * 102.5)) ** 2)
    ranged = listed.drop(columns="step_round_medians_ms").assign(step_round_median_min_ms=[98.0, 98.0],
                                                                 step_round_median_max_ms=[104.0, 110.0])
    assert rounds_needed(ranged)["sigma_ms"] == pytest.approx((6 / RANGE_D2[4], 12 / RANGE_D2[4]))


def test_config_runs_at_least_the_rounds_the_committed_spread_needs():
    from cs336_systems.analysis.ddp import rounds_needed
    from cs336_systems.report.ddp_analysis import SPREAD

    need = rounds_needed(pd.read_csv(ROOT / "results" / f"{SPREAD}.csv"))["rounds"]
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert config["scales"]["full"]["ddp"]["rounds"] >= need > 2
    full = config["scales"]["full"]["ddp"]["configs"]
    assert all({"none", "torch_ddp"} <= set(configs) for configs in full.values()), full


def test_committed_spread_is_what_rule_ddp_spread_runs():
    """results/ddp_spread.csv's rows carry the arguments config.yaml gives rule ddp_spread at full scale."""
    spread = pd.read_csv(ROOT / "results" / "ddp_spread.csv")
    ddp = yaml.safe_load((ROOT / "config.yaml").read_text())["scales"]["full"]["ddp"]
    assert spread["config"].tolist() == ddp["spread"]["configs"]
    assert (spread["precision"] == ddp["spread"]["precision"]).all()
    assert (spread["rounds"] == ddp["spread"]["rounds"]).all()
    arguments = {"world_size": "world_size", "backend": "backend", "size": "size", "batch_per_rank": "batch_size",
                 "context_length": "context_length", "attention": "attention", "warmup": "warmup", "steps": "steps",
                 "compile": "compile", "adamw": "adamw"}
    for column, key in arguments.items():
        assert (spread[column] == ddp[key]).all(), (column, spread[column].tolist(), ddp[key])


# --- all-reduce bursts and the per-call cost --------------------------------------------------------------


def _burst_rank(rank: int, world_size: int, out: str) -> None:
    from cs336_systems.bench import allreduce

    rows = allreduce.measure(["all_reduce"], [0.01, 0.1], warmup=1, iters=2, backend="gloo",
                             device=torch.device("cpu"), burst=4)
    if rank == 0:
        write_rows(rows, out)


def test_burst_mode_times_back_to_back_async_all_reduces(tmp_path):
    from tests.distributed_helpers import run_distributed

    out = tmp_path / "burst.csv"
    run_distributed(_burst_rank, 2, str(out))
    rows = pd.read_csv(out)
    assert rows["mode"].tolist() == ["burst", "burst"] and (rows["burst"] == 4).all()
    assert (rows["status"] == "ok").all() and (rows["median_ms"] > 0).all()


def _collective_rows(mode, o, w, sizes_mb=(0.01, 1, 10, 100)):
    return pd.DataFrame({"op": "all_reduce", "backend": "nccl", "device_type": "cuda", "world_size": 2,
                         "size_mb": list(sizes_mb), "mode": mode, "status": "ok",
                         "median_ms": [(o + mb * 2**20 / w) * 1e3 for mb in sizes_mb]})


def test_burst_rows_give_the_per_call_cost_and_stay_out_of_the_ring_model():
    from cs336_systems.analysis.collectives import all_reduce_rows, fit_ring_model
    from cs336_systems.analysis.ddp import allreduce_burst_cost, allreduce_cost
    from cs336_systems.report.ddp_analysis import bucket_model

    frame = pd.concat([_collective_rows("single", 90e-6, 320e9), _collective_rows("burst", 20e-6, 340e9)])
    assert allreduce_cost(frame) == pytest.approx((90e-6, 320e9), rel=1e-6)
    assert allreduce_burst_cost(frame) == pytest.approx((20e-6, 340e9), rel=1e-6)
    assert (all_reduce_rows(frame)["mode"] == "single").all()
    assert fit_ring_model(frame)["sizes"].tolist() == [4]
    assert allreduce_burst_cost(frame.drop(columns="mode")) is None  # files written before bursts
    text = bucket_model(frame, 2**30)
    assert f"b\\* = {math.sqrt(2**30 * 340e9 * 20e-6) / 2**20:.0f} MiB" in text


def test_allreduce_section_names_the_missing_nccl_process_counts():
    from cs336_systems.report.sections.distributed import missing_world_sizes

    table = pd.DataFrame({"backend": ["gloo"] * 3 + ["nccl"], "processes": [2, 4, 6, 2]})
    text = missing_world_sizes(table)
    assert "NCCL with 4 and 6 processes" in text and "`[2, 4, 6]`" in text and "gpu=6" in text
    assert missing_world_sizes(table.assign(backend="nccl")) == ""


# --- traces: the columns that answer the overlap question -----------------------------------------------


def test_trace_row_sums_compute_kernels_and_the_tail_after_backward():
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 100, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 120, "dur": 40},  # overlaps gemm_a: summed, not merged
        {"ph": "X", "cat": "kernel", "name": "gemm_c", "ts": 250, "dur": 10},  # after backward
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 170, "dur": 60},  # 30 µs after backward
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 150, "dur": 8},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 160, "dur": 4},
    ]
    row = traces.trace_row("x", events, traces.lanes(events))
    assert row["compute_kernel_ms_in_backward"] == pytest.approx(0.080)
    assert row["compute_kernel_ms"] == pytest.approx(0.090)
    assert row["comm_after_backward_ms"] == pytest.approx(0.030)
    assert row["host_ms_per_collective"] == pytest.approx(0.006)
    assert row["exposed_communication_ms"] == pytest.approx(0.060)  # no compute kernel runs in 170..230


def test_trace_cli_accepts_a_baseline_without_communication_only(tmp_path):
    import json

    from cs336_systems.report import traces

    events = {"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 0, "dur": 50},
                              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 40}]}
    for name in ("none_bf16", "naive_bf16"):
        (tmp_path / f"{name}.json").write_text(json.dumps(events))
    traces.main([str(tmp_path / "none_bf16.json"), "--figures-dir", str(tmp_path), "--out", str(tmp_path / "o.csv")])
    assert pd.read_csv(tmp_path / "o.csv")["communication_ms"].tolist() == [0]
    with pytest.raises(SystemExit, match="no communication"):
        traces.main([str(tmp_path / "naive_bf16.json"), "--figures-dir", str(tmp_path), "--out", str(tmp_path / "p.csv")])


# --- correctness counts ---------------------------------------------------------------------------------


def test_correctness_counts_from_junit_reports(tmp_path):
    from cs336_systems.bench.ddp_correctness import count, outcomes

    report = tmp_path / "junit.xml"
    report.write_text("""<testsuites><testsuite>
        <testcase classname="tests.test_ddp" name="test_a[naive]"/>
        <testcase classname="tests.test_ddp" name="test_a[flat]"><failure message="x"/></testcase>
        <testcase classname="tests.test_ddp" name="test_b"><skipped/></testcase>
        <testcase classname="tests.test_ddp" name="test_c"><error message="y"/></testcase>
        </testsuite></testsuites>""")
    found = outcomes(report)
    assert found == {"test_ddp::test_a[naive]": "passed", "test_ddp::test_a[flat]": "failed",
                     "test_ddp::test_b": "skipped", "test_ddp::test_c": "failed"}
    rows = {r["test"]: r for r in count([(1, found), (2, {**found, "test_ddp::test_a[flat]": "passed"})])}
    assert rows["test_ddp::test_a[flat]"] == {"test": "test_ddp::test_a[flat]", "runs": 2, "passed": 1, "failed": 1,
                                              "skipped": 0, "seed_shifts": "1 2"}


def test_seed_shift_changes_the_tests_draws(monkeypatch):
    from tests.distributed_helpers import seed

    monkeypatch.delenv("CS336_TEST_SEED", raising=False)
    assert seed(7) == 7
    monkeypatch.setenv("CS336_TEST_SEED", "3")
    assert seed(7) != 7 and seed(7) != seed(8)


# --- the report on rows of the new bench ----------------------------------------------------------------


@pytest.fixture
def rerun_results(tmp_path):
    """The committed DDP results as the rerun will write them: compute-stream timer, phase peaks."""
    for name in ("ddp_naive", "ddp_individual", "ddp_bucketed", "sharding", "allreduce"):
        frame = pd.read_csv(ROOT / "results" / f"{name}.csv")
        if name != "allreduce":
            frame = frame.assign(timer="cuda_events", peak_scope="phase")
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
    shutil.copy(ROOT / "results" / "ddp_spread.csv", tmp_path)
    return tmp_path


def test_report_reads_the_rerun_columns(rerun_results):
    from cs336_systems.report.__main__ import make_tables
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.distributed import render_ddp_individual, render_ddp_naive
    from cs336_systems.report.sections.sharding import render_sharding
    from tests.test_report import unquoted

    make_tables(rerun_results, ["ddp_naive", "ddp_individual", "sharding"])  # as the `table` rule does
    ctx = Context(rerun_results, rerun_results, rerun_results)
    for render in (render_ddp_naive, render_ddp_individual, render_sharding):
        body = render(ctx)
        assert unquoted(body) == [], render.__name__
        text = body.markdown()
        assert "predate" not in text, render.__name__
    assert "CUDA events on the compute stream" in render_ddp_naive(ctx).markdown()
    assert "The optimizer step's own peak" in render_sharding(ctx).markdown()


def test_committed_rows_say_what_waits_for_the_rerun():
    from cs336_systems.report.section import Context
    from cs336_systems.report.ddp_analysis import RERUN
    from cs336_systems.report.sections.distributed import render_ddp_bucketed, render_ddp_naive
    from cs336_systems.report.sections.sharding import render_sharding

    ctx = Context(ROOT / "results", ROOT / "figures", ROOT / "results")
    naive, bucketed, sharding = (render(ctx).markdown() for render in (render_ddp_naive, render_ddp_bucketed,
                                                                       render_sharding))
    assert "predate the compute-stream events" in naive and RERUN in naive
    assert "Why does torch DDP hide almost nothing in fp32?" in naive
    assert "How many rounds" in naive
    assert "predate resetting the peak" in sharding
    # one statistic in the DDP tables, their figure and prose: means (the step's parts add up to it)
    assert "its mean step" in bucketed and "Expectations against results" in bucketed
    assert not np.any(["median" in p for p in bucketed.split("\n\n") if p.startswith("bf16: the best")])
