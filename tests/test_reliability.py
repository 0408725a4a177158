"""Nothing lost, nothing silently wrong (issue 60): the loss log and the checkpoints under kill -9 and corrupted
files, results files' paths and permissions, inputs refused up front, and allocator snapshots read without
running code. Training runs are the tiny model on the CPU, as one process (train.main, or a subprocess where it
is killed)."""

import io
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cs336_systems.analysis.snapshot_file import load_snapshot, loads_snapshot
from cs336_systems.checkpoint import COMPLETE, LOCK, file_sha256, saved_steps, step_dir
from cs336_systems.model import get_config
from cs336_systems.results import AppendedRows, PartialRows, check_output_file, write_rows
from cs336_systems.train import main

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--size", "tiny", "--context-length", "16", "--batch-size", "2", "--precision", "fp32",
          "--attention", "naive", "--lr", "1e-2", "--backend", "gloo", "--wrapper", "bucketed:25"]
ONE_PROCESS_ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
                   "PYTHONPATH": str(ROOT)}


def _train(*argv: str) -> None:
    main([*COMMON, *argv])


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main(list(argv))
    return capsys.readouterr().err


def _log(path: Path) -> pd.DataFrame:
    return pd.read_csv(path)


def _start(tmp_path: Path, *argv: str) -> subprocess.Popen:
    """A training run as its own process (to be killed), its output in tmp_path/run.out."""
    out = open(tmp_path / "run.out", "ab")
    return subprocess.Popen([sys.executable, "-m", "cs336_systems.train", *COMMON, *argv], cwd=ROOT,
                            env=ONE_PROCESS_ENV, stdout=out, stderr=subprocess.STDOUT)


def _wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended (rc {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.05)


def _rows(path: Path) -> int:
    return max(len(path.read_text().splitlines()) - 1, 0) if path.exists() else 0


# ---- the loss log -------------------------------------------------------------------------------

def test_loss_log_is_written_as_the_run_goes_and_survives_kill_9(tmp_path):
    """Killed mid-run, the log holds every step it finished, each once, with the run's columns."""
    log = tmp_path / "loss.csv"
    run = _start(tmp_path, "--steps", "100000", "--loss-log", str(log))
    try:
        _wait_for(lambda: _rows(log) >= 5, run, "5 rows in the loss log")
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    rows = _log(log)
    assert rows["step"].tolist() == list(range(1, len(rows) + 1)) and np.isfinite(rows["loss"]).all()
    assert {"size", "world_size", "config", "git_commit", "peak_memory_mib", "step_ms"} <= set(rows.columns)


def test_kill_9_then_resume_gives_each_step_once_with_the_uninterrupted_losses(tmp_path):
    """kill -9 at some step past the first checkpoints; --resume with the same --loss-log keeps the rows up to
    the checkpoint it resumes from, and the whole log equals an uninterrupted run's, step for step."""
    log, ckpt = tmp_path / "loss.csv", tmp_path / "ckpt"
    run = _start(tmp_path, "--steps", "100000", "--loss-log", str(log), "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "3")
    try:
        _wait_for(lambda: _rows(log) >= 8, run, "8 rows in the loss log")
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    killed_at, resumed_from = _rows(log), saved_steps(ckpt)[-1]
    assert resumed_from >= 6 and killed_at >= resumed_from
    steps = killed_at + 2
    _train("--steps", str(steps), "--loss-log", str(log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
           "--resume")
    _train("--steps", str(steps), "--loss-log", str(tmp_path / "whole.csv"))
    resumed, whole = _log(log), _log(tmp_path / "whole.csv")
    assert resumed["step"].tolist() == list(range(1, steps + 1))
    np.testing.assert_allclose(resumed["loss"], whole["loss"], rtol=1e-6)


def test_resume_keeps_the_earlier_rows_of_the_loss_log(tmp_path):
    """Resuming from step 4 of a log that has steps 1-6: rows 1-4 stay as written, 5-6 are dropped and
    written again, 7-8 appended."""
    log, ckpt = tmp_path / "loss.csv", tmp_path / "ckpt"
    saving = ["--loss-log", str(log), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    _train("--steps", "6", *saving)
    first = log.read_text().splitlines()
    (step_dir(ckpt, 6) / COMPLETE).unlink()  # as if killed while saving step 6
    _train("--steps", "8", *saving, "--resume")
    again = log.read_text().splitlines()
    assert again[:5] == first[:5]  # the header and steps 1-4, byte for byte
    rows = _log(log)
    assert rows["step"].tolist() == list(range(1, 9))
    np.testing.assert_allclose(rows["loss"][4:6], pd.read_csv(io.StringIO("\n".join(first)))["loss"][4:6], rtol=1e-6)


def test_a_bad_loss_log_path_is_refused_before_step_1(tmp_path, capsys):
    err = _error(capsys, *COMMON, "--steps", "1", "--loss-log", str(tmp_path))
    assert f"--loss-log {str(tmp_path)!r} is a directory" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _error(capsys, *COMMON, "--steps", "1", "--loss-log", str(blocker / "loss.csv"))
    assert f"{str(blocker)!r} is a file, not a folder" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: permissions cannot make a folder unwritable")
def test_an_unwritable_loss_log_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    assert f"folder {str(folder)!r} is not writable" in _error(capsys, *COMMON, "--loss-log", str(folder / "x.csv"))


def test_appended_rows_flush_each_row_and_keep_rows_up_to_a_step(tmp_path):
    path = tmp_path / "log.csv"
    log = AppendedRows(path)
    for step in (1, 2, 3):
        log.append({"step": step, "loss": 1.0 / step})
        assert len(pd.read_csv(path)) == step  # on disk at once, not at the end
    kept = AppendedRows(path, keep_until=2)
    assert pd.read_csv(path)["step"].tolist() == [1, 2]
    kept.append({"step": 3, "loss": 0.25, "extra": "x"})  # another column: the file is rewritten with both
    assert pd.read_csv(path).columns.tolist() == ["step", "loss", "extra"]
    AppendedRows(path)  # a fresh run starts the file afresh
    assert path.read_text() == ""


# ---- results files: paths and permissions ---------------------------------------------------------

def test_e2e_out_a_directory_is_refused_and_writes_nothing_beside_it(tmp_path, capsys):
    from cs336_systems.bench import e2e

    target = tmp_path / "results"
    target.mkdir()
    with pytest.raises(SystemExit):
        e2e.main(["--sizes", "tiny", "--device", "cpu", "--context-length", "8", "--out", str(target)])
    assert f"--out {str(target)!r} is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no results.partial beside it
    with pytest.raises(ValueError, match="is a directory"):
        PartialRows(target)
    with pytest.raises(ValueError, match="is a directory"):
        write_rows([{"a": 1}], target)


def test_results_files_are_made_with_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_rows([{"a": 1}], tmp_path / "written.csv")
        rows = PartialRows(tmp_path / "swept.csv")
        rows.add([{"a": 1}])
        rows.finish()
        AppendedRows(tmp_path / "log.csv").append({"step": 1})
    finally:
        os.umask(old)
    for name in ("written.csv", "swept.csv", "log.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    assert check_output_file(tmp_path / "new" / "deeper" / "x.csv") == tmp_path / "new" / "deeper" / "x.csv"


# ---- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Steps 1-6 with checkpoints every 2 (the last 2 kept: steps 4 and 6) and their loss log."""
    root = tmp_path_factory.mktemp("saved")
    _train("--steps", "6", "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "2",
           "--keep-checkpoints", "2", "--loss-log", str(root / "loss.csv"))
    assert saved_steps(root / "ckpt") == [4, 6]
    return root


def _copy(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(saved_run / "ckpt", tmp_path / "ckpt")
    shutil.copy(saved_run / "loss.csv", tmp_path / "loss.csv")
    return tmp_path / "ckpt", tmp_path / "loss.csv"


def _zero_4k(path: Path, offset: int = 1 << 16) -> None:
    """4 KiB zeroed at offset: inside the first tensor, the embedding's weights (a region of an unused
    token's optimizer moments would be zeros already)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        assert f.read(4096).count(0) < 4096
        f.seek(offset)
        f.write(b"\0" * 4096)


DAMAGE = {
    "zero-filled": (_zero_4k, "does not match its recorded checksum"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size // 3), "does not match its recorded checksum"),
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "missing": (lambda p: p.unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_step(saved_run, tmp_path, damage):
    """The newest step's rank file damaged: --resume warns, naming it, resumes from step 4 with the
    uninterrupted run's losses, and the rotation keeps step 4 until step 6 is saved again and verified."""
    ckpt, log = _copy(saved_run, tmp_path)
    spoil, problem = DAMAGE[damage]
    spoil(step_dir(ckpt, 6) / "rank0.pt")
    with pytest.warns(RuntimeWarning, match=f"resuming from step 4 .*skipped: step 6 \\(rank0.pt {problem}"):
        _train("--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "2",
               "--loss-log", str(log), "--resume")
    np.testing.assert_allclose(_log(log)["loss"], _log(saved_run / "loss.csv")["loss"], rtol=1e-6)
    assert saved_steps(ckpt) == [4, 6]
    marker = json.loads((step_dir(ckpt, 6) / COMPLETE).read_text())
    assert marker["files"]["rank0.pt"] == file_sha256(step_dir(ckpt, 6) / "rank0.pt")


def test_every_step_damaged_is_an_error_not_a_fresh_start(saved_run, tmp_path, capsys):
    ckpt, _ = _copy(saved_run, tmp_path)
    for step in (4, 6):
        _zero_4k(step_dir(ckpt, step) / "rank0.pt")
    err = _error(capsys, *COMMON, "--steps", "8", "--checkpoint-dir", str(ckpt), "--resume")
    assert "holds no intact checkpoint: step 6 (rank0.pt does not match" in err and "step 4 (" in err
    assert saved_steps(ckpt) == [4, 6]  # nothing deleted


@pytest.mark.parametrize("other,message", [
    (["--size", "mini"], "size 'tiny' (this run: 'mini')"),
    (["--wrapper", "bucketed:25+sharded"], "optimizer_sharding 'none' (this run: 'sharded')"),
    (["--wrapper", "fsdp"], "wrapper 'bucketed' (this run: 'fsdp')"),
])
def test_resuming_another_runs_checkpoints_is_refused_naming_both_values(saved_run, tmp_path, capsys, other, message):
    ckpt, _ = _copy(saved_run, tmp_path)
    err = _error(capsys, *COMMON, *other, "--steps", "8", "--checkpoint-dir", str(ckpt), "--resume")
    assert f"holds the checkpoints of another run: {message}" in err


def test_checkpoints_load_with_weights_only(saved_run):
    state = torch.load(step_dir(saved_run / "ckpt", 6) / "rank0.pt", weights_only=True)
    assert state["step"] == 6


def test_a_bad_write_fails_the_save_and_deletes_nothing(saved_run, tmp_path, monkeypatch):
    """A rank file that does not read back as written (a failing disk) stops the run before the step is marked
    complete, and the older steps stay."""
    import cs336_systems.checkpoint as checkpoint

    ckpt, _ = _copy(saved_run, tmp_path)
    write = checkpoint._HashingWriter.write

    def bad_disk(self, data):  # the disk keeps other bytes than those handed to it (here: one more, seen by the hash)
        self.digest.update(b"!")
        return write(self, data)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", bad_disk)
    with pytest.raises(OSError, match="reads back with SHA-256 [0-9a-f]+, not the"):
        _train("--steps", "8", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "2",
               "--resume")
    torch.distributed.destroy_process_group()  # main leaves its group of one behind when a step raises
    assert saved_steps(ckpt) == [4, 6] and not (step_dir(ckpt, 8) / COMPLETE).exists()


def test_a_second_run_on_the_folder_is_refused_and_a_killed_runs_lock_is_not_stale(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    first = _start(tmp_path, "--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50000")
    try:
        _wait_for(lambda: (ckpt / LOCK).exists() and "pid" in (ckpt / LOCK).read_text(), first, "a lock")
        err = _error(capsys, *COMMON, "--steps", "2", "--checkpoint-dir", str(ckpt))
        assert f"--checkpoint-dir {str(ckpt)!r} is in use by another run (pid {first.pid} on " in err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    _train("--steps", "2", "--checkpoint-dir", str(ckpt))  # the kill released the lock
    assert saved_steps(ckpt) == [2]


# ---- inputs refused up front ------------------------------------------------------------------------

def test_a_context_beyond_the_size_fails_at_once():
    """Once this ran for minutes until the OOM killer came: now a usage error, in seconds."""
    done = subprocess.run([sys.executable, "-m", "cs336_systems.train", "--size", "tiny", "--context-length",
                           "100000", "--steps", "1"], cwd=ROOT, env=ONE_PROCESS_ENV, capture_output=True, text=True,
                          timeout=120)
    limit = get_config("tiny").context_length
    assert done.returncode == 2 and f"context length 100000 exceeds the {limit} tokens size 'tiny'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a machine without CUDA")
def test_leaderboard_without_cuda_fails_at_once(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cs336_systems.bench.leaderboard", "--out", str(tmp_path / "lb.csv")],
                          cwd=ROOT, env=ONE_PROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "size '8B' in bf16 on device 'cpu': Triton's interpreter cannot run our kernels in bfloat16" in done.stderr
    assert "--size tiny --param-dtype fp32" in done.stderr and not (tmp_path / "lb.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a machine without CUDA")
def test_nccl_without_cuda_is_a_usage_error(capsys):
    assert "--backend nccl needs CUDA" in _error(capsys, "--size", "tiny", "--backend", "nccl")


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
def test_sdpas_cuda_kernels_on_the_cpu_are_a_usage_error(capsys, backend):
    err = _error(capsys, "--size", "tiny", "--attention", backend, "--backend", "gloo")
    assert f"--attention {backend} is one of SDPA's CUDA kernels; with --backend gloo the run is on the CPU" in err


def test_data_a_directory_says_so(tmp_path, capsys):
    assert f"--data {str(tmp_path)!r} is a directory" in _error(capsys, *COMMON, "--data", str(tmp_path))


def test_an_int32_token_file_is_refused(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(0, get_config("tiny").vocab_size, 5_000)
    wide = tmp_path / "int32.bin"
    ids.astype(np.int32).tofile(wide)
    err = _error(capsys, *COMMON, "--data", str(wide))
    assert f"--data {str(wide)!r} looks like int32 or int64 token ids, not uint16" in err
    ids.astype(np.int64).tofile(wide)
    assert "looks like int32 or int64" in _error(capsys, *COMMON, "--data", str(wide))
    narrow = tmp_path / "uint16.bin"
    ids.astype("<u2").tofile(narrow)  # the same ids as the documented format pass
    main([*COMMON, "--steps", "1", "--data", str(narrow)])


def test_the_token_format_is_documented():
    from cs336_systems.train import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "unsigned 16-bit little-endian" in help_text
    assert "unsigned 16-bit little-endian integer" in (ROOT / "README.md").read_text()


# ---- allocator snapshots ----------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_malicious_snapshot_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Payload(marker)]]}))
    with pytest.raises(pickle.UnpicklingError, match="pathlib.*is not plain data"):
        load_snapshot(bad)
    from cs336_systems.report import memory

    with pytest.raises(pickle.UnpicklingError):
        memory.main([str(bad), "--figures-dir", str(tmp_path / "figs"), "--out", str(tmp_path / "alloc.csv")])
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="os.system"):
        loads_snapshot(b"cos\nsystem\n(S'true'\ntR.")  # protocol 0: the classic exploit


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_plain_snapshot_loads_at_every_protocol(tmp_path, protocol):
    snapshot = {"segments": [{"blocks": [{"size": 512, "state": "active_allocated"}]}],
                "device_traces": [[{"action": "alloc", "size": 512, "time_us": 1.5, "frames": [], "ok": True,
                                    "none": None, "pair": (1, 2), "set": {3}}]], "phases": []}
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=protocol))
    assert load_snapshot(path) == snapshot


def test_the_readme_says_how_snapshots_are_read_and_how_to_install():
    readme = (ROOT / "README.md").read_text()
    assert "restricted unpickler" in readme
    assert "python3 -m venv .venv" in readme
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme


# ---- the CPU kernel path: no silently wrong numbers ------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: Triton's interpreter")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_flash_triton_on_the_cpu_trains_as_sdpa_does_at_every_precision(tmp_path, precision):
    """Step-1 losses of the tiny model through our kernels (Triton's interpreter) and through SDPA, at every precision
    the CLI accepts. bfloat16, which the interpreter cannot multiply, once gave 9.1847 against SDPA's 9.2481."""
    losses = {}
    for attention in ("flash_triton", "sdpa"):
        log = tmp_path / f"{attention}.csv"
        _train("--steps", "2", "--loss-log", str(log), "--precision", precision, "--attention", attention)
        losses[attention] = _log(log)["loss"].to_numpy()
    # the loss of the same weights and batch; the step-2 loss also checks the backward's gradients
    np.testing.assert_allclose(losses["flash_triton"], losses["sdpa"], rtol=2e-3 if precision == "fp32" else 1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: Triton's interpreter")
def test_a_bfloat16_kernel_call_on_the_cpu_computes_in_float32_and_says_so():
    from cs336_systems.kernels import FlashAttentionTriton

    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    reference.sum().backward()
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    with pytest.warns(RuntimeWarning, match="cannot multiply bfloat16"):
        out = FlashAttentionTriton.apply(*low, True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and low[0].grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)  # bfloat16's rounding of inputs, output
    for ours, theirs in zip(low, (q, k, v)):
        torch.testing.assert_close(ours.grad.float(), theirs.grad, atol=3e-2, rtol=3e-2)

