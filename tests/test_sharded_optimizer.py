"""The ZeRO-1 sharded optimizer against unsharded AdamW (CPU, gloo, 2 ranks)."""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.distributed import DDPIndividualParameters, ShardedOptimizer
from tests.adapters import get_sharded_optimizer
from tests.distributed_helpers import PASSED, ToyModelWithTiedAndFrozen, run_cases_once, seed


def _compare(rank: int, world_size: int, late_group: bool, gather_bucket_mb: float) -> None:
    torch.manual_seed(seed(0))  # the same model on every rank
    model = ToyModelWithTiedAndFrozen()
    reference = copy.deepcopy(model)
    kwargs = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    first = [model.fc1.weight, model.fc1.bias] if late_group else list(model.parameters())
    ref_first = [reference.fc1.weight, reference.fc1.bias] if late_group else list(reference.parameters())
    optimizer = get_sharded_optimizer(first, torch.optim.AdamW, **kwargs)
    optimizer.gather_bucket_mb = gather_bucket_mb
    ref_optimizer = torch.optim.AdamW(ref_first, **kwargs)
    data = torch.Generator().manual_seed(seed(3))
    for step in range(10):
        if late_group and step == 3:  # e.g. unfreezing layers during training
            rest = [p for n, p in model.named_parameters() if not n.startswith("fc1")]
            optimizer.add_param_group({"params": rest, "lr": 0.02})
            ref_optimizer.add_param_group({"params": [p for n, p in reference.named_parameters()
                                                      if not n.startswith("fc1")], "lr": 0.02})
        x, y = torch.randn(8, 10, generator=data), torch.randn(8, 5, generator=data)
        for m, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy())
    # Each rank holds state for its own shard only, and the shards cover every trainable parameter once.
    owned = {id(p) for p in optimizer.owned_parameters()}
    assert {id(p) for p in optimizer.local_optimizer.state} <= owned
    counts = [None] * world_size
    dist.all_gather_object(counts, sorted(n for n, p in model.named_parameters() if id(p) in owned))
    flat = [n for names in counts for n in names]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters()) and len(set(flat)) == len(flat)
    assert all(counts), "every rank owns part of the model"
    # The state dict round-trips on the same rank and refuses another rank's.
    state = optimizer.state_dict()
    fresh = ShardedOptimizer([dict(g) for g in optimizer.param_groups], torch.optim.AdamW, **kwargs)
    fresh.load_state_dict(state)
    bad = {**state, "rank": 1 - rank}
    with pytest.raises(ValueError, match="cannot be loaded"):
        fresh.load_state_dict(bad)


# 64 MiB: every shard in one all-gather; 0.0001 MiB (26 floats): chunks that cut parameters, and
# ranks whose streams end at different chunks (padding).
@pytest.mark.parametrize("gather_bucket_mb", [64, 0.0001])
@pytest.mark.parametrize("late_group", [False, True])
def test_sharded_adamw_equals_adamw(late_group, gather_bucket_mb, gloo_runs):
    case = f"compare-{late_group}-{gather_bucket_mb}"
    assert gloo_runs[case] == PASSED, gloo_runs[case]


def _mixed_dtypes(rank: int, world_size: int) -> None:
    """Parameters of two dtypes (one stream each, gathered in chunks that cut them), against AdamW."""
    generator = torch.Generator().manual_seed(seed(11))
    shapes = [((7, 3), torch.float32), ((5,), torch.float64), ((11,), torch.float32), ((2, 2), torch.float64),
              ((0,), torch.float32), ((9, 4), torch.float64)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape, dtype in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = ShardedOptimizer(params, torch.optim.AdamW, gather_bucket_mb=0.00005, lr=0.1)
    ref_optimizer = torch.optim.AdamW(reference, lr=0.1)
    targets = [torch.randn(shape, generator=generator, dtype=dtype) for shape, dtype in shapes]
    for _ in range(4):
        for ps, opt in ((params, optimizer), (reference, ref_optimizer)):
            opt.zero_grad()
            sum(((p - t) ** 2 * (1 + p)).sum() for p, t in zip(ps, targets)).backward()
            opt.step()
    assert 0 < len(optimizer.owned_parameters()) < len(params)
    for p, q in zip(params, reference):
        assert p.dtype == q.dtype
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_sharded_adamw_mixed_dtypes(gloo_runs):
    assert gloo_runs["mixed_dtypes"] == PASSED, gloo_runs["mixed_dtypes"]


def _with_ddp(rank: int, world_size: int) -> None:
    """Sharded optimizer behind a DDP wrapper: equal to single-process AdamW on the full batch."""
    torch.manual_seed(seed(0) + rank)
    model = ToyModelWithTiedAndFrozen()
    ddp = DDPIndividualParameters(model)
    reference = copy.deepcopy(model)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(seed(5))
    for _ in range(5):
        x, y = torch.randn(8, 10, generator=data), torch.randn(8, 5, generator=data)
        optimizer.zero_grad()
        F.mse_loss(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_sharded_optimizer_with_ddp(gloo_runs):
    assert gloo_runs["with_ddp"] == PASSED, gloo_runs["with_ddp"]


def _bad_arguments(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="gather_bucket_mb must be positive, got 0"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.AdamW, gather_bucket_mb=0)
    with pytest.raises(ValueError, match=r"contiguous parameters; one of shape \(3, 4\)"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(4, 3).t())], torch.optim.AdamW)


def test_bad_arguments(gloo_runs):
    assert gloo_runs["bad_arguments"] == PASSED, gloo_runs["bad_arguments"]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory, worker_id) -> dict[str, str]:
    """Every case on one pair of gloo ranks, once per test session (the ranks' start-up is most of a case's
    time)."""
    compare = {f"compare-{late}-{mb}": (_compare, (late, mb)) for late in (False, True) for mb in (64, 0.0001)}
    cases = {**compare, "mixed_dtypes": (_mixed_dtypes, ()), "with_ddp": (_with_ddp, ()),
             "bad_arguments": (_bad_arguments, ())}
    return run_cases_once(tmp_path_factory, worker_id, "sharded_optimizer_gloo", cases)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="ShardedOptimizer needs an initialised process group"):
        ShardedOptimizer(ToyModelWithTiedAndFrozen().parameters(), torch.optim.AdamW, lr=1e-3)
