"""FSDP against single-process training on the full batch (CPU, gloo, 1, 2 and 3 ranks).

Ranks start from different random weights (the wrapper broadcasts rank 0's); each trains on its
`chunk(world)[rank]` of every (shuffled) batch, and after every step the gathered full parameters
must match a single process trained on the whole batch: SGD, our AdamW and torch's AdamW; fp32, and
fp16/bf16 compute against a reference whose Linear/Embedding weights are cast to the compute dtype
for forward and backward (torch's parametrizations) while its master weights stay fp32. Models: a
toy LM built from classes named Linear/Embedding/RMSNorm (as the course's cs336_basics names them),
the same with tied, frozen, twice-used and torch.nn.Linear (with bias) layers, and our TransformerLM.
Vocabulary 101 and d_ff 27 give uneven shards at every world size > 1.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from cs336_systems.distributed import FSDP, default_shard_policy, gather_full_params
from cs336_systems.distributed.common import broadcast_from_rank0
from cs336_systems.distributed.fsdp_shard import ShardedWeight
from cs336_systems.model import AdamW, TransformerLM, get_config
from tests.adapters import fsdp_gather_full_params, fsdp_on_after_backward, get_fsdp
from tests.distributed_helpers import run_distributed

VOCAB, CONTEXT, BATCH = 101, 6, 12  # BATCH divides by 1, 2 and 3


class Linear(nn.Module):
    """Like cs336_basics' Linear: weight (out, in), y = x W^T, not a torch.nn.Linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)

    def forward(self, x):
        return x @ self.weight.T


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim))

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(dtype)


class ToyLM(nn.Module):
    """embedding → norm → Linear(d, d_ff) → relu → norm → Linear(d_ff, d) → lm_head. With `extras`: the
    head tied to the embedding, one Linear used twice, a frozen Linear (fp32: frozen weights are left
    alone, not cast), a torch.nn.Linear with a bias (replicated, so fp32: only with fp32 compute)."""

    def __init__(self, d_model: int = 16, d_ff: int = 27, extras: bool = False, bias: bool = True):
        super().__init__()
        self.extras = extras
        self.embedding = Embedding(VOCAB, d_model)
        self.norm1 = RMSNorm(d_model)
        self.linear1 = Linear(d_model, d_ff)
        self.norm2 = RMSNorm(d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.lm_head = Linear(d_model, VOCAB)
        if extras:
            self.lm_head.weight = self.embedding.weight
            self.twice = Linear(d_model, d_model)
            self.frozen = Linear(d_model, d_model)
            self.frozen.requires_grad_(False)
            self.torch_linear = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, token_ids):
        x = self.linear1(self.norm1(self.embedding(token_ids)))
        x = self.linear2(self.norm2(torch.relu(x)))
        if self.extras:
            x = self.twice(torch.relu(self.twice(x)))
            x = self.torch_linear(self.frozen(x.float()).to(x.dtype))
        return self.lm_head(x)


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, weight):
        return weight.to(self.dtype)


def cast_reference(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Linear/Embedding weights used in `dtype` (and their gradients computed in it), master weights
    fp32: torch's parametrizations, independent of the FSDP code."""
    for m in list(model.modules()):
        if default_shard_policy(m) and m.weight.requires_grad:
            parametrize.register_parametrization(m, "weight", _Cast(dtype), unsafe=True)
    return model


def reference_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("parametrizations.weight.original", "weight"): p.detach()
            for n, p in model.named_parameters(remove_duplicate=False)}


def make_model(kind: str, dtype: torch.dtype | None) -> nn.Module:
    if kind == "transformer":
        return TransformerLM(get_config("tiny", vocab_size=VOCAB, context_length=CONTEXT, d_ff=27 * 4,
                                        num_layers=2))
    return ToyLM(extras=kind == "extras", bias=dtype is None)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "ours_adamw": lambda params: AdamW(params, lr=0.01, weight_decay=0.1),
    "torch_adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}

# (model, compute dtype, optimizer, tolerance on parameters after each step). fp32: float32 rounding
# (the two ranks' half-batch gradients are summed in another order than one full-batch matmul; a few
# ulp of the gradient); fp16/bf16: the handout's 1e-4 for fp16, bf16's 8-bit mantissa for bf16.
CASES = [
    ("toy", None, "sgd", 1e-6),
    ("toy", torch.float16, "sgd", 1e-4),
    ("extras", None, "sgd", 1e-6),
    ("extras", torch.float16, "sgd", 1e-4),
    ("transformer", None, "ours_adamw", 1e-5),
    ("transformer", None, "torch_adamw", 1e-5),
    ("transformer", torch.bfloat16, "sgd", 1e-3),
]


def _train_and_compare(rank: int, world: int, case: tuple, native: bool | None = None, steps: int = 3) -> float:
    kind, dtype, opt_name, tol = case
    torch.manual_seed(100 + rank)  # different initial weights on every rank
    model = make_model(kind, dtype)
    reference = copy.deepcopy(model)
    broadcast_from_rank0(reference)  # rank 0's weights, as FSDP starts from
    fsdp = FSDP(model, compute_dtype=dtype, native_collectives=native)
    assert fsdp.module is model
    if kind == "extras":
        frozen_before = model.frozen.weight.detach().clone()
    if dtype is not None:
        cast_reference(reference, dtype)
    optimizer = OPTIMIZERS[opt_name](fsdp.parameters())  # shards and replicated parameters
    ref_optimizer = OPTIMIZERS[opt_name](reference.parameters())
    data = torch.Generator().manual_seed(7)  # the same batches on every rank
    worst = 0.0
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=data)
        targets = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=data)
        tokens, targets = tokens[torch.randperm(BATCH, generator=data)], targets  # shuffled
        fsdp.on_train_batch_start()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        logits = fsdp(tokens.chunk(world)[rank])
        F.cross_entropy(logits.float().flatten(0, 1), targets.chunk(world)[rank].flatten()).backward()
        fsdp_on_after_backward(fsdp, optimizer)
        assert all(u.buffer is None for u in fsdp.sharded_weights), "a gathered weight outlived its step"
        for name, p in fsdp.module.named_parameters():  # the contract the course checks
            if p.requires_grad:
                assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        optimizer.step()
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(tokens).float().flatten(0, 1), targets.flatten()).backward()
        ref_optimizer.step()
        full, expected = gather_full_params(fsdp), reference_params(reference)
        assert set(full) == set(expected)
        for name, q in expected.items():
            assert full[name].shape == q.shape and full[name].dtype == torch.float32, name
            worst = max(worst, (full[name] - q).abs().max().item())
            torch.testing.assert_close(full[name], q, rtol=tol, atol=tol,
                                       msg=lambda m: f"{case} world {world} step {step} {name}: {m}")
    # replicated parameters (and their gradients) are identical on every rank
    for name, p in fsdp.module.named_parameters():
        if id(p) not in {id(u.shard) for u in fsdp.sharded_weights}:
            gathered = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(gathered, p.detach())
            assert all(torch.equal(gathered[0], g) for g in gathered), name
    if kind == "extras":
        assert model.frozen.weight.grad is None and torch.equal(model.frozen.weight, frozen_before)
        assert model.lm_head.weight is model.embedding.weight  # still tied: one shard
    return worst


def _all_cases(rank: int, world: int) -> None:
    torch.set_num_threads(1)  # ranks share a few cores: more threads each only oversubscribe them
    for case in CASES:
        worst = _train_and_compare(rank, world, case)
        if rank == 0:
            print(f"world {world} {case[:3]}: max |FSDP - single process| = {worst:.3g}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_matches_single_process(world):
    run_distributed(_all_cases, world)
