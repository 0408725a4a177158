"""The 8B leaderboard benchmark and its plain-PyTorch anchor, on the CPU at tiny sizes.

The anchor must compute our model's function (same weights in, same logits, loss and gradients out), its
checkpointing must not change the gradients (and the selective mode must really keep attention), and the
benchmark writes its rows (the check, each provider, OOM as a row, the documented FLOP count)."""

import argparse
import dataclasses
import math
import os

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems.bench import leaderboard
from cs336_systems.bench.leaderboard import check, memory_probe, points, provider, recipes
from cs336_systems.bench.plain_model import SDPA_OPS, PlainTransformerLM, plain_state_dict
from cs336_systems.distributed.parallelize import NoDataParallel
from cs336_systems.model import TransformerLM, cross_entropy, get_config
from tests.kernel_devices import cpu_kernels



# float32: Triton's CPU interpreter, which runs our kernels here, cannot multiply bfloat16
TINY = ["--size", "tiny", "--context", "24", "--batch", "2", "--compile", "none", "--check-size", "tiny",
        "--check-context", "24", "--warmup", "1", "--steps", "1", "--chunk-tokens", "20", "--param-dtype", "fp32",
        "--device", "cpu"]


def _tiny(**overrides) -> leaderboard.LeaderboardConfig:
    fields = dict(size="tiny", batches=(2,), context_length=24, compile="none", check_size="tiny", check_context=24,
                  warmup=1, steps=2, chunk_tokens=20, device="cpu", ablation_batches=(2,))
    return leaderboard.LeaderboardConfig(**{**fields, **overrides})


# ---- the plain anchor -----------------------------------------------------------------------------------


def _ours_and_plain(checkpoint: str = "none", chunk_tokens: int = 7):
    config = get_config("tiny", context_length=32)  # our model with naive attention: the reference
    torch.manual_seed(0)
    ours = TransformerLM(config)
    plain = PlainTransformerLM(config, checkpoint=checkpoint, chunk_tokens=chunk_tokens)
    plain.load_state_dict(plain_state_dict(ours.state_dict()))
    return config, ours, plain


def test_plain_anchor_computes_our_model_from_the_same_weights():
    """float32, a length below the context and not a multiple of the loss chunk (19 tokens x 3 rows, chunks
    of 7): logits, loss and every gradient agree to float32 rounding."""
    config, ours, plain = _ours_and_plain()
    torch.manual_seed(1)
    tokens, targets = torch.randint(config.vocab_size, (2, 3, 19))
    torch.testing.assert_close(plain(tokens), ours(tokens), rtol=1e-5, atol=1e-5)
    loss_plain, loss_ours = plain.loss(tokens, targets), cross_entropy(ours(tokens), targets)
    torch.testing.assert_close(loss_plain, loss_ours, rtol=1e-6, atol=0)
    loss_plain.backward()
    loss_ours.backward()
    ours_grads = plain_state_dict({name: p.grad for name, p in ours.named_parameters()})
    assert set(ours_grads) == {name for name, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.grad, ours_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        plain.blocks[1].qkv.weight[100, 3] += 0.5  # a k-projection weight (rows 64-127): a different model shows
    assert not torch.allclose(plain(tokens), ours(tokens), rtol=1e-3, atol=1e-4)


class _CountAttention(TorchDispatchMode):
    """Counts the SDPA kernels dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in SDPA_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, reruns_of_attention", [("ac", 1), ("sac", 0)])
def test_checkpointing_keeps_the_gradients_and_sac_keeps_attention(mode, reruns_of_attention):
    """Same gradients as without checkpointing; in the backward, full checkpointing reruns each block's
    attention and selective checkpointing none (its outputs were saved)."""
    config, _, reference = _ours_and_plain()
    _, _, plain = _ours_and_plain(mode)
    torch.manual_seed(2)
    tokens, targets = torch.randint(config.vocab_size, (2, 2, 29))
    reference.loss(tokens, targets).backward()
    loss = plain.loss(tokens, targets)
    with _CountAttention() as counter:
        loss.backward()
    assert counter.calls == reruns_of_attention * config.num_layers
    for (name, p), (_, q) in zip(plain.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_plain_anchor_builds_in_the_given_dtype_and_names_bad_values():
    config = get_config("tiny", context_length=16)
    plain = PlainTransformerLM(config, dtype=torch.bfloat16)
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    assert plain.rope_cos.dtype == torch.float32  # the angle tables stay float32; cast per forward
    assert plain(torch.zeros(1, 16, dtype=torch.long)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'full'"):
        PlainTransformerLM(config, checkpoint="full")
    with pytest.raises(ValueError, match="context_length 16"):
        plain(torch.zeros(1, 17, dtype=torch.long))


# ---- the benchmark ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_check_passes_the_anchors_and_fails_a_wrong_model(param_dtype, monkeypatch):
    """The correctness check against the float32 reference: the plain anchors pass; a provider whose loss
    is 3% off (a wrong model) fails with its error named."""
    config = _tiny(providers=("torch_plain_sac", "torch_plain_ac"), param_dtype=param_dtype)
    rows = list(check.run_check(config, torch.device("cpu")))
    assert [r["status"] for r in rows] == ["check_ok", "check_ok"]
    assert all(r["check_grad_err"] <= r["check_grad_tol"] for r in rows)
    real_build = check.build

    def off_by_three_percent(provider, *args, **kwargs):
        trainee = real_build(provider, *args, **kwargs)
        if provider == "torch_plain_ac":
            loss = trainee.loss
            trainee.loss = lambda x, y: 1.03 * loss(x, y)
        return trainee

    monkeypatch.setattr(check, "build", off_by_three_percent)
    ok, failed = check.run_check(config, torch.device("cpu"))
    assert ok["status"] == "check_ok" and failed["status"] == "check_fail"
    assert "torch_plain_ac differs" in failed["error"] and failed["check_loss_err"] == pytest.approx(0.03, abs=3e-3)


def test_config_names_bad_values():
    for overrides, message in [({"batches": (0,)}, "batch must be positive, got 0"),
                               ({"providers": ("ours", "mine")}, "unknown provider 'mine'"),
                               ({"ablations": ("ours-no_flash",)}, "unknown ablation 'ours-no_flash'"),
                               ({"compile": "model"}, "unknown compile mode 'model'"),
                               ({"size": "9B"}, "unknown model size '9B'"),
                               ({"warmup": 0}, "at least 1")]:
        with pytest.raises(ValueError, match=message):
            _tiny(**overrides)


def test_every_flag_has_help_text(monkeypatch):
    """argparse lists a parser's arguments only in its `_actions` (there is no public accessor)."""
    parser = leaderboard.build_parser()
    assert not [a.dest for a in parser._actions if not a.help and not isinstance(a, argparse._HelpAction)]


def test_rows_name_what_each_provider_runs():
    columns = {name: provider.recipe_columns(name, _tiny(param_dtype="bf16"), 2) for name in leaderboard.RECIPES}
    assert columns["ours"] == {"provider": "ours", "model": "ours", "attention": "flash_triton", "loss_path": "fused",
                               "optimizer": "ours_fused", "checkpoint": "selective:auto", "compile": "none",
                               "param_dtype": "bf16", "optimizer_state_dtype": "bf16", "optimizer_state_home": "device",
                               "microbatch": 1, "data_parallel": "none"}
    assert columns["ours-state_on_host"]["optimizer_state_home"] == "host"
    assert columns["ours-whole_batch"]["microbatch"] == columns["torch_plain_sac"]["microbatch"] == 2
    assert columns["torch_plain_sac"]["optimizer"] == columns["ours-torch_adamw"]["optimizer"] == "torch_fused"
    assert columns["ours-fp32_moments"]["optimizer_state_dtype"] == "fp32"
    # each ablation differs from ours in exactly one choice
    for name in leaderboard.ABLATIONS:
        changed = {k for k, v in columns[name].items() if v != columns["ours"][k]} - {"provider"}
        assert len(changed) == 1, (name, changed)


@cpu_kernels  # ours' kernels on CPU tensors: the interpreter only (a GPU machine skips it)
def test_ours_saves_the_matmuls_of_as_many_blocks_as_the_free_memory_holds(tmp_path, monkeypatch):
    """`AUTO`, resolved per point: a plain selective probe's peak, subtracted from the capacity less the margin,
    divided by a block's matmul outputs (tokens of one pass x (4 d + 2 d_ff) x 4 B in TINY's float32: ours passes
    one sequence at a time). With room for one block and a half the row runs and records selective:0,1; with
    half a block's room, the probe picks plain selective. (A CPU has no allocator peak: stood in for.)"""
    config = get_config("tiny", edition="2026", context_length=24)
    block = 1 * 24 * (4 * config.d_model + 2 * config.d_ff) * 4
    gib = 2**30
    monkeypatch.setattr(memory_probe, "peak_bytes", lambda device: 10 * gib)
    out = tmp_path / "lb.csv"
    leaderboard.main([*TINY, "--check-size", "none", "--providers", "ours", "--ablations", "--memory-margin-gib", "1",
                      "--memory-capacity-gib", repr(10 + 1 + 1.5 * block / gib), "--out", str(out)])
    row = pd.read_csv(out).iloc[0]
    assert (row["checkpoint"], row["matmul_blocks"]) == ("selective:0,1", 1)
    assert row["probe_peak_gib"] == 10 and row["status"] == "ok" and row["step_ms"] > 0
    # no room for a block: the probe alone (its step's peaks stood in for too)
    monkeypatch.setattr(memory_probe, "pass_peaks", lambda *args: [10 * gib, 10 * gib])
    small = _tiny(param_dtype="fp32", memory_margin_gib=1, memory_capacity_gib=10 + 1 + 0.5 * block / gib)
    probe = memory_probe.probe_matmul_blocks("ours", 2, small, torch.device("cpu"))
    assert (probe["checkpoint"], probe["matmul_blocks"], probe["matmul_blocks_later"]) == ("selective", 0, 0)


@pytest.mark.parametrize("batch, sequences", [(2, 1), (3, 2), (2, None), (1, 4)])
def test_microbatches_accumulate_the_whole_batchs_loss_and_gradients(batch, sequences):
    """Gradient accumulation (ours' `microbatch`) against one pass over the whole batch, float32 on the CPU: the
    same mean loss and gradients (to float32 rounding), the slices' shares adding up to one, with an uneven last
    slice (3 sequences, 2 a pass) and a slice larger than the batch."""
    from cs336_systems.train_step import microbatches

    config = get_config("tiny", context_length=16)
    torch.manual_seed(batch)
    model = TransformerLM(config)
    tokens = torch.randint(config.vocab_size, (batch, 16))
    targets = torch.randint(config.vocab_size, (batch, 16))
    whole = provider.Trainee(loss=lambda x, y: cross_entropy(model(x), y), optimizer=None,
                             parameters=dict(model.named_parameters()), as_plain_names=dict,
                             wrapper=NoDataParallel(model))
    loss = provider.forward_backward(whole, tokens, targets)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sliced = dataclasses.replace(whole, microbatch=sequences)
    assert provider.forward_backward(sliced, tokens, targets).item() == pytest.approx(loss.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    slices = microbatches(tokens, targets, sequences)
    assert sum(share for *_, share in slices) == pytest.approx(1.0)
    assert torch.equal(torch.cat([x for x, *_ in slices]), tokens)
    assert len(slices) == (1 if sequences is None else -(-batch // sequences))


def test_microbatches_name_bad_values():
    from cs336_systems.train_step import microbatches

    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="at least one sequence, got 0"):
        microbatches(tokens, tokens, 0)
    with pytest.raises(ValueError, match=r"targets \(2, 3\) differ"):
        microbatches(tokens, tokens[:, :3], 1)


@cpu_kernels  # ours' kernels on CPU tensors: the interpreter only (a GPU machine skips it)
def test_the_first_pass_saves_more_blocks_than_the_passes_holding_gradients(tmp_path, monkeypatch):
    """Ours at batch 2 passes one sequence at a time: the probe's peak of the first pass (no gradients yet) leaves
    room for both blocks, the second pass's (one block more) for one, so the row's policy is "selective:0,2 then
    selective:0,1", and the timed steps run with it, switching between the passes."""
    config = get_config("tiny", edition="2026", context_length=24)
    block = 1 * 24 * (4 * config.d_model + 2 * config.d_ff) * 4
    gib = 2**30
    monkeypatch.setattr(memory_probe, "pass_peaks", lambda *args: [10 * gib, 10 * gib + block])
    switched = []
    real_switch = provider.switch_selective
    monkeypatch.setattr(provider, "switch_selective",
                        lambda model, policy: (switched.append(str(policy)), real_switch(model, policy)))
    out = tmp_path / "lb.csv"
    leaderboard.main([*TINY, "--check-size", "none", "--providers", "ours", "--ablations", "--memory-margin-gib", "1",
                      "--memory-capacity-gib", repr(10 + 1 + 2.5 * block / gib), "--out", str(out)])
    row = pd.read_csv(out).iloc[0]
    assert row["checkpoint"] == "selective:0,2 then selective:0,1" and row["status"] == "ok"
    assert (row["matmul_blocks"], row["matmul_blocks_later"]) == (2, 1)
    assert switched[:2] == ["selective:0,2", "selective:0,1"] and len(switched) == 2 * 2  # two passes, two steps
    with pytest.raises(ValueError, match="two selective ones"):
        recipes.pass_policies("every:1 then selective")


def test_points_run_ablations_only_at_their_batches():
    main = list(leaderboard.PROVIDERS)
    config = _tiny(batches=(2, 1), ablation_batches=None, ablations=("ours-full_ac",))  # default: the last batch
    assert config.points() == [*((2, p) for p in main), *((1, p) for p in main), (1, "ours-full_ac")]
    config = dataclasses.replace(config, ablation_batches=(2,), ablations=("ours-full_ac", "ours-torch_adamw"))
    assert config.points() == [*((2, p) for p in main), (2, "ours-full_ac"), (2, "ours-torch_adamw"),
                               *((1, p) for p in main)]
    with pytest.raises(ValueError, match="ablation batch 4 is not one of the batches"):
        dataclasses.replace(config, ablation_batches=(4,))


def _documented_flops(config, batch: int, context: int) -> int:
    """6 x (non-embedding matmul parameters, LM head included) x tokens + 6 x layers x tokens x context x d:
    the parameters counted here from the built model's weight shapes, not from the formula's terms."""
    with torch.device("meta"):
        model = TransformerLM(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embeddings" not in name)
    tokens = batch * context
    return 6 * matmul * tokens + 6 * config.num_layers * tokens * context * config.d_model


def test_cli_runs_at_tiny_and_writes_the_columns(tmp_path, kernel_device):
    """The smoke scale's command (on the session's kernel device: the CPU under the interpreter, else CUDA). The
    ablation `ours-state_on_host` (cs336_systems/offload.py) takes ours' steps from the same weights and tokens: three
    steps of two passes each, so the last step's loss, after an update from state that went to the host and back, is
    ours' bit for bit (on CUDA: pinned copies on a side stream, the fetch armed in the second pass)."""
    out = tmp_path / "lb.csv"
    args = [*TINY[:-1], kernel_device, "--steps", "2", "--ablations", "ours-sdpa_attention", "ours-state_on_host",
            "--ablation-batch", "2", "--out", str(out)]
    leaderboard.main(args)
    timed, checks = pd.read_csv(out), pd.read_csv(tmp_path / "lb_check.csv")
    rows = pd.concat([checks, timed])
    required = ["provider", "step_ms", "step_std_ms", "step_median_ms", "mfu", "tflops", "peak_mem_gib", "world_size",
                "batch", "context_length", "param_dtype", "optimizer_state_dtype", "status", "run_id",
                "first_step_s", "sm_clock_mhz", "power_w", "device_name", "torch_version", "triton_version",
                "git_commit", "timestamp"]
    assert not set(required) - set(timed.columns)
    assert (checks["size"] == "check:tiny").all() and (timed["size"] == "tiny").all()  # the check's rows apart
    assert list(checks["status"]) == ["check_ok"] * 3 and list(checks["provider"]) == list(leaderboard.PROVIDERS)
    assert list(timed["provider"]) == [*leaderboard.PROVIDERS, "ours-sdpa_attention", "ours-state_on_host"]
    assert (timed["status"] == "ok").all() and (timed["step_ms"] > 0).all() and (timed["first_step_s"] > 0).all()
    assert rows["run_id"].nunique() == 1 and (timed["world_size"] == 1).all()
    assert (timed["param_dtype"] == "fp32").all() and (timed["optimizer_state_dtype"] == "fp32").all()
    config = get_config("tiny", edition="2026", context_length=24)
    assert (timed["flops"] == _documented_flops(config, 2, 24)).all()
    # TFLOP/s from the mean step time and the documented count; no datasheet peak for a CPU
    assert timed["tflops"].tolist() == pytest.approx((timed["flops"] / timed["step_ms"] / 1e9).tolist())
    if kernel_device == "cpu":  # no datasheet peak and no GPU clock for a CPU
        assert timed["mfu"].isna().all() and timed["sm_clock_mhz"].isna().all() and timed["power_w"].isna().all()
    ours = timed.set_index("provider").loc[["ours", "ours-state_on_host"]]
    assert list(ours["optimizer_state_home"]) == ["device", "host"] and (ours["microbatch"] == 1).all()
    assert ours["loss"].iloc[0] == ours["loss"].iloc[1]


def test_out_of_memory_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    real_measure = points.measure

    def measure(provider, *args):
        if provider == "torch_plain_sac":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_measure(provider, *args)

    monkeypatch.setattr(points, "measure", measure)
    out = tmp_path / "lb.csv"
    leaderboard.main([*TINY, "--check-size", "none", "--providers", "torch_plain_sac", "torch_plain_ac", "--ablations",
                      "--out", str(out)])
    rows = pd.read_csv(out).set_index("provider")
    assert rows.loc["torch_plain_sac", "status"] == "oom" and "out of memory" in rows.loc["torch_plain_sac", "error"]
    assert rows.loc["torch_plain_ac", "status"] == "ok" and rows.loc["torch_plain_ac", "step_ms"] > 0
    assert not (tmp_path / "lb.csv.partial").exists()


def test_8b_is_the_default_size_and_its_flops_are_the_documented_formula():
    config = dataclasses.replace(_tiny(), size="8B", context_length=32768)
    model_config = config.model_config()
    assert (model_config.d_model, model_config.num_layers, model_config.vocab_size) == (4096, 34, 151936)
    assert points.leaderboard_flops(model_config, 2, 32768) == _documented_flops(model_config, 2, 32768)
    assert leaderboard.LeaderboardConfig.__dataclass_fields__["size"].default == "8B"


# ---- two ranks (gloo, CPU) -----------------------------------------------------------------------------------


def _two_rank_run(rank: int, world: int, out: str) -> None:
    leaderboard.main([*TINY, "--providers", "ours", "torch_plain_sac", "--ablations", "ours-state_on_host",
                      "--steps", "2", "--data-parallel", "bucketed:1", "--out", out])


@cpu_kernels  # the interpreter only: on the GPU machines (numpy 2.5) Triton 3.6's interpreter fails in FA2's key loop
def test_two_ranks_check_and_time_the_step_with_data_parallelism(tmp_path):
    """The two-GPU step a data-parallel spec away, at smoke scale on 2 gloo ranks: each rank takes one of the two
    sequences, ours replicates with our bucketed DDP and the anchor with torch DDP; the check compares each rank's
    averaged gradients (and the ranks' mean loss) with the one-process float32 reference of the whole batch, and
    rank 0 alone writes the rows, with the world size. Ours with its optimizer state on the host runs the same
    steps: the same loss after an update from state that went to the host and back, bit for bit."""
    from tests.distributed_helpers import run_distributed
    from tests.kernel_devices import interpreter_in_child_processes

    out = tmp_path / "lb.csv"
    with interpreter_in_child_processes():
        run_distributed(_two_rank_run, 2, str(out))
    timed, checks = pd.read_csv(out), pd.read_csv(tmp_path / "lb_check.csv")
    rows = pd.concat([checks, timed])
    assert list(checks["status"]) == ["check_ok", "check_ok"], checks.get("error")
    assert list(timed["provider"]) == ["ours", "torch_plain_sac", "ours-state_on_host"]
    assert (timed["status"] == "ok").all() and timed["loss"].iloc[0] == timed["loss"].iloc[2]
    assert (rows["world_size"] == 2).all() and list(timed["data_parallel"]) == ["bucketed:1", "torch_ddp", "bucketed:1"]
    assert (timed["microbatch"] == 1).all() and rows["run_id"].nunique() == 1


def test_data_parallelism_names_what_does_not_fit():
    for overrides, message in [({"data_parallel": "fsdp"}, "a DDP kind without optimizer sharding"),
                               ({"data_parallel": "bucketed:1+sharded"}, "a DDP kind without optimizer sharding"),
                               ({"data_parallel": "bucket"}, "bucket"),
                               ({"data_parallel": "naive", "profile_dir": "x"}, "profile one rank's step")]:
        with pytest.raises(ValueError, match=message):
            _tiny(**overrides)
    with pytest.raises(ValueError, match="would each train alone"):
        leaderboard.check_world(_tiny(), 2)
    with pytest.raises(ValueError, match="batch 3 does not split into 2 equal shares"):
        leaderboard.check_world(_tiny(batches=(3,), ablation_batches=(3,), data_parallel="naive"), 2)
    # the whole share in one pass is fine; ours' one sequence at a time is not
    with pytest.raises(ValueError, match="ours-full_ac at batch 4 on 2 ranks passes 1 of its 2 sequences"):
        leaderboard.check_world(_tiny(batches=(4,), ablation_batches=(4,), providers=(), check_size="none",
                                      ablations=("ours-whole_batch", "ours-full_ac"), data_parallel="naive"), 2)


# ---- run files and their merge ---------------------------------------------------------------------------------


def test_each_run_writes_files_of_its_own_and_the_merge_quotes_the_configured_run(tmp_path):
    """`{run_id}` in --out and --check-out: two runs, two timing files and two check files (the check's rows apart
    from the timing rows); the merge orders the runs by timestamp and marks per batch the quoted run: the latest, or
    the latest of the listed ones; a listed run id no run has is an error naming it."""
    from cs336_systems.bench import merge

    runs = tmp_path / "runs"
    args = [*TINY, "--providers", "torch_plain_ac", "--ablations", "--out", str(runs / "lb" / "{run_id}.csv"),
            "--check-out", str(runs / "lb_check" / "{run_id}.csv")]
    leaderboard.main(args)
    leaderboard.main(args)
    files = sorted((runs / "lb").glob("*.csv"))
    assert len(files) == 2 and sorted(p.name for p in (runs / "lb_check").glob("*.csv")) == [p.name for p in files]
    for path in files:
        timed, checks = pd.read_csv(path, dtype={"run_id": str}), pd.read_csv(runs / "lb_check" / path.name)
        assert list(timed["status"]) == ["ok"] and list(checks["status"]) == ["check_ok"]
        assert timed["run_id"].iloc[0] == path.stem and "check_grad_err" not in timed and "step_ms" not in checks
    first, last = (pd.read_csv(p, dtype={"run_id": str}) for p in files)
    if first["timestamp"].iloc[0] > last["timestamp"].iloc[0]:
        first, last = last, first
    latest = merge.merge([str(p) for p in files], "timestamp", ("latest",), ("batch",))
    assert list(latest["run_id"]) == [first["run_id"].iloc[0], last["run_id"].iloc[0]]
    assert list(latest["quoted"]) == [False, True]
    pinned = merge.merge([str(p) for p in files], "timestamp", (first["run_id"].iloc[0][:6],), ("batch",))
    assert list(pinned["quoted"]) == [True, False]
    with pytest.raises(ValueError, match="no run 'abcdef'"):
        merge.merge([str(p) for p in files], "timestamp", ("abcdef",), ("batch",))


# ---- the leaderboard's own timing (handout_timer) ----------------------------------------------------------


def test_do_bench_times_the_handouts_step_from_empty_caches(tmp_path, monkeypatch, kernel_device):
    """--timer do_bench runs the whole point inside new empty compilation caches (removed after) and hands the step
    to triton.testing.do_bench (here a stand-in that calls it as do_bench does and returns made-up times); the row's
    step times are do_bench's, the first call is timed apart, and run_wall_s counts from the process's start. On the
    session's kernel device (the CPU under the interpreter, else CUDA: ours runs Triton kernels). Off CUDA the
    command line refuses the timer, naming it."""
    import triton.testing

    from cs336_systems.bench.leaderboard import cli, handout_timer

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "warm_cache"))
    seen = {}

    def caches_now() -> dict[str, str]:
        return {name: os.environ[name] for name in handout_timer.CACHE_VARIABLES}

    def point_in_caches(*args, **kwargs):
        # empty when the point starts (not when do_bench starts: on CUDA the memory probe's first step compiles before)
        seen["empty"] = not any(os.path.exists(path) and os.listdir(path) for path in caches_now().values())
        return run_point(*args, **kwargs)

    def do_bench(fn, warmup, rep, return_mode):
        seen.update(warmup=warmup, rep=rep, return_mode=return_mode, caches=caches_now())
        for _ in range(3):  # the first call (compiling), then two timed ones
            fn()
        return [3.0, 5.0]

    run_point = cli.run_point
    monkeypatch.setattr(cli, "run_point", point_in_caches)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    out = tmp_path / "lb.csv"
    started = handout_timer.process_age_s()
    leaderboard.run(_tiny(timer="do_bench", cold_cache=True, providers=(), ablations=("ours-sdpa_attention",),
                          check_size="none", do_bench_warmup_ms=7, do_bench_rep_ms=11, device=kernel_device), out)
    row = pd.read_csv(out).iloc[0]
    assert seen["warmup"] == 7 and seen["rep"] == 11 and seen["return_mode"] == "all" and seen["empty"]
    assert all(str(tmp_path / "warm_cache") != path for path in seen["caches"].values())
    assert not any(os.path.exists(path) for path in seen["caches"].values())  # removed after the run
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "warm_cache")  # and the caller's setting restored
    assert row["timer"] == "do_bench" and row["status"] == "ok" and bool(row["cold_cache"])
    assert (row["step_ms"], row["step_median_ms"], row["n_steps"]) == (4.0, 4.0, 2)
    assert pd.isna(row["warmup"]) and (row["do_bench_warmup_ms"], row["do_bench_rep_ms"]) == (7, 11)
    assert row["first_step_s"] > 0 and row["run_wall_s"] >= started and math.isfinite(row["loss"])
    monkeypatch.setattr(argparse.ArgumentParser, "exit", lambda self, status=0, message=None: (_ for _ in ()).throw(
        ValueError(message)))
    with pytest.raises(ValueError, match="--timer do_bench on device 'cpu'"):
        leaderboard.main([*TINY, "--timer", "do_bench", "--out", str(tmp_path / "refused.csv")])


def test_the_merge_fills_older_runs_timer_and_quotes_each_timer_apart(tmp_path):
    """Runs older than the `timer` column are the bench's loop (--default timer=steps); the quoted run is chosen per
    (batch, timer), so a later do_bench run does not displace the latest run of the bench's own timer."""
    from cs336_systems.bench import merge

    files = []
    for i, extra in enumerate([{}, {"timer": "steps"}, {"timer": "do_bench"}]):
        path = tmp_path / f"run{i}.csv"
        pd.DataFrame([{"run_id": f"r{i}", "batch": 2, "timestamp": f"2026-12-0{i + 1}", **extra}]).to_csv(path)
        files.append(str(path))
    frame = merge.merge(files, "timestamp", ("latest",), ("batch", "timer"), {"timer": "steps"})
    assert list(frame["timer"]) == ["steps", "steps", "do_bench"]
    assert list(frame["quoted"]) == [False, True, True]
    with pytest.raises(SystemExit):
        merge.main([*files, "--out", str(tmp_path / "all.csv"), "--default", "timer"])
