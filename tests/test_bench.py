"""The benchmarking harness on CPU: every mode runs, OOM becomes a row, bad input is a clear error."""

import dataclasses
import sqlite3

import pandas as pd
import pytest
import torch

from cs336_systems.bench import e2e
from cs336_systems.bench.results import write_rows
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS

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


def test_train_step_optimizers_change_parameters_alike():
    """Our two AdamW paths and torch's fused AdamW each update the model, and to the same values."""
    spec = e2e.RunSpec(size="tiny", mode="train_step", precision="fp32", attention="naive", compile=False,
                       batch_size=2, context_length=8, warmup=0, steps=1, device="cpu")
    torch.manual_seed(0)
    before = e2e.build_model(spec, torch.device("cpu")).state_dict()
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


def test_optimizer_and_compile_scope_grids(tmp_path):
    parser = e2e.build_parser()
    args = parser.parse_args(["--sizes", "tiny", "--modes", "forward", "train_step", "--optimizers", "foreach",
                              "torch_fused", "--out", str(tmp_path / "x.csv"), *COMMON])
    specs = e2e.specs_from_args(args, parser)
    assert [(s.mode, s.optimizer) for s in specs] == [("forward", "none"), ("train_step", "foreach"),
                                                      ("train_step", "torch_fused")]
    args = parser.parse_args(["--sizes", "tiny", "--compile", "off", "on", "--compile-scopes", "blocks", "model",
                              "--out", str(tmp_path / "x.csv"), *COMMON])
    assert [(s.compile, s.compile_scope) for s in e2e.specs_from_args(args, parser)] == [
        (False, "none"), (True, "blocks"), (True, "model")]
    with pytest.raises(ValueError, match="'sgd'"):
        e2e.make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))])


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


def test_other_errors_are_not_swallowed(monkeypatch, tmp_path):
    monkeypatch.setattr(e2e, "measure", lambda spec: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        e2e.main(["--sizes", "tiny", "--out", str(tmp_path / "x.csv"), *COMMON])


@pytest.mark.parametrize("args,message", [
    (["--sizes", "huge"], "unknown model size 'huge'"),
    (["--steps", "0"], "must be a positive integer, got 0"),
    (["--warmup", "-1"], "must be >= 0, got -1"),
    (["--context-length", "4096"], "--context-length 4096 exceeds"),
    (["--precisions", "fp8"], "unknown precision 'fp8'"),
    (["--attention", "magic"], "unknown attention backend 'magic'"),
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
    assert "--memory-snapshot needs a CUDA device" in capsys.readouterr().err


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
    from cs336_systems.bench import profile

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
    spec = e2e.RunSpec(size="tiny", mode="forward", precision="fp32", attention="naive", compile=True,
                       batch_size=2, context_length=8, warmup=0, steps=1, device="cpu", compile_scope=scope)
    model = e2e.build_model(spec, torch.device("cpu"))
    whole = getattr(model, "_compiled_call_impl", None) is not None
    blocks = [getattr(layer, "_compiled_call_impl", None) is not None for layer in model.layers]
    assert whole == (scope != "blocks") and all(blocks) == (scope == "blocks")
    with pytest.raises(ValueError, match="'layers'"):
        e2e.build_model(dataclasses.replace(spec, compile_scope="layers"), torch.device("cpu"))
