"""Each data-parallel wrapper against single-process training on the full batch (CPU, gloo, 2 ranks).

Ranks start from different random weights (the wrapper must broadcast rank 0's), each trains on its
half of every batch, and after several steps every parameter must equal that of a single process
trained on the whole batch. The model has a tied weight (used twice), a frozen layer and a buffer.
"""

import gc
import os
import signal
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_systems.distributed import DDPBucketed, DDPIndividualParameters, DDPNaive, common
from cs336_systems.distributed.common import AsyncAllReduce, trainable_parameters
from cs336_systems.distributed.ddp_bucketed import plan_buckets
from tests.adapters import (
    ddp_bucketed_on_after_backward,
    ddp_on_after_backward,
    ddp_bucketed_on_train_batch_start,
    ddp_individual_parameters_on_after_backward,
    get_ddp,
    get_ddp_bucketed,
    get_ddp_individual_parameters,
)
from tests.distributed_helpers import PASSED, ToyModelWithTiedAndFrozen, run_cases_once, run_distributed, seed

WRAPPERS = {
    "naive": (lambda m: DDPNaive(m), lambda ddp, opt: ddp.finish_gradient_synchronization()),
    "flat": (lambda m: DDPNaive(m, flat=True), lambda ddp, opt: ddp.finish_gradient_synchronization()),
    "individual": (get_ddp_individual_parameters, ddp_individual_parameters_on_after_backward),
    "individual-2026-names": (get_ddp, ddp_on_after_backward),
    # the collectives issued from a worker thread instead of by the hooks on autograd's thread
    "individual-thread": (lambda m: DDPIndividualParameters(m, background_issue=True),
                          ddp_individual_parameters_on_after_backward),
    "bucketed-0.0005MB-thread": (lambda m: DDPBucketed(m, 0.0005, background_issue=True),
                                 ddp_bucketed_on_after_backward),
    "bucketed-one": (lambda m: get_ddp_bucketed(m, None), ddp_bucketed_on_after_backward),
    "bucketed-0.0001MB": (lambda m: get_ddp_bucketed(m, 0.0001), ddp_bucketed_on_after_backward),
    "bucketed-0.0005MB": (lambda m: get_ddp_bucketed(m, 0.0005), ddp_bucketed_on_after_backward),
    "bucketed-10MB": (lambda m: get_ddp_bucketed(m, 10), ddp_bucketed_on_after_backward),
}


COMPILED_CASES = ["individual", "individual-thread", "bucketed-0.0005MB", "bucketed-one"]


def _train_and_compare(rank: int, world_size: int, name: str, backend: str = "gloo", compiled: bool = False) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(seed(100) + rank)  # different initial weights on every rank
    model = ToyModelWithTiedAndFrozen().to(device)
    reference = ToyModelWithTiedAndFrozen().to(device)  # eager, given rank 0's weights below
    if compiled:  # AOTAutograd: the backward is one compiled function that hands out every gradient at its end
        torch._dynamo.reset()  # each case compiles afresh (the cases share one process, run_cases)
        model.compile(backend="aot_eager")
    wrap, after_backward = WRAPPERS[name]
    ddp = wrap(model)
    assert ddp.module is model
    reference.load_state_dict(model.state_dict())  # rank 0's weights, now on every rank
    frozen_before = model.frozen.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(seed(7))  # the same batches on every rank
    for step in range(6):
        x, y = torch.randn(8, 10, generator=data).to(device), torch.randn(8, 5, generator=data).to(device)
        if name.startswith("bucketed"):
            ddp_bucketed_on_train_batch_start(ddp, optimizer)
        optimizer.zero_grad(set_to_none=step % 2 == 0)  # fresh gradients, or ones kept and zeroed in place
        kept = [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
        F.mse_loss(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        after_backward(ddp, optimizer)
        if name.startswith("bucketed") and step % 2:  # kept gradients are synchronised where they are
            assert kept == [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
        if name.startswith("bucketed"):  # each bucket's gradients are consecutive views of one buffer
            for bucket in ddp.buckets:
                first = bucket.params[0].grad
                assert all(p.grad._base is first._base is not None and p.grad.data_ptr() == first.data_ptr()
                           + offset * p.element_size() for p, offset in zip(bucket.params, bucket.offsets))
        optimizer.step()
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"grad of {pname}")
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name}: {pname} differs")
    assert model.frozen.weight.grad is None
    assert torch.equal(model.frozen.weight, frozen_before)
    # every rank holds the same weights
    gathered = [torch.empty_like(model.fc2.weight) for _ in range(world_size)]
    dist.all_gather(gathered, model.fc2.weight.detach())
    assert all(torch.equal(gathered[0], g) for g in gathered)
    # Dropping the wrapper and the model frees them (gradient hooks must not keep them alive).
    alive = [weakref.ref(ddp), weakref.ref(model)]
    del ddp, model, optimizer
    gc.collect()
    assert [r() for r in alive] == [None, None], f"{name}: the wrapper or its model outlived every reference"


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory, worker_id) -> dict[str, str]:
    """Every wrapper's run on one pair of gloo ranks, once per test session (the ranks' start-up is most of a
    case's time)."""
    cases = {name: (_train_and_compare, (name,)) for name in sorted(WRAPPERS)}
    return run_cases_once(tmp_path_factory, worker_id, "ddp_gloo", cases)


@pytest.fixture(scope="module")
def compiled_gloo_runs(tmp_path_factory, worker_id) -> dict[str, str]:
    cases = {name: (_train_and_compare, (name, "gloo", True)) for name in COMPILED_CASES}
    return run_cases_once(tmp_path_factory, worker_id, "ddp_gloo_compiled", cases)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_matches_single_process(name, gloo_runs):
    assert gloo_runs[name] == PASSED, gloo_runs[name]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrapper_matches_single_process_on_nccl(name):
    """The same on two GPUs, where the wrappers average inside NCCL's reduction (ReduceOp.AVG)."""
    run_distributed(_train_and_compare, 2, name, "nccl", backend="nccl")


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_wrapper_on_a_compiled_model_matches_single_process(name, compiled_gloo_runs):
    """The benchmarks compile the model's blocks; the gradient hooks must still fire once for each
    parameter (the tied one included) when the backward runs as a compiled graph."""
    assert compiled_gloo_runs[name] == PASSED, compiled_gloo_runs[name]


def _one_rank_fails(rank: int, world_size: int) -> None:
    model = ToyModelWithTiedAndFrozen()
    ddp = get_ddp_bucketed(model, 0.001)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    ddp(torch.randn(4, 10)).sum().backward()  # rank 0 would wait for rank 1 forever
    ddp.finish_gradient_synchronization()


def test_a_failing_rank_fails_the_run_promptly():
    start = time.monotonic()
    # Whichever rank's error is seen first is reported: rank 1's own, or rank 0 losing its peer.
    with pytest.raises(Exception, match="rank 1 fails on purpose|remote worker"):
        run_distributed(_one_rank_fails, 2)
    assert time.monotonic() - start < 60


def _rank_1_aborts(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)  # as gloo's std::terminate ends a rank: in native code, no exception


def test_a_rank_that_aborts_prints_its_python_stack(capfd):
    with pytest.raises(Exception, match="SIGABRT"):
        run_distributed(_rank_1_aborts, 2)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "in _rank_1_aborts" in err


def test_background_all_reduce_keeps_order_and_raises_errors(monkeypatch):
    """The worker issues in submission order (every rank must issue the same sequence), not on the
    caller's thread, and an error raised while issuing comes out of wait()."""
    import threading

    issued = []

    def fake_all_reduce(tensor, async_op=False):
        if tensor.numel() == 0:
            raise RuntimeError("cannot reduce an empty tensor")
        issued.append((int(tensor[0]), threading.current_thread().name))
        return type("Done", (), {"wait": lambda self: None})()

    monkeypatch.setattr(common, "all_reduce_mean", fake_all_reduce)
    reducer = AsyncAllReduce(torch.device("cpu"), background=True)
    order = torch.randperm(50).tolist()
    for i in order:
        reducer.submit(torch.tensor([i]))
    reducer.wait()
    assert [i for i, _ in issued] == order
    assert {name for _, name in issued} != {threading.current_thread().name}
    reducer.submit(torch.empty(0))
    with pytest.raises(RuntimeError, match="empty tensor"):
        reducer.wait()
    inline = AsyncAllReduce(torch.device("cpu"), background=False)
    inline.submit(torch.tensor([7]))
    inline.wait()
    assert issued[-1] == (7, threading.current_thread().name)


def test_bucket_plan():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 50, 300, 10)]  # float32: 4 bytes each
    plan = plan_buckets(params, bucket_size_mb=1000 / 2**20)
    # reverse order; at most 1000 B a bucket, except a larger parameter alone (300 x 4 B)
    assert [[p.numel() for p in b] for b in plan] == [[10], [300], [50, 100]]
    assert [[p.numel() for p in b] for b in plan_buckets(params, None)] == [[10, 300, 50, 100]]
    with pytest.raises(ValueError, match="bucket_size_mb must be positive .* got 0"):
        plan_buckets(params, 0)
    with pytest.raises(ValueError, match="got -1"):
        plan_buckets(params, -1)


def test_wrappers_need_a_process_group():
    assert not dist.is_initialized()
    for wrap in (lambda m: get_ddp_bucketed(m, 1.0), get_ddp_individual_parameters, DDPNaive):
        with pytest.raises(RuntimeError, match="needs an initialised process group"):
            wrap(ToyModelWithTiedAndFrozen())


def test_parameters_on_mixed_devices_are_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="parameters are on several devices"):
        trainable_parameters(model)


def test_benchmark_with_compiled_blocks_and_one_adamw_for_every_optimizer(tmp_path):
    """The DDP benchmark as the full-scale pipeline runs it (blocks compiled, one AdamW implementation for
    plain, sharded and ZeRO optimizers), on two CPU ranks: every data-parallel config trains the same
    global batches from the same weights with the same update, so all reach the same loss; `none` (each
    rank trains alone on its half) is the control that the loss tells them apart."""
    import subprocess
    import sys

    import pandas as pd

    out = tmp_path / "ddp.csv"
    configs = ["none", "individual", "bucketed:0.01+sharded", "torch_ddp+zero", "torch_ddp"]
    # fp32, as the smoke scale runs these CPU ranks: bf16 autocast on a CPU takes the host CPU's own bf16
    # paths (oneDNN, Inductor's vector ISA), which differ between machines and are not what is tested here
    # (the benchmark's default bf16 is for GPUs; this test failed on an H100 host, in bf16). SDPA, not naive:
    # Inductor's C++ code for the naive causal mask did not compile on an H200 host's CPU (torch 2.11:
    # "no matching function for call to VecMask<long int, 2>::VecMask(int&)"), and attention is not what
    # this test is about.
    argv = ["-m", "cs336_systems.bench.ddp", "--backend", "gloo", "--size", "tiny", "--batch-size", "2",
            "--context-length", "32", "--attention", "sdpa", "--warmup", "1", "--steps", "2", "--lr", "0.01",
            "--precisions", "fp32", "--compile", "blocks", "--adamw", "torch_fused", "--configs", *configs,
            "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *argv], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]  # the ranks' errors, not only the exit status
    rows = pd.read_csv(out)
    assert rows["config"].tolist() == configs
    assert rows["dp_kind"].tolist() == ["none", "individual", "bucketed", "torch_ddp", "torch_ddp"]
    assert rows["optimizer_sharding"].tolist() == ["none", "none", "sharded", "zero", "none"]
    assert rows["bucket_mb"].tolist()[2] == 0.01 and rows["bucket_mb"].drop(index=2).isna().all()
    assert (rows["status"] == "ok").all()
    assert (rows["compile"] == "blocks").all() and (rows["adamw"] == "torch_fused").all()
    loss = rows.set_index("config")["final_loss"]
    assert loss[configs[1:]].max() - loss[configs[1:]].min() < 1e-4, loss
    assert abs(loss["none"] - loss["torch_ddp"]) > 1e-3, loss


def _noop(rank: int, world_size: int) -> None:
    pass


def _report_environment(rank: int, world_size: int) -> None:
    print(f"rank {rank} sees {os.environ.get('CS336_LAUNCH_PROBE')}", flush=True)
    assert os.environ["CS336_LAUNCH_PROBE"] == "set after the fork server started"


def test_ranks_start_with_the_callers_environment_and_output(capfd, monkeypatch):
    """The ranks fork from a server started at the first call (launch.run_distributed); each still gets the
    caller's environment and stdout at its own call, not the server's from its start."""
    with capfd.disabled():  # the server runs from here on, with the session's own stdout, not this capture's
        run_distributed(_noop, 2)
    monkeypatch.setenv("CS336_LAUNCH_PROBE", "set after the fork server started")
    run_distributed(_report_environment, 2)
    out = capfd.readouterr().out
    assert "rank 0 sees set after the fork server started" in out and "rank 1 sees" in out
