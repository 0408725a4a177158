"""The training CLI end to end on CPU: as one plain process, and on 2 gloo ranks, where our wrappers
give torch DDP's loss curve, checkpoints resume exactly (also after a kill between two ranks'
saves), and token files are read and checked."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cs336_systems.distributed import DataParallelSpec, parallelize
from cs336_systems.model import get_config
from cs336_systems.checkpoint import COMPLETE, RunIdentity, load_checkpoint, saved_steps, step_dir
from cs336_systems.train import build_parser, load_tokens, main, parse_args, train
from tests.distributed_helpers import run_distributed

COMMON = ["--size", "tiny", "--context-length", "16", "--batch-size", "2", "--precision", "fp32",
          "--attention", "naive", "--lr", "1e-2", "--backend", "gloo"]
VOCAB = get_config("tiny").vocab_size


def _run_each(rank, world, runs, out):
    """train for each argv of `runs` in turn, in one pair of ranks (one spawn for all); rank 0 writes each run's
    losses."""
    losses = [[row["loss"] for row in train(parse_args(argv), rank, world, torch.device("cpu"))] for argv in runs]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


def _losses(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    run_distributed(_run_each, 2, [[*COMMON, *argv]], str(out))
    return json.loads(out.read_text())[0]


def test_wrappers_follow_torch_ddp_loss_curve(tmp_path):
    wrappers = [["torch_ddp"], ["naive"], ["individual"], ["bucketed:0.01"], ["bucketed:0.01", "--sharded-optimizer"]]
    out = tmp_path / "losses.json"
    run_distributed(_run_each, 2, [[*COMMON, "--steps", "5", "--wrapper", *w] for w in wrappers], str(out))
    reference, *others = json.loads(out.read_text())
    assert reference[-1] < reference[0]  # it learns (random tokens, but the unigram is learnable)
    for wrapper, losses in zip(wrappers[1:], others, strict=True):
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=" ".join(wrapper))


def _run_seeing_the_plan(rank, world, argv, out):
    """_run_each for one run, also recording the plan train hands to parallelize and what it made of the blocks."""
    import cs336_systems.train as train_module

    applied = []

    def spy(model, plan, device, **kwargs):
        wrapped = parallelize(model, plan, device, **kwargs)
        applied.append({"plan": str(plan), "blocks": type(model.layers).__name__})
        return wrapped

    train_module.parallelize = spy
    log = train(parse_args(argv), rank, world, torch.device("cpu"))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": [row["loss"] for row in log], "applied": applied}, f)


def test_checkpoint_flag_reaches_the_plan_and_keeps_the_loss_curve(tmp_path):
    reference = _losses(tmp_path, "plain", "--wrapper", "bucketed:0.01", "--steps", "3")
    out = tmp_path / "checkpointed.json"
    run_distributed(_run_seeing_the_plan, 2,
                    [*COMMON, "--wrapper", "bucketed:0.01", "--steps", "3", "--checkpoint", "every:1"], str(out))
    seen = json.loads(out.read_text())
    assert seen["applied"] == [{"plan": "compile=none checkpoint=every:1 dp=bucketed:0.01",
                                "blocks": "CheckpointedBlocks"}]
    np.testing.assert_allclose(seen["losses"], reference, rtol=1e-5)  # recomputation changes no value


def test_one_plain_process_without_torchrun(tmp_path):
    """No RANK or WORLD_SIZE in the environment: one rank, the default wrapper, a loss log."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log = tmp_path / "loss.csv"
    subprocess.run([sys.executable, "-m", "cs336_systems.train", "--size", "tiny", "--steps", "2",
                    "--context-length", "16", "--batch-size", "2", "--precision", "fp32", "--loss-log", str(log)],
                   check=True, capture_output=True, timeout=300, env=env)
    import pandas as pd

    rows = pd.read_csv(log)
    assert rows["step"].tolist() == [1, 2] and np.isfinite(rows["loss"]).all()
    assert (rows["world_size"] == 1).all() and (rows["config"] == "bucketed:25").all()
    assert (rows["dp_kind"] == "bucketed").all() and (rows["bucket_mb"] == 25).all()
    assert (rows["optimizer_sharding"] == "none").all()


def test_resume_after_a_kill_between_two_ranks_saves(tmp_path):
    """Checkpoints every 2 steps, the last 2 kept; then step 6 is made to look as if rank 1 was killed
    before saving it (rank 0's file there, rank 1's missing, no COMPLETE marker). The resumed run must
    ignore step 6, continue from step 4, and give the uninterrupted run's losses; and again once rank 1's
    file of step 6 is damaged (each rank verifies its own file against the recorded checksum)."""
    args = ["--wrapper", "individual", "--sharded-optimizer"]
    full = _losses(tmp_path, "full", *args, "--steps", "6")
    ckpt = tmp_path / "ckpt"
    saving = [*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "2"]
    first = _losses(tmp_path, "first", *saving, "--steps", "6")
    np.testing.assert_allclose(first, full, rtol=1e-6)
    assert saved_steps(ckpt) == [4, 6] and saved_steps(ckpt, complete_only=False) == [4, 6]  # 2 pruned

    (step_dir(ckpt, 6) / COMPLETE).unlink()
    (step_dir(ckpt, 6) / "rank1.pt").unlink()
    assert saved_steps(ckpt) == [4]
    rest = _losses(tmp_path, "rest", *saving, "--steps", "6", "--resume")
    np.testing.assert_allclose(rest, full[4:], rtol=1e-6)
    assert saved_steps(ckpt) == [4, 6]
    assert {p.name for p in step_dir(ckpt, 6).iterdir()} == {"rank0.pt", "rank1.pt", COMPLETE}
    marker = json.loads((step_dir(ckpt, 6) / COMPLETE).read_text())
    assert (marker["step"], marker["world_size"], sorted(marker["files"])) == (6, 2, ["rank0.pt", "rank1.pt"])
    assert marker["run"] == {"size": "tiny", "wrapper": "individual", "optimizer_sharding": "sharded",
                             "world_size": 2}

    # rank 1's file of step 6 damaged after the fact: rank 1 finds it, both ranks fall back to step 4 together
    with open(step_dir(ckpt, 6) / "rank1.pt", "r+b") as f:
        f.seek(1 << 16)  # inside the embedding's weights: not zeros already
        assert f.read(4096).count(0) < 4096
        f.seek(1 << 16)
        f.write(b"\0" * 4096)
    again = _losses(tmp_path, "again", *saving, "--steps", "6", "--resume")
    np.testing.assert_allclose(again, full[4:], rtol=1e-6)
    assert json.loads((step_dir(ckpt, 6) / COMPLETE).read_text())["files"] == marker["files"]  # saved as before


def test_token_file(tmp_path):
    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB, 5_000, dtype=np.uint16).tofile(data)
    losses = _losses(tmp_path, "file", "--wrapper", "flat", "--steps", "3", "--data", str(data))
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_token_file_of_exactly_one_window_is_enough(tmp_path):
    data = tmp_path / "tokens.bin"
    ids = np.arange(17, dtype=np.uint16)  # context 16 + 1 target: one window, at offset 0
    ids.tofile(data)
    loaded = load_tokens(data, VOCAB, context_length=16)
    assert np.array_equal(loaded, ids)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().err


def test_bad_token_files_are_clear_errors_up_front(tmp_path, capsys):
    short = tmp_path / "short.bin"
    np.arange(16, dtype=np.uint16).tofile(short)
    err = _error(capsys, [*COMMON, "--data", str(short)])
    assert f"--data '{short}' holds 16 tokens, fewer than one training window needs: 17" in err
    big = tmp_path / "big.bin"
    ids = np.zeros(100, dtype=np.uint16)
    ids[37] = VOCAB + 5
    ids.tofile(big)
    err = _error(capsys, [*COMMON, "--data", str(big)])
    assert f"--data '{big}' holds token id {VOCAB + 5}, beyond the model's vocabulary of {VOCAB} ids" in err
    ids[37] = VOCAB - 1  # the largest valid id is fine
    ids.tofile(big)
    assert load_tokens(big, VOCAB, 16).max() == VOCAB - 1
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 41)
    assert "has 41 bytes, not a whole number of uint16" in _error(capsys, [*COMMON, "--data", str(odd)])
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert "holds 0 tokens" in _error(capsys, [*COMMON, "--data", str(empty)])


def test_sharded_optimizer_flag_is_a_deprecated_spelling_of_plus_sharded():
    with pytest.warns(DeprecationWarning, match="--wrapper KIND\\+sharded"):
        args = parse_args(["--wrapper", "bucketed:2", "--sharded-optimizer"])
    assert str(args.wrapper) == "bucketed:2+sharded" and not hasattr(args, "sharded_optimizer")
    assert parse_args(["--wrapper", "individual+sharded"]).wrapper == DataParallelSpec.parse("individual+sharded")


def test_attention_choices_are_the_registry():
    """Every registered backend is accepted and listed in --help, as the registry holds them when the parser
    is built (none typed into train.py)."""
    from cs336_systems.model import ATTENTION_BACKENDS

    help_text = " ".join(build_parser().format_help().split())
    for name in ATTENTION_BACKENDS:
        assert parse_args(["--attention", name]).attention == name
        assert name in help_text, name


def test_bad_arguments(tmp_path, capsys):
    assert "unknown data-parallel kind 'ring'" in _error(capsys, ["--wrapper", "ring"])
    assert "bucket size must be positive and finite, got 0.0" in _error(capsys, ["--wrapper", "bucketed:0"])
    assert "--sharded-optimizer contradicts --wrapper torch_ddp+zero" in _error(
        capsys, ["--wrapper", "torch_ddp+zero", "--sharded-optimizer"])
    assert "does not exist" in _error(capsys, ["--data", "/no/such/file"])
    assert "--resume needs --checkpoint-dir" in _error(capsys, ["--resume"])
    assert "must be a positive integer, got 0" in _error(capsys, ["--steps", "0"])
    assert "must be a positive integer, got 0" in _error(capsys, ["--keep-checkpoints", "0"])
    assert "must be >= 0, got -1" in _error(capsys, ["--seed", "-1"])
    assert "must be positive, got -1" in _error(capsys, ["--lr", "-1"])
    assert "argument --attention: invalid choice: 'nope'" in _error(capsys, ["--attention", "nope"])
    assert "compile=blocks with dp=fsdp" in _error(capsys, ["--wrapper", "fsdp", "--compile", "blocks"])
    assert "more than the model's 2 layers" in _error(capsys, ["--size", "tiny", "--checkpoint", "every:3"])
    used = tmp_path / "ckpt"
    step_dir(used, 3).mkdir(parents=True)
    assert "already holds checkpoints: pass --resume" in _error(capsys, ["--checkpoint-dir", str(used)])


def _resume_with_another_world_size(rank, world, root):
    folder = step_dir(root, 5)
    folder.mkdir(parents=True)
    saved = {"size": "tiny", "wrapper": "bucketed", "optimizer_sharding": "none", "world_size": 2}
    (folder / COMPLETE).write_text(json.dumps({"step": 5, "world_size": 2, "run": saved, "files": {}}))
    with pytest.raises(ValueError, match=r"holds the checkpoints of another run: world_size 2 \(this run: 1\)"):
        load_checkpoint(root, rank, RunIdentity(**{**saved, "world_size": world}), torch.device("cpu"))


def test_resume_refuses_a_checkpoint_of_another_world_size(tmp_path):
    run_distributed(_resume_with_another_world_size, 1, tmp_path / "ckpt")
