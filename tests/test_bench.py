"""The benchmarking harness on CPU: every mode runs, OOM becomes a row, bad input is a clear error.

One file for every bench CLI (a little over 400 lines): they share the fixtures and the CPU-sized
settings, and each CLI's tests stay a few functions long."""

import dataclasses
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cs336_systems.bench import (allreduce, attention_sweep, e2e, flash_bench, flash_check, memory,
                                  mixed_precision, profile)
from cs336_systems.results import read_rows, read_table, write_rows
from cs336_systems.timing import oom_row
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--context-length", "16", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--device", "cpu"]


def test_a_cut_run_keeps_earlier_results_and_its_finished_points(tmp_path, monkeypatch):
    """A sweep that dies half-way leaves the earlier results file as it was and the points it finished in
    OUT.partial; a complete run writes OUT and removes the partial file."""
    out = tmp_path / "rows.csv"
    write_rows([{"earlier": 1}], out)
    real_run, calls = e2e.run, []

    def dies_on_the_second_point(spec):
        calls.append(spec)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal amounts to
        return real_run(spec)

    monkeypatch.setattr(e2e, "run", dies_on_the_second_point)
    with pytest.raises(KeyboardInterrupt):
        e2e.main(["--sizes", "tiny", "--modes", "forward", "forward_backward", "--out", str(out), *COMMON])
    assert pd.read_csv(out).to_dict("records") == [{"earlier": 1}]
    finished = pd.read_csv(tmp_path / "rows.csv.partial")
    assert set(finished["mode"]) == {"forward"} and (finished["status"] == "ok").all()
    monkeypatch.setattr(e2e, "run", real_run)
    e2e.main(["--sizes", "tiny", "--modes", "forward", "--out", str(out), *COMMON])
    assert set(pd.read_csv(out)["mode"]) == {"forward"} and not (tmp_path / "rows.csv.partial").exists()


@pytest.mark.parametrize("mode,phases", [("forward", {"forward"}), ("forward_backward", {"forward", "backward"}),
                                         ("train_step", {"forward", "backward", "optimizer"})])
def test_each_mode_runs_on_cpu(tmp_path, mode, phases):
    out = tmp_path / "rows.csv"
    e2e.main(["--sizes", "tiny", "--modes", mode, "--out", str(out), *COMMON])
    rows = pd.read_csv(out)
    assert set(rows["phase"]) == phases | {"step"}
    assert (rows["status"] == "ok").all()
    assert (rows["n"] == 2).all() and (rows["mean_ms"] > 0).all()
    step = rows[rows["phase"] == "step"].iloc[0]
    parts = rows[rows["phase"] != "step"]["mean_ms"].sum()
    assert step["mean_ms"] == pytest.approx(parts)
    assert step["tokens_per_s"] > 0
    for column in ("device_name", "torch_version", "triton_version", "git_commit", "timestamp"):
        assert isinstance(step[column], str) and step[column]


def test_train_step_optimizers_change_parameters_alike(kernel_device):
    """Our two AdamW paths and torch's fused AdamW each update the model, and to the same values (on
    the device our fused one runs on in this session)."""
    spec = e2e.RunSpec(size="tiny", mode="train_step", precision="fp32", attention="naive",
                       batch_size=2, context_length=8, warmup=0, steps=1, device=kernel_device)
    torch.manual_seed(0)
    before = e2e.build_model(spec, torch.device(kernel_device)).state_dict()
    original = e2e.build_model
    after = {}
    for optimizer in ADAMW_IMPLEMENTATIONS:
        def keep(spec_, device):
            after[spec_.optimizer] = original(spec_, device)
            return after[spec_.optimizer]

        e2e.build_model = keep
        try:
            e2e.measure(dataclasses.replace(spec, optimizer=optimizer))
        finally:
            e2e.build_model = original
    states = {name: model.state_dict() for name, model in after.items()}
    assert any(not torch.equal(before[k], states["foreach"][k]) for k in before)
    for name in ("fused", "torch_fused"):
        for key in before:
            torch.testing.assert_close(states[name][key], states["foreach"][key], rtol=1e-5, atol=1e-6)


def test_optimizer_and_compile_scope_grids():
    grid = dict(sizes=("tiny",), context_length=16, batch_size=2, steps=2, device="cpu")
    specs = e2e.Sweep(**grid, modes=("forward", "train_step"), optimizers=("foreach", "torch_fused")).specs()
    assert [(s.mode, s.optimizer) for s in specs] == [("forward", "none"), ("train_step", "foreach"),
                                                      ("train_step", "torch_fused")]
    specs = e2e.Sweep(**grid, compile_scopes=("none", "blocks", "model")).specs()
    assert [s.compile_scope for s in specs] == ["none", "blocks", "model"]
    with pytest.raises(ValueError, match="'sgd'"):
        e2e.make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="unknown compile scope 'layers'"):
        e2e.Sweep(**grid, compile_scopes=("layers",))
    with pytest.raises(ValueError, match="rounds"):
        e2e.Sweep(**grid, rounds=0)


def test_compile_columns_keep_the_committed_layout(tmp_path, monkeypatch):
    """Rows carry `compile` (a bool, false for eager) beside `compile_scope`, in the column order of the
    committed results files that the report reads."""
    monkeypatch.setattr(e2e, "measure", lambda spec: {"forward": [1.0, 3.0]})  # the layout, not the timing
    out = tmp_path / "rows.csv"
    e2e.main(["--sizes", "tiny", "--modes", "forward", "--compile-scopes", "none", "blocks", "--out", str(out),
              *COMMON])
    rows = pd.read_csv(out)
    assert rows.drop_duplicates("compile_scope")[["compile", "compile_scope"]].values.tolist() == [
        [False, "none"], [True, "blocks"]]
    committed = pd.read_csv(ROOT / "results" / "e2e_compile.csv", nrows=0).columns
    shared = [c for c in rows.columns if c in committed]
    assert shared == [c for c in committed if c in rows.columns] and len(shared) == len(committed)


def test_out_of_memory_becomes_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real_measure = e2e.measure

    def measure(spec):
        if spec.size == "mini":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_measure(spec)

    monkeypatch.setattr(e2e, "measure", measure)
    out = tmp_path / "rows.csv"
    e2e.main(["--sizes", "mini", "tiny", "--out", str(out), *COMMON])
    rows = pd.read_csv(out)
    oom = rows[rows["size"] == "mini"]
    assert len(oom) == 1 and oom["status"].iloc[0] == "oom" and "out of memory" in oom["error"].iloc[0]
    assert (rows[rows["size"] == "tiny"]["status"] == "ok").all()


OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_oom_row_reads_the_same_everywhere():
    row = oom_row({"size": "xl", "phase": "step"}, OOM)
    assert row == {"size": "xl", "phase": "step", "status": "oom",
                   "error": "CUDA out of memory. Tried to allocate 20.00 GiB"}
    assert oom_row({}, RuntimeError("CUDA error: out of memory\nmore"), message_column="note") == {
        "status": "oom", "note": "CUDA error: out of memory"}
    with pytest.raises(ValueError, match="not an out-of-memory error: RuntimeError: shape mismatch"):
        oom_row({}, RuntimeError("shape mismatch"))


def _raise_oom(*args, **kwargs):
    raise OOM


def test_attention_sweep_records_oom_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_sweep, "measure", _raise_oom)
    out = tmp_path / "rows.csv"
    attention_sweep.main(["--head-dims", "16", "--seqs", "32", "--batch-size", "2", "--iters", "1", "--device", "cpu",
                          "--out", str(out)])
    rows = pd.read_csv(out)
    assert rows["phase"].tolist() == ["forward", "backward"] and (rows["status"] == "oom").all()
    assert rows["error"].str.contains("out of memory").all()


def test_flash_sweep_records_oom_rows(monkeypatch):
    monkeypatch.setattr(flash_bench, "time_passes", _raise_oom)
    config = flash_bench.SweepConfig(seqs=(32,), head_dims=(16,), dtypes=("fp32",), providers=("naive",),
                                     device="cpu")
    (rows,) = list(flash_bench.sweep(config))
    assert [r["pass"] for r in rows] == ["forward", "backward", "forward_backward"]
    assert all(r["status"] == "oom" and "out of memory" in r["note"] for r in rows)


def test_llm_shapes_interleaves_the_providers_and_takes_the_median_round(monkeypatch):
    """The providers of a point take turns, round after round, on the same inputs; a row is the median of its
    rounds with their spread; a provider that runs out of memory in a later round gives oom rows and the others
    go on."""
    calls, times = [], iter([3.0, 30.0, 9.0, 90.0, 1.0, 10.0, 5.0, 50.0, 2.0, 20.0, 7.0, 70.0])

    def fake_bench(fn, device, warmup_ms, rep_ms, grad_to_none=None, min_calls=1):
        calls.append((fn.__qualname__.split(".")[-1], tuple(id(t) for t in grad_to_none), rep_ms, min_calls))
        return next(times)

    monkeypatch.setattr(flash_bench, "bench_ms", fake_bench)
    config = flash_bench.LlmShapesConfig(batch_heads=(2,), seqs=(16,), head_dims=(16,), causal=(True,),
                                         providers=("naive", "flash_pytorch"), rep_ms=30, rounds=3, device="cpu")
    rows = [row for rows in flash_bench.llm_shapes(config) for row in rows]
    assert [c[0] for c in calls] == ["forward", "both"] * 6 and len({c[1] for c in calls}) == 1  # the same q, k, v
    assert {(c[2], c[3]) for c in calls} == {(10.0, 4)}  # rep_ms and MIN_CALLS shared out over the rounds
    got = {(r["provider"], r["pass"]): r for r in rows}
    assert got["naive", "forward"]["median_ms"] == 2.0 and got["naive", "forward"]["spread"] == pytest.approx(1.0)
    assert got["flash_pytorch", "forward_backward"]["median_ms"] == 70.0
    assert got["flash_pytorch", "forward_backward"]["spread"] == pytest.approx(40 / 70)
    assert all(r["rounds"] == 3 and r["min_calls"] == 12 for r in rows)

    calls.clear()
    times = iter([1.0, 2.0, 3.0, 4.0])

    def oom_in_round_two(fn, device, warmup_ms, rep_ms, grad_to_none=None, min_calls=1):
        calls.append(fn)
        if len(calls) == 5:  # the first provider's second round
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return next(times, 5.0)

    monkeypatch.setattr(flash_bench, "bench_ms", oom_in_round_two)
    rows = [row for rows in flash_bench.llm_shapes(config) for row in rows]
    got = {(r["provider"], r["pass"]): r for r in rows}
    assert got["naive", "forward"]["status"] == "oom" and "out of memory" in got["naive", "forward"]["note"]
    assert got["flash_pytorch", "forward"]["status"] == "ok" and len(calls) == 9  # it ran all three rounds


def test_llm_shapes_hands_do_in_the_models_layout(monkeypatch):
    """dO reaches the providers laid out as q, k, v are ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)),
    as a model's layers hand it back, and the rows say so."""
    seen = []

    def probe(q, k, v, is_causal):
        out = q + k + v
        if out.requires_grad:
            out.register_hook(lambda grad: seen.append((grad.stride(), q.stride())))
        return out

    monkeypatch.setitem(flash_bench.ATTENTION_BACKENDS, "probe", probe)
    monkeypatch.setattr(flash_bench, "bench_ms", lambda fn, *args, **kwargs: (fn(), 1.0)[1])
    config = flash_bench.LlmShapesConfig(batch_heads=(6,), seqs=(5,), head_dims=(4,), causal=(True,),
                                         providers=("probe",), rounds=1, device="cpu")
    rows = [row for rows in flash_bench.llm_shapes(config) for row in rows]
    assert seen and all(do_stride == q_stride for do_stride, q_stride in seen)
    assert seen[0][0] != torch.empty(1, 6, 5, 4).stride()  # not contiguous: the layout is the model's
    assert {r["do_layout"] for r in rows} == {"model"}


def test_llm_shapes_compiles_each_point_afresh_with_static_shapes(monkeypatch):
    """A NAME_compiled provider is compiled for its point alone (dynamic=False, Dynamo reset before), as a model at
    one shape is, and times that compiled call; the eager providers time their backend as it is."""
    compiled, timed, resets = [], [], []
    real_compile = torch.compile

    def recording_compile(fn, **kwargs):
        made = real_compile(fn, **kwargs)
        compiled.append((fn, kwargs, made))
        return made

    monkeypatch.setattr(flash_bench.torch, "compile", recording_compile)
    monkeypatch.setattr(flash_bench.torch._dynamo, "reset", lambda: resets.append(len(compiled)))
    def time_round(fn, *args):
        timed.append(fn)
        for times in args[-1].values():  # `into`: the provider's times per pass
            times.append(1.0)

    monkeypatch.setattr(flash_bench, "_time_round", time_round)
    config = flash_bench.LlmShapesConfig(batch_heads=(2,), seqs=(16, 32), head_dims=(16,), causal=(True,),
                                         providers=("naive", "naive_compiled"), rounds=2, device="cpu")
    rows = [row for rows in flash_bench.llm_shapes(config) for row in rows]
    naive = flash_bench.get_attention("naive")
    assert [(fn, kwargs) for fn, kwargs, _ in compiled] == [(naive, {"dynamic": False})] * 2  # one per point
    assert resets == [0, 1]  # before each point's compile
    first, second = (made for *_, made in compiled)
    assert timed == [naive, first, naive, first, naive, second, naive, second]
    assert {r["compiled_for"] for r in rows if r["provider"] == "naive_compiled"} == {"point"}
    assert all("compiled_for" not in r for r in rows if r["provider"] == "naive")


def test_profile_records_an_oom_row(monkeypatch):
    monkeypatch.setattr(profile, "profile_point", _raise_oom)
    rows = profile.profile_rows(profile.ProfileConfig(sizes=("tiny",), context_lengths=(16,), device="cpu",
                                                      tool="torch"))
    assert len(rows) == 1 and rows[0]["kind"] == "point" and rows[0]["status"] == "oom"


@pytest.mark.parametrize("module,argv,message", [
    (attention_sweep, ["--seqs", "0"], "must be a positive integer, got 0"),
    (attention_sweep, ["--warmup", "-2"], "must be >= 0, got -2"),
    (attention_sweep, ["--impls", "jit"], "invalid choice: 'jit'"),
    (flash_bench, ["sweep", "--head-dims", "-16"], "must be a positive integer, got -16"),
    (flash_bench, ["leaderboard", "--rep-ms", "0"], "must be a positive integer, got 0"),
    (flash_bench, ["first-call"], "it needs --device cuda, not 'cpu'"),
    (profile, ["--sizes", "huge"], "unknown model size 'huge'"),
    (profile, ["--sizes", "tiny", "--context-lengths", "4096"], "context length 4096 exceeds"),
    (profile, ["--warmup", "-1"], "must be >= 0, got -1"),
])
def test_other_clis_name_the_bad_value(tmp_path, capsys, module, argv, message):
    with pytest.raises(SystemExit):
        module.main([*argv, "--device", "cpu", "--out", str(tmp_path / "x.csv")])
    assert message in capsys.readouterr().err


def test_allreduce_and_mixed_precision_write_their_rows(tmp_path, monkeypatch):
    """A one-process gloo group runs the all-reduce timing end to end; the handout's 1.1.5 experiments
    run on the CPU (with CPU autocast)."""
    import socket

    with socket.socket() as probe:  # a free port for the process group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "allreduce.csv"
    allreduce.main(["--backend", "gloo", "--sizes-mb", "0.01", "0.1", "--warmup", "0", "--iters", "2",
                    "--out", str(out)])
    rows = pd.read_csv(out)
    assert rows["size_mb"].tolist() == [0.01, 0.1] and (rows["world_size"] == 1).all()
    assert (rows["median_ms"] > 0).all() and (rows["status"] == "ok").all()
    out = tmp_path / "mixed.csv"
    mixed_precision.main(["--device", "cpu", "--out", str(out)])
    rows = pd.read_csv(out)
    loops = rows[rows["kind"] == "accumulation"].set_index("item")["value"]
    assert loops["fp32 += fp32"] == pytest.approx(10.0, abs=1e-3) and abs(loops["fp16 += fp16"] - 10) > 0.01


@pytest.mark.parametrize("module,argv,message", [
    (allreduce, ["--backend", "gloo", "--iters", "0"], "must be a positive integer, got 0"),
    (allreduce, ["--backend", "gloo", "--sizes-mb", "1", "0"], "must be positive, got 0"),
    (allreduce, ["--backend", "mpi"], "invalid choice: 'mpi'"),
    (flash_check, ["--workers", "0"], "must be a positive integer, got 0"),
    (memory, ["--snapshot-dir", "snaps", "--size", "huge", "--device", "cpu"], "unknown model size 'huge'"),
    (memory, ["--snapshot-dir", "snaps", "--device", "cpu"], "memory snapshots need a CUDA device, got device 'cpu'"),
])
def test_distributed_and_check_clis_name_the_bad_value(tmp_path, capsys, module, argv, message):
    with pytest.raises(SystemExit):
        module.main([*argv, "--out", str(tmp_path / "x.csv")])
    assert message in capsys.readouterr().err


CLIS = ["e2e", "profile", "memory", "mixed_precision", "attention_sweep", "flash_bench", "flash_check",
        "kernel_resources", "allreduce", "merge"]  # bench.ddp joins once its flags have help text


@pytest.mark.parametrize("name", CLIS)
def test_every_flag_has_help_text(name, monkeypatch):
    """Each command line's parser, caught as it parses: every option and positional says what it is for.
    argparse lists a parser's arguments only in its `_actions` (there is no public accessor)."""
    import argparse
    import importlib

    parsers = []

    def catch(parser, *args, **kwargs):
        parsers.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        importlib.import_module(f"cs336_systems.bench.{name}").main([])
    (parser,) = parsers
    undocumented, pending = [], [parser]
    while pending:
        for action in pending.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += list(action.choices.values())
            elif not action.help and not isinstance(action, argparse._HelpAction):
                undocumented.append(action.option_strings or action.dest)
    assert not undocumented


def test_other_errors_are_not_swallowed(monkeypatch, tmp_path):
    monkeypatch.setattr(e2e, "measure", lambda spec: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        e2e.main(["--sizes", "tiny", "--out", str(tmp_path / "x.csv"), *COMMON])


@pytest.mark.parametrize("args,message", [
    (["--sizes", "huge"], "unknown model size 'huge'"),
    (["--steps", "0"], "must be a positive integer, got 0"),
    (["--warmup", "-1"], "must be >= 0, got -1"),
    (["--context-length", "4096"], "context length 4096 exceeds the 1024 tokens size 'tiny' supports"),
    (["--batch-size", "0"], "must be a positive integer, got 0"),
    (["--compile-scopes", "layers"], "invalid choice: 'layers'"),
    (["--precisions", "fp8"], "unknown precision 'fp8'"),
    (["--attention", "magic"], "argument --attention: invalid choice: 'magic'"),  # the registry's names
])
def test_bad_arguments_name_the_value(tmp_path, capsys, args, message):
    argv = ["--sizes", "tiny", "--device", "cpu", "--out", str(tmp_path / "x.csv"), *args]
    with pytest.raises(SystemExit):
        e2e.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no GPU")
def test_gpu_requested_without_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--sizes", "tiny", "--device", "cuda", "--out", str(tmp_path / "x.csv")])
    assert "device 'cuda' was requested but CUDA is not available" in capsys.readouterr().err


def test_memory_snapshot_needs_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--sizes", "tiny", "--device", "cpu", "--memory-snapshot", "x.pickle",
                  "--out", str(tmp_path / "x.csv")])
    assert "memory snapshot needs a CUDA device, got device 'cpu'" in capsys.readouterr().err


def test_interrupted_write_keeps_the_earlier_result(tmp_path, monkeypatch):
    path = tmp_path / "result.csv"
    write_rows([{"a": 1}], path)
    monkeypatch.setattr(pd.DataFrame, "to_csv", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_rows([{"a": 2}], path)
    monkeypatch.undo()
    assert pd.read_csv(path)["a"].tolist() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["result.csv"]  # no temporary left behind


def _nsys_database(path):
    """A small database laid out like `nsys export --type sqlite`: a forward window with an attention
    stage, a backward window whose kernels were launched from another thread, and warm-up work
    outside any window. Times in ns."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, correlationId INT, demangledName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, correlationId INT, globalTid INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, text TEXT, textId INT, globalTid INT, eventType INT);
        INSERT INTO StringIds VALUES (1, 'gemm'), (2, 'softmax_warp_forward'), (3, 'measured:backward');
    """)
    ranges = [(1000, 9000, "measured:forward", None), (1500, 2000, "softmax", None),
              (10000, 20000, None, 3), (0, 500, "forward", None)]
    db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, 1, 59)", ranges)
    kernels = [(1100, 2100, 1, 1),    # forward, launched before the softmax range
               (2100, 3100, 2, 2),    # forward, launched inside softmax but running after it closed
               (11000, 15000, 3, 1),  # backward, launched by the autograd thread
               (100, 400, 4, 1)]      # warm-up: outside every window
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?)", kernels)
    launches = [(1050, 1060, 1, 1), (1600, 1610, 2, 1), (10500, 10510, 3, 2), (90, 95, 4, 1)]
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?)", launches)
    db.commit()
    db.close()


def test_nsys_report_is_summarized_by_window_and_launch(tmp_path):
    from cs336_systems.bench import nsys

    _nsys_database(tmp_path / "report.sqlite")
    kernels, ranges = nsys.read_report(tmp_path / "report.sqlite")
    assert set(ranges["name"]) == {"measured:forward", "softmax", "measured:backward", "forward"}
    rows = pd.DataFrame(nsys.summarize_report(kernels, ranges, steps=1, stages=("scores", "softmax")))
    kernel_ms = rows[rows["kind"] == "kernel"].set_index(["phase", "name"])["ms_per_step"].to_dict()
    assert kernel_ms == {("forward", "gemm"): pytest.approx(1e-3), ("forward", "softmax_warp_forward"):
                         pytest.approx(1e-3), ("backward", "gemm"): pytest.approx(4e-3)}
    stage = rows[rows["kind"] == "attention_stage"].set_index(["phase", "name"])
    assert list(stage.index) == [("forward", "softmax")]
    assert stage.loc[("forward", "softmax"), "ms_per_step"] == pytest.approx(1e-3)
    assert stage.loc[("forward", "softmax"), "calls_per_step"] == 1
    assert set(rows["tool"]) == {nsys.TOOL}


def test_profile_tool_choice_and_nsys_child_rows(tmp_path):
    out = tmp_path / "child.csv"
    args = ["--sizes", "tiny", "--context-lengths", "16", "--batch-size", "2", "--warmup", "1", "--steps", "1",
            "--device", "cpu"]
    profile.main([*args, "--nsys-child", "--out", str(out)])
    rows = pd.read_csv(out)
    assert set(rows["kind"]) == {"harness"}  # the kernels come from the parent's reading of the report
    assert set(rows["phase"]) == {"forward", "backward", "optimizer", "inference"}
    with pytest.raises(SystemExit):
        profile.main([*args, "--tool", "nsys", "--out", str(out)])  # no CUDA (and no nsys) here


@pytest.mark.parametrize("scope", e2e.COMPILE_SCOPES)
def test_compile_scope_decides_what_is_compiled(scope):
    spec = e2e.RunSpec(size="tiny", mode="forward", precision="fp32", attention="naive",
                       batch_size=2, context_length=8, warmup=0, steps=1, device="cpu", compile_scope=scope)
    model = e2e.build_model(spec, torch.device("cpu"))
    whole = getattr(model, "_compiled_call_impl", None) is not None
    blocks = [getattr(layer, "_compiled_call_impl", None) is not None for layer in model.layers]
    assert whole == scope.startswith("model")
    assert all(blocks) == (scope == "blocks") and any(blocks) == (scope == "blocks")
    with pytest.raises(ValueError, match="'layers'"):
        e2e.build_model(dataclasses.replace(spec, compile_scope="layers"), torch.device("cpu"))


# --- the collective bench (all-reduce, all-gather, reduce-scatter) on gloo with two ranks ---


def _collectives_rank(rank: int, world_size: int, out: str, out_unsupported: str) -> None:
    import torch.distributed as dist

    from cs336_systems.bench import allreduce

    def measure(ops):
        rows = allreduce.measure(ops, [0.001, 0.01], warmup=1, iters=2, backend="gloo", device=torch.device("cpu"))
        assert (rows == []) == (rank != 0)
        return rows

    rows = measure(list(allreduce.OPS))

    def unsupported(*args, **kwargs):  # what a backend without the op does: raise on every rank at once
        raise RuntimeError("reduce_scatter is not supported by this backend")

    dist.reduce_scatter_tensor = unsupported
    rows_unsupported = measure(["reduce_scatter", "all_reduce"])
    if rank == 0:
        write_rows(rows, out)
        write_rows(rows_unsupported, out_unsupported)


def test_collective_bench_times_each_op_and_records_unsupported_ones(tmp_path):
    """One spawn (starting ranks is the slow part): all three ops, then reduce-scatter made unsupported."""
    from cs336_systems.analysis.collectives import ring_factor
    from tests.distributed_helpers import run_distributed

    out, out_unsupported = tmp_path / "collectives.csv", tmp_path / "unsupported.csv"
    run_distributed(_collectives_rank, 2, str(out), str(out_unsupported))
    rows = pd.read_csv(out)
    assert sorted(rows["op"]) == ["all_gather"] * 2 + ["all_reduce"] * 2 + ["reduce_scatter"] * 2
    assert (rows["world_size"] == 2).all() and (rows["status"] == "ok").all() and (rows["median_ms"] > 0).all()
    factors = np.array([ring_factor(op, 2) for op in rows["op"]])
    np.testing.assert_allclose(rows["busbw_gbps"], rows["algbw_gbps"] * factors)
    np.testing.assert_allclose(factors, np.where(rows["op"] == "all_reduce", 1.0, 0.5))
    after = pd.read_csv(out_unsupported)
    expected = [("reduce_scatter", "unsupported")] * 2 + [("all_reduce", "ok")] * 2
    assert list(zip(after["op"], after["status"])) == expected
    assert after["error"].iloc[0] == "reduce_scatter is not supported by this backend"


def test_collective_bench_rejects_bad_input(tmp_path):
    from cs336_systems.analysis.collectives import ring_factor
    from cs336_systems.bench import allreduce

    with pytest.raises(SystemExit):
        allreduce.main(["--backend", "gloo", "--sizes-mb", "-1", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(SystemExit):
        allreduce.main(["--backend", "gloo", "--ops", "broadcast", "--out", str(tmp_path / "x.csv")])
    with pytest.raises(ValueError, match="broadcast"):
        ring_factor("broadcast", 2)


@pytest.mark.parametrize("size", ["small", "medium", "large", "xl", "2.7B"])
def test_plain_baseline_has_our_parameter_count(size):
    from cs336_systems.bench.plain_model import PlainTransformerLM, plain_state_dict
    from cs336_systems.model import TransformerLM, get_config
    from cs336_systems.model.accounting import parameter_count

    config = get_config(size)
    with torch.device("meta"):  # no memory: only the shapes are compared
        plain, ours = PlainTransformerLM(config), TransformerLM(config)
    assert sum(p.numel() for p in plain.parameters()) == parameter_count(config)
    # the same tensors once q, k and v are stacked into the baseline's fused projection
    ours_as_plain = plain_state_dict(dict(ours.named_parameters()))
    assert {n: p.shape for n, p in plain.named_parameters()} == {n: p.shape for n, p in ours_as_plain.items()}


def test_plain_baseline_computes_our_model_from_the_same_weights():
    """Same weights in, same logits out (float64, causal, a length shorter than the context): the baseline
    is our architecture written with torch's modules and SDPA, not another model."""
    from cs336_systems.bench.plain_model import PlainTransformerLM, plain_state_dict
    from cs336_systems.model import TransformerLM, get_config

    config = get_config("tiny", context_length=24)
    torch.manual_seed(0)
    ours = TransformerLM(config).double()
    plain = PlainTransformerLM(config).double()
    plain.load_state_dict(plain_state_dict(ours.state_dict()))
    tokens = torch.randint(config.vocab_size, (3, 19))
    # not 1e-12: our RMSNorm normalises in float32 whatever the input dtype (errors ~1e-7 on logits of ~1)
    torch.testing.assert_close(plain(tokens), ours(tokens), rtol=1e-5, atol=1e-6)
    plain.blocks[0].w2.weight.data[0, 0] += 1.0  # and a different weight shows
    assert not torch.allclose(plain(tokens), ours(tokens))


def test_baseline_runs_beside_ours_with_torch_adamw_and_records_every_step(tmp_path):
    sweep = e2e.Sweep(sizes=("tiny",), modes=("forward", "train_step"), attention=("naive", "sdpa"),
                      optimizers=("foreach", "fused"), models=("ours", "plain"), context_length=16, batch_size=2,
                      warmups=(1,), steps=3, device="cpu")
    plain = [s for s in sweep.specs() if s.model == "plain"]
    # one baseline point per mode, whatever attention and optimizers ours sweeps
    assert sorted((s.mode, s.attention, s.optimizer) for s in plain) == [("forward", "sdpa", "none"),
                                                                         ("train_step", "sdpa", "torch_fused")]
    assert len(sweep.specs()) == 2 * (1 + 2) + 2
    e2e.sweep(dataclasses.replace(sweep, modes=("train_step",), attention=("sdpa",), optimizers=("foreach",)),
              tmp_path / "rows.csv")
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert set(rows["model"]) == {"ours", "plain"} and (rows["status"] == "ok").all()
    for _, row in rows.iterrows():  # the per-step times are the ones summarized
        times = [float(t) for t in row["samples_ms"].split()]
        assert len(times) == 3 and np.isclose(np.mean(times), row["mean_ms"], rtol=1e-3)
    with pytest.raises(ValueError, match="'mine'"):
        e2e.Sweep(models=("mine",), device="cpu")


def test_master_weights_only_in_ours_bf16_training_steps(tmp_path):
    """--weights bf16-master adds a point beside each bf16 train step of ours (never the baseline's, another
    mode's or precision's), runs it with bf16 matmul weights, and is refused where no point could use it."""
    grid = dict(sizes=("tiny",), context_length=16, batch_size=2, warmups=(1,), steps=2, device="cpu")
    sweep = e2e.Sweep(**grid, modes=("forward", "train_step"), precisions=("fp32", "bf16"),
                      models=("ours", "plain"), attention=("sdpa",), weights=("float32", "bf16-master"))
    masters = [(s.model, s.mode, s.precision) for s in sweep.specs() if s.weights == "bf16-master"]
    assert masters == [("ours", "train_step", "bf16")]
    both = dataclasses.replace(sweep, optimizers=("fused", "torch_fused")).specs()  # torch's AdamW keeps no masters
    assert sorted((s.optimizer, s.weights) for s in both if s.model == "ours" and s.precision == "bf16"
                  and s.mode == "train_step") == [("fused", "bf16-master"), ("fused", "float32"),
                                                  ("torch_fused", "float32")]
    measured = []
    real_measure = e2e.measure

    def measure(spec):
        samples = real_measure(spec)
        measured.append((spec.weights, spec.model))
        return samples

    built = []
    real_build = e2e.build_model

    def build_model(spec, device):
        built.append(real_build(spec, device))
        return built[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(e2e, "measure", measure)
        patch.setattr(e2e, "build_model", build_model)
        e2e.sweep(dataclasses.replace(sweep, modes=("train_step",), precisions=("bf16",), models=("ours",)),
                  tmp_path / "rows.csv")
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert measured == [("float32", "ours"), ("bf16-master", "ours")] and (rows["status"] == "ok").all()
    assert rows.drop_duplicates("weights")["weights"].tolist() == ["float32", "bf16-master"]
    dtypes = [{p.dtype for p in model.parameters() if p.dim() == 2} for model in built]
    assert dtypes == [{torch.float32}, {torch.float32, torch.bfloat16}]  # the embedding stays float32
    torch.manual_seed(0)  # as measure() seeds the model it builds: the bf16 weights have moved from their start
    start = real_build(sweep.specs()[0], torch.device("cpu"))
    moved = [not torch.equal(p, q.bfloat16()) for p, q in zip(built[1].parameters(), start.parameters())
             if p.dtype == torch.bfloat16]
    assert len(moved) == 15 and all(moved)
    for bad in (dict(precisions=("fp32",)), dict(models=("plain",)), dict(modes=("forward",)),
                dict(optimizers=("torch_fused",))):
        with pytest.raises(ValueError, match="bf16-master"):
            e2e.Sweep(**{**grid, "precisions": ("bf16",), "modes": ("train_step",), **bad},
                      weights=("bf16-master",))


def test_profile_attributes_kernels_to_attention_stages():
    """Each ATen op (on a GPU: each kernel) inside a stage range is counted in that stage only: the score
    matmul, scaling and mask in `scores`, softmax in `softmax`, the PV product in `final matmul`."""
    config = profile.ProfileConfig(sizes=("tiny",), context_lengths=(16,), batch_size=2, warmup=1, steps=1,
                                   device="cpu", tool="torch")
    rows = pd.DataFrame(profile.profile_rows(config))
    staged = rows[(rows["kind"] == "stage_kernel") & (rows["phase"] == "forward")]
    ops = staged.groupby("stage")["name"].agg(set)
    assert "aten::softmax" in ops["softmax"] or "aten::_softmax" in ops["softmax"]
    assert not {"aten::softmax", "aten::_softmax"} & (ops["scores"] | ops["final matmul"])
    assert "aten::bmm" in ops["scores"] and "aten::bmm" in ops["final matmul"]
    layers = 2  # tiny
    assert staged[(staged["stage"] == "final matmul") & (staged["name"] == "aten::bmm")]["calls_per_step"].sum() == layers
    # a stage's kernels add up to no more than the stage range's own time
    stage_ms = rows[(rows["kind"] == "attention_stage") & (rows["phase"] == "forward")].set_index("name")["ms_per_step"]
    assert (staged.groupby("stage")["ms_per_step"].sum() <= stage_ms.reindex(ops.index) * 1.001).all()


def test_memory_saved_for_backward_splits_activations_and_weight_copies():
    """What a forward saves for the backward, on a case whose answer follows from the shapes: autocast's
    x_bf16 @ (Wᵀ)_bf16 saves both casts (x requires grad), then .float().pow(2) saves its float32 input."""
    from cs336_systems.model.transformer import Linear

    layer, x = Linear(8, 6), torch.randn(3, 8, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        return out.float().pow(2).sum()

    saved = {k: v * 2**20 for k, v in memory.saved_mib(forward, layer.parameters()).items()}  # bytes
    assert saved == {"saved_weight_copies_mib": 8 * 6 * 2, "saved_fp32_activations_mib": 3 * 6 * 4,
                     "saved_activations_mib": 3 * 8 * 2 + 3 * 6 * 4}
    # float32: the matmul saves the parameter itself (resident anyway), so no copies and x counts at 4 B
    fp32 = memory.saved_mib(lambda: layer(x).pow(2).sum(), layer.parameters())
    assert fp32["saved_weight_copies_mib"] == 0 and fp32["saved_activations_mib"] * 2**20 == 3 * 8 * 4 + 3 * 6 * 4


def test_memory_saved_for_backward_frees_what_the_forward_made():
    """An op that saves its own output (exp) must not keep it alive once the measurement is done: packing
    the output as itself made a cycle through its grad_fn, and on a GPU each point leaked its model."""
    import gc
    import weakref

    x, outputs = torch.randn(1000, requires_grad=True), []

    def forward():
        y = x.exp()
        outputs.append(weakref.ref(y))
        return y.sum()

    assert memory.saved_mib(forward, [x])["saved_activations_mib"] * 2**20 == 1000 * 4
    gc.collect()
    assert outputs[0]() is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_saved_weight_copies_of_the_model_are_its_matmul_weights_in_bf16(precision):
    """The tiny model under bf16 autocast keeps one bf16 copy of every matmul weight (attention, SwiGLU and
    LM head; not the embedding or the norms, which autocast does not cast); float32 keeps none."""
    from cs336_systems.model.transformer import Linear

    spec = e2e.RunSpec(size="tiny", mode="train_step", precision=precision, attention="naive", batch_size=2,
                       context_length=16, warmup=0, steps=1, device="cpu")
    saved = memory.saved_for_backward(spec)
    torch.manual_seed(0)
    model = e2e.build_model(spec, torch.device("cpu"))
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert saved["saved_weight_copies_mib"] * 2**20 == (2 * matmul_weights if precision == "bf16" else 0)
    assert saved["saved_activations_mib"] > 0
    assert 0 < saved["saved_fp32_activations_mib"] <= saved["saved_activations_mib"]


def test_memory_rows_carry_the_phase_levels_and_what_the_forward_saves(tmp_path, monkeypatch):
    """memory_rows reads each point's snapshot back for its phase levels, and measures what a training step's
    forward saves; a forward-only point gets no saved columns and an OOM point neither (CUDA stood in for)."""
    import pickle

    from cs336_systems.analysis import snapshot as snapshots

    def run(spec):
        if spec.context_length == 32:
            return [{"phase": "step", "status": "oom"}]
        t0, mib = 1_000_000, 2**20
        snapshot = {"segments": [{"blocks": [{"size": 10 * mib, "state": "active_allocated"}]}],
                    "device_traces": [[{"action": "alloc", "size": 10 * mib, "time_us": t0 + 10, "frames": []}]],
                    "phases": [{"phase": "forward", "start_us": t0, "end_us": t0 + 20}]}
        Path(spec.memory_snapshot).write_bytes(pickle.dumps(snapshot))
        return [{"phase": "step", "status": "ok", "peak_memory_mib": 10.0}]

    monkeypatch.setattr(memory, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(memory, "provenance", lambda device: {"device_name": "GPU"})
    monkeypatch.setattr(memory.e2e, "run", run)
    monkeypatch.setattr(memory, "saved_for_backward", lambda spec: {"saved_activations_mib": 1.0})
    config = memory.MemoryConfig(snapshot_dir=tmp_path, context_lengths=(16, 32), precisions=("fp32",))
    # rows in the order of the grid: each context length, then each mode (the stand-in rows name neither)
    rows = dict(zip([("forward", 16), ("train_step", 16), ("forward", 32), ("train_step", 32)],
                    memory.memory_rows(config)))
    levels = snapshots.phase_levels(pickle.loads((tmp_path / "forward_fp32_16.pickle").read_bytes()))
    assert levels == {"forward_start_mib": 0.0, "forward_peak_mib": 10.0, "forward_end_mib": 10.0}
    assert rows[("forward", 16)].items() >= levels.items() and "saved_activations_mib" not in rows[("forward", 16)]
    assert rows[("train_step", 16)]["saved_activations_mib"] == 1.0
    assert "forward_peak_mib" not in rows[("train_step", 32)] and rows[("train_step", 32)]["snapshot"] == ""


def test_read_table_keeps_a_number_like_commit_as_text(tmp_path):
    """A commit hash of digits, 'e' and digits reads as the hash, not as a float (pandas' own parsing of it
    crashed the process), and the other columns keep their types."""
    commit = "8406e2351569102691"
    path = tmp_path / "rows.csv"
    path.write_text(f"step_ms,git_commit,hostname\n1.5,{commit},123\n")
    frame = read_table(path)
    assert frame["git_commit"].tolist() == [commit] and frame["hostname"].tolist() == ["123"]
    assert frame["step_ms"].dtype.kind == "f"
    assert read_rows(path, path)["git_commit"].tolist() == [commit, commit]


def test_read_table_and_merge_keep_floats_exactly(tmp_path):
    """pandas' default CSV parser read 0.008537759870211143 a unit in the last place off; a merge through it would
    then rewrite every committed row's last digits."""
    from cs336_systems.bench import merge

    values = ["0.008537759870211143", "11.932310104370117", "3.1969478099868493e-07", "8929.422832666665"]
    path = tmp_path / "rows.csv"
    path.write_text("value\n" + "\n".join(values) + "\n")
    assert read_table(path)["value"].tolist() == [float(v) for v in values]
    merge.main([str(path), "--out", str(tmp_path / "merged.csv")])
    assert (tmp_path / "merged.csv").read_text() == path.read_text()


def test_provenance_writes_the_documented_columns():
    from cs336_systems.provenance import provenance
    from cs336_systems.results import PROVENANCE_COLUMNS

    assert tuple(provenance("cpu")) == PROVENANCE_COLUMNS


# ----------------------------------------------------------------------------------------------
# bench.gpu_clock: the SM clock and power beside a measurement
# ----------------------------------------------------------------------------------------------
FAKE_SMI = '''import sys, time
from datetime import datetime
args = sys.argv[1:]
assert "--query-gpu=timestamp,clocks.sm,power.draw" in args and "--format=csv,noheader,nounits" in args, args
interval = int(args[args.index("-lms") + 1]) / 1e3
print("[N/A], [N/A], [N/A]", flush=True)
for i in range(100000):
    now = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{now}, {1500 + 10 * (i % 2)}, 690.5", flush=True)
    time.sleep(interval)
'''


def test_gpu_clock_parses_nvidia_smi_lines_and_averages_a_window():
    from cs336_systems.bench.gpu_clock import Sample, parse_line, window_means

    sample = parse_line("2026/11/29 04:01:27.668, 1620, 646.65\n")
    assert sample.sm_clock_mhz == 1620 and sample.power_w == 646.65
    assert sample.time == pytest.approx(pd.Timestamp("2026-11-29 04:01:27.668").timestamp())
    for other in ("timestamp, clocks.current.sm [MHz], power.draw [W]", "2026/11/29 04:01:27.668, [N/A], 80", ""):
        assert parse_line(other) is None, other
    samples = [Sample(10.0, 1980, 120.0), Sample(11.0, 1500, 690.0), Sample(12.0, 1600, 700.0), Sample(13.0, 1980, 0)]
    assert window_means(samples, 10.5, 12.0) == {"sm_clock_mhz": 1550.0, "power_w": 695.0, "clock_samples": 2}
    empty = window_means(samples, 12.1, 12.9)
    assert empty["clock_samples"] == 0 and np.isnan(empty["sm_clock_mhz"]) and np.isnan(empty["power_w"])
    with pytest.raises(ValueError, match="ends"):
        window_means(samples, 12.0, 11.0)


def test_cycle_ratio_is_the_median_of_each_rounds_cycles_over_the_bases():
    from cs336_systems.bench.gpu_clock import cycle_ratio

    rng = np.random.default_rng(7)
    ms, base_ms = rng.uniform(20, 30, 5), rng.uniform(20, 30, 5)
    mhz, base_mhz = rng.uniform(1500, 1980, 5), rng.uniform(1500, 1980, 5)
    rounds = ms * mhz / (base_ms * base_mhz)
    assert cycle_ratio(list(ms), list(mhz), list(base_ms), list(base_mhz)) == pytest.approx(np.median(rounds))
    mhz[1] = base_ms[3] = np.nan  # rounds without a clock (a short sample) or a time are left out
    assert cycle_ratio(list(ms), list(mhz), list(base_ms), list(base_mhz)) == pytest.approx(
        np.median(rounds[[0, 2, 4]]))
    # equal clocks: the time ratio's median; all clocks missing: NaN
    assert cycle_ratio([2.0, 4.0, 3.0], [1e3] * 3, [1.0, 1.0, 1.0], [1e3] * 3) == 3.0
    assert np.isnan(cycle_ratio([1.0], [np.nan], [1.0], [1e3]))
    with pytest.raises(ValueError, match="one time and one clock per round"):
        cycle_ratio([1.0, 2.0], [1e3], [1.0, 2.0], [1e3, 1e3])


def test_gpu_clock_samples_in_the_background_and_is_nan_without_nvidia_smi(tmp_path):
    import sys
    import time

    from cs336_systems.bench.gpu_clock import ClockSampler

    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SMI}")
    fake.chmod(0o755)
    with ClockSampler(interval_ms=20, command=str(fake)) as clocks:
        start = time.time()
        time.sleep(0.5)
        end = time.time()
    got = clocks.window(start, end)
    assert got["clock_samples"] >= 5 and 1500 <= got["sm_clock_mhz"] <= 1510 and got["power_w"] == 690.5, got
    assert clocks._process.poll() is not None  # stopped with the context
    with ClockSampler(command=str(tmp_path / "no-such-tool")) as missing:
        time.sleep(0.05)
    assert missing.window(0, time.time())["clock_samples"] == 0
    with pytest.raises(ValueError, match="interval_ms"):
        ClockSampler(interval_ms=0)
    stubborn = tmp_path / "stubborn-smi"  # ignores SIGTERM: killed after stop_timeout_s, the context still exits
    stubborn.write_text(f"#!{sys.executable}\nimport signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n{FAKE_SMI}")
    stubborn.chmod(0o755)
    sampler = ClockSampler(interval_ms=20, command=str(stubborn))
    sampler.stop_timeout_s = 0.2
    with sampler:
        time.sleep(0.3)
    assert sampler._process.returncode is not None and sampler.samples
