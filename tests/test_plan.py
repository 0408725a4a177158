"""The typed parallel plan and the 8B step's code paths at a tiny size on the CPU (issues 24 and 27):
the plan's text form; selective checkpointing saves the attention operator's outputs and recomputes
the rest; our step (fused LM head + CE, selective checkpointing, compiled blocks, the Triton attention
under the interpreter) against the plain model (eager, no checkpointing, plain cross-entropy, naive
attention) in fp32 and bf16; and the same plan with two gloo ranks, bf16 replicas (bucketed all-reduce)
and our FSDP, against one process."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.distributed import DataParallelSpec, ParallelPlan, parallelize
from cs336_systems.distributed.common import broadcast_from_rank0
from cs336_systems.model import CheckpointPolicy, TransformerLM, get_config, register_attention
from cs336_systems.model.attention import naive_attention
from cs336_systems.model.checkpointing import save_op_outputs
from cs336_systems.optim import AdamW
from cs336_systems.train_step import lm_loss
from tests.distributed_helpers import run_distributed, seed

# Three layers, vocab and d_ff not powers of two; head_dim 16 (the Triton kernel's smallest).
CONFIG = get_config("tiny", vocab_size=37, d_ff=72, num_layers=3, context_length=16)
AOT_EAGER = dict(backend="aot_eager", fullgraph=True)  # captures the graphs; no C++ compiler on CPU


# ---- the plan's text -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["compile=none checkpoint=none dp=none",
                                  "compile=blocks checkpoint=selective dp=bucketed:1",
                                  "compile=model checkpoint=selective:2 dp=torch_fsdp2",
                                  "compile=none checkpoint=nested:4,2 dp=fsdp"])
def test_plan_round_trips_through_its_text(text):
    plan = ParallelPlan.parse(text)
    assert str(plan) == text and ParallelPlan.parse(str(plan)) == plan
    assert plan.to_columns()["plan"] == text


def test_plan_parts_parse_in_any_order_with_defaults():
    plan = ParallelPlan.parse("dp=bucketed:1 checkpoint=selective")
    assert plan == ParallelPlan(compile="none", checkpoint=CheckpointPolicy.selective(),
                                data_parallel=DataParallelSpec("bucketed", 1.0))
    assert ParallelPlan.parse("") == ParallelPlan()


@pytest.mark.parametrize("text, message", [
    ("compile=all", "unknown compile scope 'all'"),
    ("checkpoint=selective:x", "sizes must be integers"),
    ("dp=ring", "unknown data-parallel kind 'ring'"),
    ("compile=blocks dp=fsdp", "compile=blocks with dp=fsdp"),
    ("compile=none compile=blocks", "compile given twice"),
    ("mode=fast", "'mode=fast' is not KEY=VALUE"),
])
def test_bad_plans_name_the_text(text, message):
    with pytest.raises(ValueError, match=f"bad parallel plan '{text}'.*{message}"):
        ParallelPlan.parse(text)


def test_selective_policy_text_and_bounds():
    assert str(CheckpointPolicy.parse("selective")) == "selective"
    assert CheckpointPolicy.parse("selective:2") == CheckpointPolicy.selective(2)
    with pytest.raises(ValueError, match="keeps 4 blocks, more than the model's 3 layers"):
        parallelize(TransformerLM(CONFIG), ParallelPlan(checkpoint=CheckpointPolicy.selective(4)), "cpu")


# ---- selective checkpointing ---------------------------------------------------------------------------

CALLS = []


@torch.library.custom_op("test_plan::counted_attention", mutates_args=())
def _counted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    CALLS.append(1)
    return naive_attention(q, k, v, True)


@_counted_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _counted_backward(ctx, grad_out):
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        return torch.autograd.grad(naive_attention(q, k, v, True), (q, k, v), grad_out)


_counted_attention.register_autograd(
    _counted_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
register_attention("test_counted", lambda q, k, v, is_causal: _counted_attention(q, k, v))
save_op_outputs("test_plan::counted_attention")


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("compile_scope", ["none", "blocks"])
# nested:2,1 on 3 blocks: segments [0, 1] and [2]; each outer one reruns all but its last inner segment
# (block 0; none), then each inner segment is rerun (blocks 0, 1; block 2): 3 + 1 + 3
@pytest.mark.parametrize("policy, attention_calls", [("none", 3), ("every:1", 6), ("selective", 3),
                                                     ("selective:1", 3), ("selective:0,3", 3), ("selective:1,1", 3),
                                                     ("nested:2,1", 7)])
def test_selective_checkpointing_saves_the_attention_operator(compile_scope, policy, attention_calls):
    """Attention forwards in one step (3 layers): every:1 reruns each block's attention in the backward;
    selective reruns each block but takes the attention's output from what it saved; the gradients equal
    the plain model's (bitwise eagerly: the same kernels on the same inputs)."""
    torch.manual_seed(seed(0))
    config = CONFIG.replace(attention="test_counted")
    plain = TransformerLM(config)
    model = copy.deepcopy(plain)
    tokens = torch.randint(config.vocab_size, (2, 17))
    lm_loss(plain, tokens[:, :-1], tokens[:, 1:], fused=False).backward()
    plan = ParallelPlan(compile=compile_scope, checkpoint=CheckpointPolicy.parse(policy))
    wrapped = parallelize(model, plan, "cpu", compile_options=AOT_EAGER)
    CALLS.clear()
    lm_loss(wrapped, tokens[:, :-1], tokens[:, 1:], fused=False).backward()
    assert len(CALLS) == attention_calls
    for name, grad in _grads(model).items():
        if compile_scope == "none":
            assert torch.equal(grad, plain.get_parameter(name).grad), name
        else:
            torch.testing.assert_close(grad, plain.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)


def _backward_matmul_flops(policy: str, seed_: int) -> int:
    torch.manual_seed(seed_)
    model = TransformerLM(CONFIG.replace(attention="test_counted"))  # saved by every selective block
    tokens = torch.randint(CONFIG.vocab_size, (2, 17))
    wrapped = parallelize(model, ParallelPlan(checkpoint=CheckpointPolicy.parse(policy)), "cpu")
    loss = lm_loss(wrapped, tokens[:, :-1], tokens[:, 1:], fused=False)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_matmul_saving_blocks_skip_the_recomputed_gemms():
    """The backward's matmul FLOPs: selective reruns every block's projections and MLP GEMMs (all but w2,
    which torch's early stop skips); a block that saves its matmul outputs reruns none of them, so saving
    all three blocks' costs exactly what no checkpointing costs, and each block's share is the same."""
    s = seed(3)
    none, selective = _backward_matmul_flops("none", s), _backward_matmul_flops("selective", s)
    per_block = (selective - none) / CONFIG.num_layers
    d, d_ff, tokens = CONFIG.d_model, CONFIG.d_ff, 2 * 16
    assert per_block == 2 * tokens * (4 * d * d + 2 * d * d_ff)  # q, k, v, output; w1, w3
    assert _backward_matmul_flops("selective:0,3", s) == none
    assert _backward_matmul_flops("selective:1,1", s) == none + per_block


def test_checkpointing_keeps_parameter_names_and_can_be_replaced():
    model = TransformerLM(CONFIG)
    names = [name for name, _ in model.named_parameters()]
    state = model.state_dict()
    for text in ("selective:1", "every:2", "selective", "none"):
        from cs336_systems.model import apply_activation_checkpointing

        apply_activation_checkpointing(model, CheckpointPolicy.parse(text))
        assert [name for name, _ in model.named_parameters()] == names
        assert model.state_dict().keys() == state.keys()
    assert all(type(block).__name__ == "TransformerBlock" for block in model.layers)


def test_forward_is_the_lm_head_of_hidden_and_lm_loss_paths_agree(kernel_device):
    torch.manual_seed(seed(5))
    model = TransformerLM(CONFIG, device=kernel_device)
    tokens = torch.randint(CONFIG.vocab_size, (3, 12), device=kernel_device)
    hidden = model.hidden(tokens)
    assert hidden.shape == (3, 12, CONFIG.d_model)
    assert torch.equal(model(tokens), hidden @ model.lm_head.weight.T)
    x, y = tokens[:, :-1], tokens[:, 1:]
    expected = torch.nn.functional.cross_entropy(model(x).double().reshape(-1, CONFIG.vocab_size), y.reshape(-1))
    for loss in (lm_loss(model, x, y), lm_loss(model, x, y, fused=False), model(x, targets=y)):
        torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


# ---- our step against the plain model ----------------------------------------------------------------


def _relative_errors(model, loss, reference, ref_loss) -> dict[str, float]:
    """Max abs error over the max abs of the float64 reference: the loss and every gradient."""
    errors = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for name, grad in _grads(model).items():
        want = reference.get_parameter(name).grad
        errors[name] = ((grad.double() - want).abs().max() / want.abs().max()).item()
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_step_matches_the_plain_model(dtype, kernel_device):
    """The 8B step's code paths at a tiny size: parameters built in `dtype`, the Triton attention (under
    the interpreter, which cannot multiply bf16: SDPA there, whose CPU kernel is the operator the
    selective policy saves), selective checkpointing inside compiled blocks, the fused LM head + CE; the plain
    model is the same weights run eagerly with naive attention and the plain cross-entropy. Both against
    float64 (the same weights, upcast): fp32 to float32 rounding (1e-5 of each gradient's largest
    element); bf16 within twice the plain bf16 model's own error: its largest over the loss and the
    gradients (about 2% of a gradient's largest element here; an error of a single gradient varies
    with where rounding lands, up to 2x either way between the two models)."""
    torch.manual_seed(seed(1))
    attention = "flash_triton" if dtype == torch.float32 or kernel_device == "cuda" else "sdpa"
    ours_model = TransformerLM(CONFIG.replace(attention=attention), dtype=dtype, device=kernel_device)
    plain = TransformerLM(CONFIG, dtype=dtype, device=kernel_device)
    plain.load_state_dict(ours_model.state_dict())
    reference = copy.deepcopy(plain).double()
    tokens = torch.randint(CONFIG.vocab_size, (2, 17), device=kernel_device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    plan = ParallelPlan.parse("compile=blocks checkpoint=selective")
    ours = parallelize(ours_model, plan, kernel_device, compile_options=AOT_EAGER)
    loss = lm_loss(ours, x, y)
    loss.backward()
    plain_loss = lm_loss(plain, x, y, fused=False)
    plain_loss.backward()
    ref_loss = lm_loss(reference, x, y, fused=False)
    ref_loss.backward()
    assert loss.dtype == torch.float32 and all(p.grad.dtype == dtype for p in ours_model.parameters())
    ours_err = _relative_errors(ours_model, loss, reference, ref_loss)
    plain_err = _relative_errors(plain, plain_loss, reference, ref_loss)
    bound = 1e-5 if dtype == torch.float32 else 2 * max(plain_err.values())
    for name, error in ours_err.items():
        assert error <= bound, (name, error, plain_err[name])


# ---- two ranks ---------------------------------------------------------------------------------------

PLAN_DP = ("bucketed:1", "fsdp")


def _shard_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of a weight as our FSDP cuts them: ceil(rows / world) each, the last block padded."""
    rows = -(-full.shape[0] // world)
    padded = torch.cat([full, full.new_zeros(rows * world - full.shape[0], *full.shape[1:])])
    return padded[rank * rows:(rank + 1) * rows]


def _two_ranks_match_one_process(rank: int, world: int) -> None:
    """bf16 replicas: each rank its half of the batch; after the backward and the wrapper's
    synchronisation, every gradient (ours: the rank's rows of it under FSDP) equals one process's on the
    whole batch to bf16 rounding (4 units of 2^-8 of each gradient's largest element: the halves' sums
    and their average round apart from one sum), and AdamW (fp32 moments) takes a step."""
    for dp in PLAN_DP:
        plan = ParallelPlan.parse(f"compile=none checkpoint=selective dp={dp}")
        torch.manual_seed(seed(100) + rank)  # ranks start apart; the wrappers broadcast rank 0's weights
        model = TransformerLM(CONFIG.replace(attention="sdpa"), dtype=torch.bfloat16)
        broadcast_from_rank0(model)
        reference = copy.deepcopy(model)
        wrapped = parallelize(model, plan, "cpu")
        # foreach AdamW and the plain loss: the ranks test the plan's data parallelism, not the kernels, so they
        # need no Triton interpreter (whose NumPy use breaks on NumPy >= 2.4, which a GPU image may carry)
        optimizer = AdamW(wrapped.parameters(), lr=1e-2, foreach=True, state_dtype=torch.float32)
        tokens = torch.randint(CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed(7)))
        mine = tokens.chunk(world)[rank]
        wrapped.on_train_batch_start()
        optimizer.zero_grad(set_to_none=True)
        lm_loss(wrapped, mine[:, :-1], mine[:, 1:], fused=False).backward()
        wrapped.finish_gradient_synchronization()
        lm_loss(reference, tokens[:, :-1], tokens[:, 1:], fused=False).backward()
        sharded = {id(unit.shard) for unit in getattr(wrapped, "sharded_weights", ())}
        for name, p in model.named_parameters():
            want = reference.get_parameter(name).grad
            if id(p) in sharded:
                want = _shard_rows(want, rank, world)
            assert p.grad.dtype == torch.bfloat16 and p.grad.shape == want.shape, (dp, name)
            error = ((p.grad.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert error <= 4 * 2**-8, (dp, name, error)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), dp


def test_two_ranks_with_the_same_plan_match_one_process():
    run_distributed(_two_ranks_match_one_process, 2)


def test_cli_helpers_build_the_plan():
    import argparse

    from cs336_systems.distributed.parallelize import add_plan_arguments, plan_from_args

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--compile", "blocks", "--checkpoint", "selective:1", "--data-parallel", "bucketed:1"])
    assert str(plan_from_args(args)) == "compile=blocks checkpoint=selective:1 dp=bucketed:1"
    assert plan_from_args(parser.parse_args([])) == ParallelPlan()
    own = argparse.ArgumentParser()
    add_plan_arguments(own, data_parallel_flag=None)  # a CLI with its own spec flag (train.py's --wrapper)
    plan = plan_from_args(own.parse_args(["--checkpoint", "every:2"]), DataParallelSpec.parse("fsdp"))
    assert str(plan) == "compile=none checkpoint=every:2 dp=fsdp"


@pytest.mark.parametrize("compile_scope", ["model", "blocks"])
def test_compiled_step_has_no_graph_break_and_no_recompile(compile_scope, kernel_device):
    """The whole model compiled with fullgraph=True (a graph break raises), the fused loss and the
    selective checkpoint inside; three steps on fresh batches with recompilation made an error, and the
    loss equal to the eager model's. (Dynamo's caches are per code object, so other tests' compiles of
    the same block code, in other dtypes and attentions, are cleared first.)"""
    torch._dynamo.reset()
    torch.manual_seed(seed(8))
    config = CONFIG.replace(attention="sdpa")
    model = TransformerLM(config, device=kernel_device)
    eager = copy.deepcopy(model)
    plan = ParallelPlan(compile=compile_scope, checkpoint=CheckpointPolicy.selective())
    wrapped = parallelize(model, plan, kernel_device, compile_options=AOT_EAGER)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            tokens = torch.randint(config.vocab_size, (2, 17), device=kernel_device)
            model.zero_grad(set_to_none=True)
            loss = lm_loss(wrapped, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            torch.testing.assert_close(loss, lm_loss(eager, tokens[:, :-1], tokens[:, 1:]), rtol=1e-6, atol=0)
