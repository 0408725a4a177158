"""The benchmarking harness on CPU: every mode runs, OOM becomes a row, bad input is a clear error."""

import pandas as pd
import pytest
import torch

from cs336_systems.bench import e2e
from cs336_systems.bench.results import write_rows

COMMON = ["--context-length", "16", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--device", "cpu"]


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


def test_train_step_changes_parameters():
    spec = e2e.RunSpec(size="tiny", mode="train_step", precision="fp32", attention="naive", compile=False,
                       batch_size=2, context_length=8, warmup=0, steps=1, device="cpu")
    torch.manual_seed(0)
    before = e2e.build_model(spec, torch.device("cpu")).state_dict()
    original = e2e.build_model
    built = {}

    def keep(spec_, device):
        built["model"] = original(spec_, device)
        return built["model"]

    e2e.build_model = keep
    try:
        e2e.measure(spec)
    finally:
        e2e.build_model = original
    after = built["model"].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


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
