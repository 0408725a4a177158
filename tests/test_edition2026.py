"""The harnesses on the 2026 handout's size table (`--edition 2026`): rows say which table their size is
from, 2026 points are limited by memory rather than by the 2025 context cap, an out-of-memory point is a
row (and, where asked, is run again with another attention), and memory_profiling (f)'s per-block residuals
and gradients (bench/block_memory.py) agree with independent counts."""

import pandas as pd
import pytest
import torch

from cs336_systems.bench import block_memory, e2e, memory, profile, saved_tensors
from cs336_systems.model import MODEL_SIZES, get_config
from cs336_systems.model.transformer import RotaryEmbedding, TransformerBlock

CPU = ["--batch-size", "1", "--warmup", "0", "--steps", "1", "--device", "cpu"]
OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_e2e_rows_carry_the_size_table_and_its_shapes(tmp_path, monkeypatch):
    """The 2026 10B is a known size with its own shape; its training step out of memory is one status=oom row
    (what the 10B fp32 optimizer state does on one GPU), and its other modes still have theirs."""
    monkeypatch.setattr(e2e, "measure", lambda spec: (_ for _ in ()).throw(OOM) if spec.mode == "train_step"
                        else {phase: [1.0] for phase in e2e.PHASES[spec.mode]})
    out = tmp_path / "rows.csv"
    e2e.main(["--edition", "2026", "--sizes", "xl", "10B", "--modes", "forward_backward", "train_step",
              "--context-length", "512", "--out", str(out), *CPU])
    rows = pd.read_csv(out)
    assert (rows["size_table"] == 2026).all()
    assert rows.drop_duplicates("size")[["size", "d_model", "num_layers"]].values.tolist() == [
        ["xl", 2560, 32], ["10B", 4608, 50]]
    oom = rows[rows["status"] == "oom"]
    assert oom[["size", "mode", "phase"]].values.tolist() == [["xl", "train_step", "step"], ["10B", "train_step", "step"]]
    assert set(rows[(rows["size"] == "10B") & (rows["status"] == "ok")]["phase"]) == {"forward", "backward", "step"}


def test_2025_rows_keep_their_table(tmp_path):
    out = tmp_path / "rows.csv"
    e2e.main(["--sizes", "tiny", "--modes", "forward", "--context-length", "8", "--out", str(out), *CPU])
    assert (pd.read_csv(out)["size_table"] == 2025).all()


def test_only_the_2025_table_caps_the_context(tmp_path, capsys):
    """2025: 1024 tokens at most (the handout's longest); 2026: whatever fits in memory, so a tiny model runs
    at 1100 tokens."""
    with pytest.raises(SystemExit):
        e2e.main(["--sizes", "tiny", "--context-length", "1100", "--out", str(tmp_path / "x.csv"), *CPU])
    assert "context length 1100 exceeds the 1024 tokens size 'tiny' supports" in capsys.readouterr().err
    out = tmp_path / "rows.csv"
    e2e.main(["--edition", "2026", "--sizes", "tiny", "--modes", "forward", "--context-length", "1100",
              "--out", str(out), *CPU])
    rows = pd.read_csv(out)
    assert (rows["status"] == "ok").all() and (rows["context_length"] == 1100).all()
    with pytest.raises(ValueError, match="context length 2048 exceeds"):
        profile.ProfileConfig(sizes=("xl",), context_lengths=(256, 2048), device="cpu")
    assert profile.ProfileConfig(edition="2026", sizes=("xl",), context_lengths=(256, 2048), device="cpu")


@pytest.mark.parametrize("argv,message", [
    (["--edition", "2024"], "invalid choice: '2024'"),
    (["--edition", "2026", "--sizes", "2.7B"], "unknown model size '2.7B'"),
    (["--sizes", "10B"], "unknown model size '10B'"),
])
def test_sizes_are_looked_up_in_their_edition(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        e2e.main([*argv, "--out", str(tmp_path / "x.csv"), *CPU])
    assert message in capsys.readouterr().err


def test_profile_rows_carry_the_size_table():
    rows = profile.profile_rows(profile.ProfileConfig(edition="2026", sizes=("tiny",), context_lengths=(16,),
                                                      batch_size=1, warmup=0, steps=1, device="cpu", tool="torch"))
    assert {row["size_table"] for row in rows} == {"2026"} and {row["status"] for row in rows} == {"ok"}


def test_memory_runs_an_oom_point_again_with_the_fallback_attention(tmp_path, monkeypatch):
    """The naive point out of memory keeps its OOM row and is followed by the fallback's row; a point that fits
    with naive attention is not run again. (CUDA stood in for: the snapshot is read by the stub.)"""
    seen = []

    def run(spec):
        seen.append((spec.context_length, spec.attention, spec.size_table))
        if spec.context_length == 2048 and spec.attention == "naive":
            return [{"phase": "step", "status": "oom", "attention": spec.attention}]
        return [{"phase": "step", "status": "ok", "attention": spec.attention, "peak_memory_mib": 1.0}]

    monkeypatch.setattr(memory, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(memory, "provenance", lambda device: {})
    monkeypatch.setattr(memory.e2e, "run", run)
    monkeypatch.setattr(memory, "load_snapshot", lambda path: path)
    monkeypatch.setattr(memory, "phase_levels", lambda snapshot: {"snapshot_path": str(snapshot)})
    config = memory.MemoryConfig(snapshot_dir=tmp_path, size="xl", edition="2026", context_lengths=(128, 2048),
                                 modes=("forward",), precisions=("fp32",), fallback_attention="flash_triton")
    rows = memory.memory_rows(config)
    assert seen == [(128, "naive", "2026"), (2048, "naive", "2026"), (2048, "flash_triton", "2026")]
    assert [(r["attention"], r["status"], r["snapshot"]) for r in rows] == [
        ("naive", "ok", "forward_fp32_128.pickle"), ("naive", "oom", ""),
        ("flash_triton", "ok", "forward_fp32_2048_flash_triton.pickle")]
    with pytest.raises(ValueError, match="must differ"):
        memory.MemoryConfig(snapshot_dir=tmp_path, fallback_attention="naive")


# ---- memory_profiling (f): residuals and gradients per block ---------------------------------------------

def _tiny_spec(**changes):
    spec = dict(size="tiny", mode="forward_backward", precision="fp32", attention="naive", batch_size=2,
                context_length=24, warmup=0, steps=1, device="cpu", size_table="2026")
    return e2e.RunSpec(**{**spec, **changes})


def test_block_residuals_match_a_lone_block_and_gradients_its_parameters():
    """Each block of the model saves what one TransformerBlock saves on its own (saved_tensors' count: its
    input plus its activations, each storage once); its gradients are its parameters' count in float32."""
    rows = pd.DataFrame(block_memory.run(_tiny_spec()))
    blocks, ops = rows[rows["kind"] == "block"], rows[rows["kind"] == "op"]
    config = get_config("tiny", "2026", context_length=24)
    block = TransformerBlock(config)
    rope = RotaryEmbedding(config.head_dim, 24, config.rope_theta)
    x = torch.randn(2, 24, config.d_model, requires_grad=True)
    output, records = saved_tensors.record_saved_tensors(block, x, rope, torch.arange(24),
                                                         parameters=block.parameters())
    alone = saved_tensors.saved_bytes(records)
    expected = (alone["input"]["storage_bytes"] + alone["activation"]["storage_bytes"]) / 2**20
    assert blocks["residual_mib"].tolist() == pytest.approx([expected] * config.num_layers)
    d, f = config.d_model, config.d_ff
    assert blocks["gradient_mib"].tolist() == pytest.approx([(4 * d * d + 3 * d * f + 2 * d) * 4 / 2**20] * 2)
    assert blocks["backward_delta_mib"].isna().all()  # no allocator counts on a CPU
    for i, mine in ops.groupby("block"):
        assert mine["share"].sum() == pytest.approx(1.0) and mine["rank"].tolist() == list(range(1, len(mine) + 1))
        assert mine["mib"].sum() == pytest.approx(blocks[blocks["block"] == i]["residual_mib"].iloc[0])
        assert mine["mib"].is_monotonic_decreasing and "aten::_unsafe_view" not in set(mine["op"])
    # the SwiGLU's d_ff-wide matmul outputs (w1, w3) are among a block's largest residuals
    first = ops[ops["block"] == 0].set_index("op")
    assert first.loc["aten::mm", "mib"] >= 2 * 2 * 24 * f * 4 / 2**20


def test_block_memory_implied_gradient_is_the_backward_delta_plus_the_residuals():
    """On CUDA the handout's derivation: memory change across the block's backward plus what it freed."""
    blocks = [torch.nn.Linear(2, 2)]
    saved = {1: (0, 3 * 2**20, "aten::mm"), 2: (0, 2**20, "aten::mul")}
    marks = {(0, "start"): 10 * 2**20, (0, "end"): 8 * 2**20}
    (row,), ops = block_memory._rows(blocks, saved, marks, torch.device("cuda"))
    assert row["residual_mib"] == 4 and row["backward_delta_mib"] == -2 and row["implied_gradient_mib"] == 2
    assert [(o["op"], o["share"]) for o in ops] == [("aten::mm", 0.75), ("aten::mul", 0.25)]


def test_block_memory_cli_falls_back_on_oom(tmp_path, monkeypatch):
    def measure(spec):
        if spec.attention == "naive":
            raise OOM
        return [{"kind": "block", "block": 0, "residual_mib": 1.0}], []

    monkeypatch.setattr(block_memory, "measure", measure)
    out = tmp_path / "rows.csv"
    block_memory.main(["--size", "tiny", "--context-lengths", "16", "--fallback-attention", "sdpa",
                       "--device", "cpu", "--out", str(out)])
    rows = pd.read_csv(out)
    assert rows[["attention", "status", "kind"]].values.tolist() == [["naive", "oom", "point"], ["sdpa", "ok", "block"]]
    assert (rows["size_table"] == 2026).all()


def test_the_2026_xl_is_the_2025_2p7b_with_the_longer_contexts_a_harness_choice():
    """The table stays the handout's (its xl equals our 2025 2.7B); the longer contexts come from the
    harnesses' check (bench.e2e.check_sizes), not from a changed table."""
    assert get_config("xl", "2026") == MODEL_SIZES["2.7B"]
    e2e.check_sizes("2026", ["xl", "10B"], [128, 2048, 4096])
    with pytest.raises(ValueError, match="exceeds"):
        e2e.check_sizes("2025", ["2.7B"], [2048])
