"""Activation checkpointing (handout 2026 §3): the policy machinery against the unchecked model, the
saved-tensor accounting against hand-derived cases, the cost model against hand-worked numbers, the
sweep CLI, and the 2026 size table."""

import contextlib
import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems.bench import checkpointing as sweep
from cs336_systems.bench.saved_tensors import Setting, measure_case, record_saved_tensors, saved_bytes
from cs336_systems.model import (
    MODEL_SIZES,
    MODEL_SIZES_2026,
    CheckpointPolicy,
    ModelConfig,
    TransformerLM,
    apply_activation_checkpointing,
    checkpoint_cost,
    cross_entropy,
    get_config,
)
from cs336_systems.model.checkpointing import divisor_policies

# Five layers so that segment sizes 2 and 3 do not divide the stack.
FIVE = ModelConfig(d_model=32, d_ff=64, num_layers=5, num_heads=4, vocab_size=53, context_length=16)


# ---- policy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["none", "every:1", "every:3", "nested:4,2", "nested:3,2,1"])
def test_policy_round_trips_through_its_text(text):
    assert str(CheckpointPolicy.parse(text)) == text


@pytest.mark.parametrize("text", ["every:0", "every:2,1", "nested:2,2", "nested:2,4", "every:x", "sqrt", "none:3"])
def test_bad_policy_text_is_an_error_naming_it(text):
    with pytest.raises(ValueError, match="segment|policy"):
        CheckpointPolicy.parse(text)


def test_policy_longer_than_the_model_is_rejected():
    with pytest.raises(ValueError, match="every:6.*5 layers"):
        apply_activation_checkpointing(TransformerLM(FIVE), CheckpointPolicy.every(6))


def test_binary_and_sqrt_policies():
    assert CheckpointPolicy.binary(32).segments == (16, 8, 4, 2, 1)
    assert CheckpointPolicy.binary(5).segments == (3, 2, 1)
    assert CheckpointPolicy.sqrt(27).segments == (9, 3)


def test_divisor_policies():
    assert [str(p) for p in divisor_policies(6)] == ["none", "every:1", "every:2", "every:3", "every:6"]


# ---- gradients and saved tensors of the checkpointed model --------------------------------------------

POLICIES = ["none", "every:1", "every:2", "every:3", "every:5", "nested:4,2", "nested:3,2,1"]


@pytest.fixture(scope="module")
def reference():
    """The unchecked model's loss and gradients on one batch."""
    torch.manual_seed(0)
    model = TransformerLM(FIVE)
    tokens = torch.randint(FIVE.vocab_size, (2, FIVE.context_length + 1))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return model, tokens, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_the_unchecked_model(reference, policy):
    """Recomputation on the CPU runs the same kernels on the same inputs, so the gradients are bitwise
    equal, not merely close."""
    model, tokens, ref_loss, ref_grads = reference
    checked = apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy.parse(policy))
    checked.zero_grad(set_to_none=True)
    loss = cross_entropy(checked(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert torch.equal(loss, ref_loss)
    for name, param in checked.named_parameters():
        assert torch.equal(param.grad, ref_grads[name]), name


def _forward_saves(model, tokens):
    out, records = record_saved_tensors(model, tokens[:, :-1], parameters=model.parameters())
    return out, records


@pytest.mark.parametrize("policy", POLICIES)
def test_saved_tensors_drop_to_one_checkpoint_per_outer_segment(reference, policy):
    """The forward saves what the plain model saves outside the blocks, plus for each outermost segment
    what one checkpoint call saves (nothing of the blocks inside); the blocks' own saves come back
    only in the backward. The per-block and per-checkpoint counts are measured on one block alone."""
    model, tokens, _, _ = reference
    policy = CheckpointPolicy.parse(policy)
    block = model.layers[0]
    x = torch.randn(2, FIVE.context_length, FIVE.d_model, requires_grad=True)
    args = (model.rope, torch.arange(FIVE.context_length))
    _, per_block = record_saved_tensors(block, x, *args)
    # a checkpoint call of a function of x alone, as run_blocks makes them (the rest travel in its closure)
    _, per_checkpoint = record_saved_tensors(
        lambda x: torch.utils.checkpoint.checkpoint(lambda x: block(x, *args), x, use_reentrant=False), x)
    plain = apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy())
    _, plain_records = _forward_saves(plain, tokens)
    outside = len(plain_records) - FIVE.num_layers * len(per_block)
    checked = apply_activation_checkpointing(copy.deepcopy(model), policy)
    _, records = _forward_saves(checked, tokens)
    if policy.segments:
        expected = outside + math.ceil(FIVE.num_layers / policy.segments[0]) * len(per_checkpoint)
        assert len(per_checkpoint) < len(per_block)
    else:
        expected = len(plain_records)
    assert len(records) == expected


# Forward calls of each of the five blocks in one training step, worked by hand. Non-reentrant checkpoint
# stops recomputing a segment once everything its forward saved is back, so the last inner segment of a
# recomputed segment is not rerun at that level: nested:4,2 reruns blocks 0-1 (then each inner segment)
# for the segment of blocks 0-3, and the lone block 4 only in its own inner segment.
BLOCK_CALLS = {"none": [1] * 5, "every:1": [2] * 5, "every:2": [2] * 5, "every:3": [2] * 5, "every:5": [2] * 5,
               "nested:4,2": [3, 3, 2, 2, 2], "nested:3,2,1": [4, 3, 2, 3, 2]}


@pytest.mark.parametrize("policy", POLICIES)
def test_block_reruns_match_hand_count_and_cost_model(reference, policy):
    model, tokens, _, _ = reference
    checked = apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy.parse(policy))
    calls = [0] * FIVE.num_layers
    for i, block in enumerate(checked.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
    cross_entropy(checked(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert calls == BLOCK_CALLS[policy]
    assert sum(calls) == checkpoint_cost(CheckpointPolicy.parse(policy), FIVE.num_layers, 1.0, 1.0).block_forwards


def test_no_grad_forward_ignores_the_policy(reference):
    model, tokens, _, _ = reference
    checked = apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy.every(2))
    with torch.no_grad():
        assert torch.equal(checked(tokens[:, :-1]), model(tokens[:, :-1]))


# ---- saved-tensor accounting on hand-derivable cases ----------------------------------------------------


def test_linear_saves_its_input_and_its_weight():
    linear = torch.nn.Linear(5, 7, bias=False)
    x = torch.randn(3, 5, requires_grad=True)
    _, records = record_saved_tensors(linear, x, parameters=linear.parameters())
    totals = saved_bytes(records)
    assert totals["input"] == {"count": 1, "tensor_bytes": 3 * 5 * 4, "storage_bytes": 3 * 5 * 4}
    assert totals["parameter"] == {"count": 1, "tensor_bytes": 7 * 5 * 4, "storage_bytes": 7 * 5 * 4}
    assert totals["activation"]["count"] == 0


def test_product_saves_both_factors_and_views_count_once_per_storage():
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    totals = saved_bytes(record_saved_tensors(lambda x, y: x * y, x, y)[1])
    assert totals["input"] == {"count": 2, "tensor_bytes": 24 * 4 + 24 * 8, "storage_bytes": 24 * 4 + 24 * 8}
    # two strided halves of x: each packed tensor is half of x, the storage they keep alive is all of x
    totals = saved_bytes(record_saved_tensors(lambda x: x[:, ::2] * x[:, 1::2], x)[1])
    assert totals["input"] == {"count": 2, "tensor_bytes": 2 * 12 * 4, "storage_bytes": 24 * 4}


def test_intermediate_results_are_activations():
    """sin saves its input (here x*2, made in the forward); exp saves its output."""
    x = torch.randn(10, requires_grad=True)
    totals = saved_bytes(record_saved_tensors(lambda x: torch.sin(x * 2).exp(), x)[1])
    assert totals["activation"] == {"count": 2, "tensor_bytes": 80, "storage_bytes": 80}
    assert totals["input"]["count"] == 0  # x*2 saves no tensor: its gradient is a constant times the incoming one


def test_rmsnorm_eager_matches_the_handouts_list():
    """Handout §3.1: eager RMSNorm saves x twice, rsqrt's result twice, x*rms and the weight."""
    s = Setting(batch_size=2, d_model=24, norm_context_length=5)
    totals = saved_bytes(measure_case("rmsnorm", "eager", s, torch.device("cpu")))
    full, row = 2 * 5 * 24 * 4, 2 * 5 * 1 * 4
    assert totals["input"] == {"count": 2, "tensor_bytes": 2 * full, "storage_bytes": full}
    assert totals["activation"] == {"count": 3, "tensor_bytes": full + 2 * row, "storage_bytes": full + row}
    assert totals["parameter"] == {"count": 1, "tensor_bytes": 24 * 4, "storage_bytes": 24 * 4}


def test_rmsnorm_compiled_saves_only_its_input_weight_and_rms():
    """Handout §3.1.1: fused by torch.compile, RMSNorm saves x, the weight and rms of shape (B, T, 1)."""
    s = Setting(batch_size=2, d_model=24, norm_context_length=5)
    totals = saved_bytes(measure_case("rmsnorm", "compiled", s, torch.device("cpu")))
    assert totals["input"]["tensor_bytes"] == 2 * 5 * 24 * 4
    assert totals["activation"]["tensor_bytes"] == 2 * 5 * 4
    assert totals["parameter"]["tensor_bytes"] == 24 * 4


# ---- cost model -----------------------------------------------------------------------------------------


def test_cost_model_on_hand_worked_cases():
    A, c = 10.0, 1.0  # one block's residuals, one stored block input
    cost = lambda text: checkpoint_cost(CheckpointPolicy.parse(text), 12, A, c)  # noqa: E731
    assert cost("none").peak_bytes == 120 and cost("none").block_forwards == 12
    assert cost("every:3").peak_bytes == 4 * c + 3 * A and cost("every:3").stored_bytes == 4 * c
    # segments 5, 5, 2: backpropagating the second segment holds two inputs and five blocks
    assert cost("every:5").peak_bytes == 2 * c + 5 * A
    # two outer inputs, then three inner inputs and one 2-block segment
    assert cost("nested:6,2").peak_bytes == 2 * c + 3 * c + 2 * A
    # forward 12; each outer segment reruns blocks 1-4 of its 6, then each 2-block inner segment
    assert cost("nested:6,2").block_forwards == 12 + 2 * (4 + 6)


def test_every_k_is_best_near_sqrt_n_when_a_stored_input_weighs_a_block():
    for n in (16, 36, 64):
        divisors = [k for k in range(1, n + 1) if n % k == 0]
        best = min(divisors, key=lambda k: checkpoint_cost(CheckpointPolicy.every(k), n, 1, 1).peak_bytes)
        assert best == math.isqrt(n)


# ---- sweep CLI ------------------------------------------------------------------------------------------


def test_sweep_writes_one_row_per_policy(tmp_path):
    out = tmp_path / "ckpt.csv"
    sweep.main(["--size", "tiny", "--context-length", "8", "--batch-size", "1", "--precision", "fp32",
                "--policies", "divisors", "nested:2,1", "--warmup", "0", "--steps", "1", "--device", "cpu",
                "--out", str(out)])
    import pandas as pd

    rows = pd.read_csv(out)
    assert list(rows["policy"]) == ["none", "every:1", "every:2", "nested:2,1"]
    assert (rows["status"] == "ok").all() and (rows["size_table"] == 2026).all()
    assert rows["peak_memory_mib"].isna().all()  # no allocator peak on a CPU
    # nested:2,1 reruns block 0 at the outer level (block 1 only in its own inner segment)
    assert list(rows["block_forwards"]) == [2, 4, 4, 5]


def test_sweep_records_out_of_memory_and_goes_on(tmp_path, monkeypatch):
    real = sweep.measure

    def measure(spec, policy):
        if policy.segments == (2,):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(spec, policy)

    monkeypatch.setattr(sweep, "measure", measure)
    out = tmp_path / "ckpt.csv"
    sweep.main(["--size", "tiny", "--context-length", "8", "--batch-size", "1", "--precision", "fp32",
                "--policies", "every:2", "every:1", "--warmup", "0", "--steps", "1", "--device", "cpu",
                "--out", str(out)])
    import pandas as pd

    rows = pd.read_csv(out)
    assert list(rows["status"]) == ["oom", "ok"]
    assert "out of memory" in rows["error"][0]


# ---- the 2026 size table --------------------------------------------------------------------------------


def test_2026_table_is_the_handouts():
    shape = lambda c: (c.d_model, c.d_ff, c.num_layers, c.num_heads)  # noqa: E731
    assert shape(get_config("xl", "2026")) == (2560, 10240, 32, 32)
    assert shape(get_config("10B", "2026")) == (4608, 12288, 50, 36)
    assert get_config("xl", "2026") == MODEL_SIZES["2.7B"]
    assert {"small", "medium", "large", "xl", "10B"} <= set(MODEL_SIZES_2026)


def test_2025_names_are_unchanged():
    assert get_config("xl") == MODEL_SIZES["xl"] and get_config("xl").d_model == 1600
    assert get_config("xl", "2025").num_layers == 48


def test_unknown_edition_or_size_in_an_edition_is_an_error():
    with pytest.raises(ValueError, match="edition '2024'"):
        get_config("xl", "2024")
    with pytest.raises(ValueError, match="'2.7B' in the 2026 table"):
        get_config("2.7B", "2026")


def test_recursive_halving_peak_is_logarithmic():
    """With a stored input weighing a block, each of the log2(N) levels holds at most two inputs, plus one
    block's residuals at the bottom: 2 log2(N) + 1 blocks; each level reruns each block at most once."""
    for m in (3, 5, 10):
        n = 2**m
        cost = checkpoint_cost(CheckpointPolicy.binary(n), n, 1.0, 1.0)
        assert cost.peak_bytes == 2 * m + 1
        assert n * 2 <= cost.block_forwards <= n * (1 + m)


def test_cost_model_of_selective_policies():
    """Selective: kept blocks store their residuals, the others their input plus attention outputs (the
    caller's boundary) and are rerun once each; the backward holds one rerun block's residuals more."""
    A, c = 10.0, 1.5
    cost = checkpoint_cost(CheckpointPolicy.selective(), 12, A, c)
    assert (cost.stored_bytes, cost.peak_bytes, cost.block_forwards) == (12 * c, 12 * c + A, 24)
    cost = checkpoint_cost(CheckpointPolicy.selective(4), 12, A, c)
    assert (cost.stored_bytes, cost.peak_bytes, cost.block_forwards) == (4 * A + 8 * c, 4 * A + 8 * c + A, 20)
    everything = checkpoint_cost(CheckpointPolicy.selective(12), 12, A, c)
    assert everything == checkpoint_cost(CheckpointPolicy(), 12, A, c)


@pytest.mark.parametrize("text", ["selective", "selective:2", "selective:0,4", "selective:2,3"])
def test_selective_policy_round_trips_and_rejects_segments(text):
    assert str(CheckpointPolicy.parse(text)) == text
    with pytest.raises(ValueError, match="selective or has segments, not both"):
        CheckpointPolicy(segments=(2,), keep_blocks=0)


def test_matmul_saving_policy_errors_name_the_value():
    assert CheckpointPolicy.parse("selective:0,4") == CheckpointPolicy.selective(0, 4)
    with pytest.raises(ValueError, match="only a selective policy saves matmul outputs"):
        CheckpointPolicy(segments=(2,), matmul_blocks=1)
    with pytest.raises(ValueError, match="non-negative number of blocks, got -1"):
        CheckpointPolicy.selective(0, -1)
    with pytest.raises(ValueError, match="keeps 2 blocks and saves the matmuls of 3"):
        CheckpointPolicy.selective(2, 3).check(4)
    with pytest.raises(ValueError, match="does not model blocks that save their matmul outputs"):
        checkpoint_cost(CheckpointPolicy.selective(0, 1), 4, 1.0, 1.0)


def test_matmul_blocks_that_fit_fill_the_free_memory_and_no_more():
    from cs336_systems.model.checkpointing import matmul_block_bytes, matmul_blocks_that_fit

    gib = 2**30
    block = matmul_block_bytes(4096, 11008, 32768, 2)  # the 8B model at batch 1 x 32768, bf16
    assert round(block / gib, 2) == 2.34
    assert matmul_blocks_that_fit(10 * block - 1, block, 34) == 9
    assert matmul_blocks_that_fit(10 * block, block, 34) == 10
    assert matmul_blocks_that_fit(1000 * block, block, 34) == 34
    assert matmul_blocks_that_fit(-5.0, block, 34) == matmul_blocks_that_fit(float("nan"), block, 34) == 0
    with pytest.raises(ValueError, match="positive number of bytes, got 0"):
        matmul_blocks_that_fit(1.0, 0, 34)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.name() in ("aten::mm", "aten::addmm")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True])
def test_switching_selective_policies_between_passes(reference, compiled):
    """`switch_selective` changes which blocks save their matmul outputs in place, between passes, and the step
    follows: eagerly, fewer matmul-saving blocks rerun more GEMMs in the backward; compiled, the forward saves less
    (the compiled graph's saved tensors, which the hooks see). The gradients stay the unchecked model's (bitwise
    eagerly on the CPU; to float32 rounding compiled), and a compiled block, having met both classes, compiles
    nothing when switched back. A segment policy cannot be switched."""
    from torch._dynamo.utils import counters

    from cs336_systems.model.checkpointing import switch_selective

    model, tokens, ref_loss, ref_grads = reference
    torch._dynamo.reset()
    checked = apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy.selective(0, 4))
    if compiled:
        for block in checked.layers:
            block.compile(backend="aot_eager")

    def cost(policy):
        """Saved bytes (compiled) or matmul calls of the step (eager) under `policy`; gradients checked."""
        switch_selective(checked, policy)
        checked.zero_grad(set_to_none=True)
        matmuls = _CountMatmuls()
        with matmuls if not compiled else contextlib.nullcontext():
            out, records = _forward_saves(checked, tokens)
            loss = cross_entropy(out, tokens[:, 1:])
            loss.backward()
        close = torch.equal if not compiled else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert close(loss, ref_loss)
        for name, param in checked.named_parameters():
            assert close(param.grad, ref_grads[name]), name
        return -matmuls.calls if not compiled else sum(kind["storage_bytes"] for kind in saved_bytes(records).values())

    many = cost(CheckpointPolicy.selective(0, 4))
    fewer = cost(CheckpointPolicy.selective(0, 1))
    graphs = counters["stats"]["unique_graphs"]
    again = cost(CheckpointPolicy.selective(0, 4))
    assert fewer < many == again
    if compiled:
        assert counters["stats"]["unique_graphs"] == graphs  # both versions kept: nothing new compiled
    with pytest.raises(ValueError, match="segment policy"):
        switch_selective(apply_activation_checkpointing(copy.deepcopy(model), CheckpointPolicy.every(2)),
                         CheckpointPolicy.selective())
