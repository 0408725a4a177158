"""Both FlashAttention-2 implementations against an independent float64 reference.

On a CPU-only machine the Triton kernels run under Triton's interpreter (exact float32 dots, no
bfloat16 dots), so CPU cases are float32 and float16 at small sizes; on a GPU the same cases run on
the device and bfloat16 is added.

Tolerances. float32: the kernels accumulate in float32 in a different order than the reference, so
errors are a few ulps times sqrt(n): 1e-4 relative to the output's scale is ample and still catches
any indexing or masking mistake (those give O(1) errors). 16-bit: each kernel's error against
float64 must be within 2x (plus a small floor) of PyTorch's own attention in the same dtype.
"""

import os
import subprocess
import sys
from contextlib import nullcontext

import pandas as pd
import pytest
import torch

from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash import fa2
from cs336_systems.kernels.flash.fa2 import TUNED_KERNELS, pinned_tiles
from cs336_systems.kernels.flash.tuning import (
    BWD_TILES,
    FLOAT32_DOTS,
    FLOAT32_TILES,
    FWD_TILES,
    MAX_FLOAT32_STAGES,
    TUNING_KEY,
    announcing_prune,
    prune_configs,
    tile_config,
    tile_configs,
)
from cs336_systems.kernels.flash.settings import flash_settings, use_flash_settings
from cs336_systems.model.attention import attention_scores, naive_attention
from tests.adapters import get_flashattention_autograd_function_pytorch, get_flashattention_autograd_function_triton
from tests.kernel_devices import KERNEL_DEVICE

# `flash_check --repeats` reruns this file with CS336_FLASH_SEED=1, 2, ...: each repeat draws fresh inputs
# (the per-case seeds below stay distinct within a repeat; 1000 apart keeps repeats from sharing one).
SEED_OFFSET = 1000 * int(os.environ.get("CS336_FLASH_SEED", "0"))
IMPLS = {"pytorch": get_flashattention_autograd_function_pytorch(), "triton": get_flashattention_autograd_function_triton()}
# The PyTorch implementation runs on the CPU and, where there is one, the GPU; the Triton one on the
# session's kernel device (conftest.py): CUDA, or the CPU under the interpreter where there is no GPU.
TRITON_DEVICES = [KERNEL_DEVICE] if KERNEL_DEVICE else []
CASES_BY_DEVICE = ([("pytorch", "cpu")] + [("pytorch", "cuda")] * torch.cuda.is_available()
                   + [("triton", device) for device in TRITON_DEVICES])

# (q shape, k shape, causal): odd lengths, a single token, rectangular, with and without heads.
CASES = [
    ((2, 1, 16), (2, 1, 16), True),
    ((2, 17, 16), (2, 17, 16), True),
    ((1, 100, 32), (1, 100, 32), True),
    ((1, 100, 32), (1, 100, 32), False),
    ((2, 33, 16), (2, 65, 16), False),
    ((1, 40, 24), (1, 23, 24), True),
    ((2, 3, 37, 32), (2, 3, 37, 32), True),
    ((1, 2, 64, 64), (1, 2, 64, 64), False),
]
GPU_CASES = [
    ((4, 257, 64), (4, 257, 64), True),
    ((2, 4, 1000, 128), (2, 4, 1000, 128), True),
    ((2, 4, 513, 128), (2, 4, 300, 128), False),
    ((1, 2, 256, 16), (1, 2, 256, 16), True),
]


def _inputs(q_shape, k_shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(SEED_OFFSET + seed)
    q = torch.randn(q_shape, generator=gen, dtype=torch.float64)
    k = torch.randn(k_shape, generator=gen, dtype=torch.float64)
    v = torch.randn(k_shape, generator=gen, dtype=torch.float64)
    do = torch.randn(q_shape, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def _run(fn, q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    saved = getattr(out.grad_fn, "saved_tensors", ())  # our Functions save L; the torch reference does not
    saved_l = [t for t in saved if t.shape == q.shape[:-1]]
    out.backward(do)
    return out, saved_l, q.grad, k.grad, v.grad


def _reference(q, k, v, do, causal):
    """float64 autograd through the model's naive attention; L = logsumexp of its scores."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, causal), torch.logsumexp(attention_scores(q, k, causal), dim=-1)
    out.backward(do.double())
    return out, lse, q.grad, k.grad, v.grad


def _rel_err(x, ref):
    """Relative error; the floor of 1 keeps it meaningful where the reference is exactly zero
    (dQ with a single key)."""
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1.0)).item()


# Small enough for every dtype and head dim in shared memory (float32 at d=128 included).
GPU_TEST_TILE = (64, 32, 4, 2)


def _cases(device):
    return CASES + (GPU_CASES if device == "cuda" else [])


@pytest.fixture(autouse=True)
def _one_tile_config_on_gpu(request):
    """On a GPU the tests run with one tile config per kernel: autotuning every test shape would
    compile every config once per specialization (minutes). `test_every_tile_config` checks each
    config and `test_autotuned_path` (marked `autotuned`) the autotuner itself."""
    pin = torch.cuda.is_available() and request.node.get_closest_marker("autotuned") is None
    with pinned_tiles(GPU_TEST_TILE, GPU_TEST_TILE) if pin else nullcontext():
        yield


def _check_against_reference(apply, q_shape, k_shape, causal, dtype, device, seed, what):
    """float32: within 1e-4 of float64. 16-bit: within 2x (plus a floor) of PyTorch's own error."""
    q, k, v, do = _inputs(q_shape, k_shape, dtype, device, seed)
    got = _run(apply, q, k, v, do, causal)
    ref = _reference(q, k, v, do, causal)
    torch_own = _run(naive_attention, q, k, v, do, causal) if dtype != torch.float32 else None
    for i, name in ((0, "O"), (2, "dQ"), (3, "dK"), (4, "dV")):
        err = _rel_err(got[i], ref[i])
        limit = 1e-4 if torch_own is None else 2 * _rel_err(torch_own[i], ref[i]) + 2e-3
        assert err < limit, f"{what} {dtype} {name} {q_shape} {k_shape} causal={causal}: {err:.2e} (limit {limit:.2e})"


@pytest.mark.parametrize("impl,device", CASES_BY_DEVICE)
def test_float32_matches_float64_reference(impl, device):
    for seed, (q_shape, k_shape, causal) in enumerate(_cases(device)):
        q, k, v, do = _inputs(q_shape, k_shape, torch.float32, device, seed)
        out, saved_l, dq, dk, dv = _run(IMPLS[impl].apply, q, k, v, do, causal)
        ref_out, ref_l, ref_dq, ref_dk, ref_dv = _reference(q, k, v, do, causal)
        assert len(saved_l) == 1, "exactly one saved tensor must have the logsumexp's shape"
        assert out.dtype == torch.float32 and saved_l[0].dtype == torch.float32
        for name, got, ref in [("O", out, ref_out), ("L", saved_l[0], ref_l), ("dQ", dq, ref_dq),
                               ("dK", dk, ref_dk), ("dV", dv, ref_dv)]:
            assert torch.isfinite(got).all(), f"{name} not finite for {q_shape} {k_shape} causal={causal}"
            assert _rel_err(got, ref) < 1e-4, f"{name} for {q_shape} {k_shape} causal={causal}: {_rel_err(got, ref)}"


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_forward_loads_by_descriptor_or_pointer(tma, device):
    """The forward's two load paths (tensor descriptors, which zero-fill past the data, and masked
    pointer loads) on fresh inputs, outputs in the inputs' layout ((batch, seq, heads, dim) viewed)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    with use_flash_settings(tma=tma, tma_min_keys=0):  # descriptors at every length, where the layout allows
        for i, (q_shape, k_shape, causal) in enumerate(_cases(device)):
            q, k, v, do = _inputs(q_shape, k_shape, torch.float32, device, seed + i)
            if q.dim() == 4:  # the model's layout: heads interleaved along the sequence
                q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
            got = _run(IMPLS["triton"].apply, q, k, v, do, causal)
            ref = _reference(q, k, v, do, causal)
            assert got[0].stride() == q.stride() and got[2].stride() == q.stride() and got[3].stride() == k.stride()
            for j, name in ((0, "O"), (2, "dQ"), (3, "dK"), (4, "dV")):
                err = _rel_err(got[j], ref[j])
                assert err < 1e-4, f"tma={tma} {name} {q_shape} {k_shape} causal={causal} seed={seed + i}: {err:.2e}"


# float16 everywhere; bfloat16 only on the GPU (the interpreter cannot multiply bfloat16).
HALF_CASES = [(impl, device, dtype) for impl, device in CASES_BY_DEVICE
              for dtype in [torch.float16] + ([torch.bfloat16] if device == "cuda" else [])]


@pytest.mark.parametrize("impl,device,dtype", HALF_CASES)
def test_half_precision_error_is_within_twice_pytorch_own(impl, device, dtype):
    for seed, (q_shape, k_shape, causal) in enumerate(_cases(device)):
        _check_against_reference(IMPLS[impl].apply, q_shape, k_shape, causal, dtype, device, 100 + seed, impl)


@pytest.mark.parametrize("impl,device", CASES_BY_DEVICE)
def test_sum_backward_with_stride_zero_grad(impl, device):
    """o.sum().backward() hands the kernel an expanded (stride-0) dO."""
    q, k, v, _ = _inputs((2, 3, 45, 32), (2, 3, 45, 32), torch.float32, device, 7)
    grads = []
    for fn in (IMPLS[impl].apply, naive_attention):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, True).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl,device", CASES_BY_DEVICE)
def test_compiled_function_matches_reference(impl, device):
    """`torch.compile(Function.apply)` as the handout's leaderboard test runs it, a stride-0 dO included."""
    torch.compiler.reset()
    compiled = torch.compile(IMPLS[impl].apply)
    q, k, v, _ = _inputs((2, 2, 37, 16), (2, 2, 37, 16), torch.float32, device, 11)
    results = []
    for fn in (compiled, naive_attention):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, True)
        out.sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_operators_return_fresh_tensors_and_pass_torch_opcheck(kernel_device):
    """The compiled path's operators are registered without custom_op's per-call check that outputs alias no input
    (flash_triton, "PyTorch operators"): their outputs must be fresh by construction, and torch's own operator
    checks (schema, fake kernel against the real one, aliasing) must hold, on an awkward model-layout shape."""
    q, k, v, do = _inputs((2, 3, 37, 16), (2, 3, 45, 16), torch.float32, kernel_device, 12)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the model's (batch, seq, heads, dim) storage
    forward = torch.ops.cs336_systems.flash_triton_forward.default
    backward = torch.ops.cs336_systems.flash_triton_backward.default
    out, lse = forward(q, k, v, True)
    grads = backward(q, k, v, out, lse, do, True)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    for results, inputs in (((out, lse), (q, k, v)), (grads, (q, k, v, out, lse, do))):
        fresh = {storage(t) for t in results}
        assert len(fresh) == len(results) and not fresh & {storage(t) for t in inputs}
    assert out.stride() == q.stride()  # O in q's layout, as the fake kernel says
    for op, args in ((forward, (q, k, v, True)), (backward, (q, k, v, out, lse, do, True))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("impl,device", CASES_BY_DEVICE)
def test_non_contiguous_inputs(impl, device):
    """(batch, n, heads, d) transposed to (batch, heads, n, d), as the model produces them."""
    q, k, v, do = (t.transpose(1, 2) for t in _inputs((2, 29, 3, 16), (2, 29, 3, 16), torch.float32, device, 3))
    assert not q.is_contiguous()
    out, _, dq, dk, dv = _run(IMPLS[impl].apply, q, k, v, do, True)
    ref = _reference(q, k, v, do, True)
    for got, want in zip((out, dq, dk, dv), (ref[0], *ref[2:])):
        assert _rel_err(got, want) < 1e-4


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_bad_inputs_are_clear_errors(impl):
    apply = IMPLS[impl].apply
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="head dim 256 is not supported"):
        apply(torch.randn(1, 8, 256), torch.randn(1, 8, 256), torch.randn(1, 8, 256), False)
    with pytest.raises(ValueError, match="share a dtype"):
        apply(x, x.half(), x, False)
    with pytest.raises(ValueError, match=r"got shape \(8, 16\)"):
        apply(x[0], x[0], x[0], False)
    with pytest.raises(ValueError, match="incompatible shapes"):
        apply(x, torch.randn(1, 8, 32), torch.randn(1, 8, 32), False)


def test_backends_plug_into_the_model(kernel_device):
    from cs336_systems.model import ModelConfig, TransformerLM

    config = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=50, context_length=32)
    device = kernel_device
    torch.manual_seed(SEED_OFFSET)
    reference = TransformerLM(config.replace(attention="naive")).to(device)
    tokens = torch.randint(50, (2, 21), device=device)
    expected = reference(tokens)
    for backend in ("flash_pytorch", "flash_triton"):
        model = TransformerLM(config.replace(attention=backend)).to(device)
        model.load_state_dict(reference.state_dict())
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tile configs are GPU code; CPU runs use one 16x16 tile")
@pytest.mark.parametrize("index", range(max(len(FWD_TILES), len(BWD_TILES))))
def test_every_tile_config(index):
    from triton.runtime.errors import OutOfResources

    forward, backward = FWD_TILES[index % len(FWD_TILES)], BWD_TILES[index % len(BWD_TILES)]
    dtypes = [torch.bfloat16] + ([torch.float32] if max(forward[3], backward[3]) <= MAX_FLOAT32_STAGES else [])
    checked = 0
    with pinned_tiles(forward, backward):
        for dtype in dtypes:
            for seed, (q_shape, k_shape, causal) in enumerate([((2, 3, 300, 64), (2, 3, 300, 64), True),
                                                               ((1, 2, 200, 128), (1, 2, 333, 128), False)]):
                try:
                    _check_against_reference(IMPLS["triton"].apply, q_shape, k_shape, causal, dtype, "cuda", seed,
                                             f"tiles fwd={forward} bwd={backward}")
                    checked += 1
                except OutOfResources:  # too big for shared memory at this dtype and head dim; the
                    continue            # autotuner skips such a config the same way
    assert checked, f"tiles fwd={forward} bwd={backward} ran for no case"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tile configs are GPU code; CPU runs use one 16x16 tile")
@pytest.mark.parametrize("tile", FLOAT32_TILES)
def test_every_float32_tile_config(tile):
    """The float32-only tiles exist for d=128, where nothing else fits: they must run there."""
    with pinned_tiles(tile, tile):
        for seed, (q_shape, k_shape, causal) in enumerate([((2, 3, 300, 128), (2, 3, 300, 128), True),
                                                           ((1, 2, 200, 64), (1, 2, 333, 64), False)]):
            _check_against_reference(IMPLS["triton"].apply, q_shape, k_shape, causal, torch.float32, "cuda", seed,
                                     f"float32 tile {tile}")


def test_float32_only_tiles_are_pruned_by_precision():
    """16-bit inputs never tune over the float32-only tiles; float32 inputs tune over them and over
    the kernel's own tiles of at most MAX_FLOAT32_STAGES stages."""
    configs = tile_configs(FWD_TILES, "BLOCK_M", "BLOCK_N")
    sizes = {"SEQ_KEY_Q": 4096, "SEQ_KEY_K": 4096}

    def tiles(precision):
        kept = prune_configs(configs, {}, PRECISION=precision, **sizes)
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}

    assert tiles("tf32") == set(FWD_TILES)
    for precision in FLOAT32_DOTS:
        assert tiles(precision) == {t for t in FWD_TILES if t[3] <= MAX_FLOAT32_STAGES} | set(FLOAT32_TILES)


def test_every_tuning_key_is_an_argument_the_launchers_fill():
    """Triton's autotuner silently leaves out a key that is not among the kernel's arguments, so each tuned kernel
    must take every name of TUNING_KEY, and the launchers must fill the bucket from the call: the lengths and
    batch x heads rounded up to powers of two (3-d inputs are one head per batch entry)."""
    for name, kernel in TUNED_KERNELS.items():
        assert set(TUNING_KEY) <= set(kernel.arg_names), name
        assert list(kernel.keys[:len(TUNING_KEY)]) == TUNING_KEY, name
    settings = flash_settings()
    q, k = torch.empty(3, 5, 100, 64), torch.empty(3, 5, 600, 64)
    params = fa2._launch_params(q, k, settings)
    assert (params["SEQ_KEY_Q"], params["SEQ_KEY_K"], params["BATCH_HEADS_KEY"]) == (128, 1024, 16)
    params = fa2._launch_params(q[0], k[0], settings)  # (batch, n, d): 5 batch entries of one head
    assert (params["SEQ_KEY_Q"], params["SEQ_KEY_K"], params["BATCH_HEADS_KEY"]) == (128, 1024, 8)


def test_autotuning_is_announced_once_per_shape_bucket(capsys):
    """Tuning a new shape bucket takes tens of seconds on a GPU: the pruning step, which Triton runs just
    before it, says on stderr what is tuned, once per bucket and kernel, and prunes as `prune_configs`."""
    prune = announcing_prune("forward")
    configs = tile_configs(FWD_TILES, "BLOCK_M", "BLOCK_N")
    bf16 = {"Q": torch.empty(0, dtype=torch.bfloat16)}
    bucket = {"SEQ_KEY_Q": 1024, "SEQ_KEY_K": 2048, "BATCH_HEADS_KEY": 64, "BLOCK_D": 64, "IS_CAUSAL": True,
              "PRECISION": "tf32"}
    for _ in range(2):
        assert prune(configs, bf16, **bucket) == prune_configs(configs, {}, **bucket)
    captured = capsys.readouterr()
    kept = len(prune_configs(configs, {}, **bucket))
    assert captured.out == "" and captured.err.splitlines() == [
        f"flash_triton: autotuning the forward kernel over {kept} of {len(configs)} tile configs for 513-1024 "
        "queries, 1025-2048 keys, 33-64 batch x heads, head dim <= 64, causal, bfloat16 (once per shape bucket)"]
    prune(configs, {"Q": torch.empty(0)}, **{**bucket, "PRECISION": "ieee"})  # float32: another bucket
    prune(configs, bf16, **{**bucket, "SEQ_KEY_Q": 1})
    prune(configs, bf16, **{**bucket, "BATCH_HEADS_KEY": 128})  # more programs: another bucket
    prune(configs, bf16, **bucket)
    new = capsys.readouterr().err.splitlines()
    assert len(new) == 3 and "float32, ieee dots" in new[0] and "for 1 queries" in new[1]
    assert "65-128 batch x heads" in new[2]


@pytest.mark.autotuned
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuner runs on the GPU only")
def test_autotuned_path(capsys):
    """The kernels as the benchmarks run them: autotuned, with pruning by length and precision; tuning
    a bucket is announced on stderr."""
    assert len(TUNED_KERNELS["forward"].configs) == len(FWD_TILES) + len(FLOAT32_TILES)
    for dtype in (torch.bfloat16, torch.float32):
        _check_against_reference(IMPLS["triton"].apply, (1, 4, 1000, 64), (1, 4, 1000, 64), True, dtype,
                                 "cuda", 5, "autotuned")
    announced = capsys.readouterr().err
    for kernel in TUNED_KERNELS:
        assert f"autotuning the {kernel} kernel" in announced, announced
    # float32 at d=128: only the float32-only tiles fit in shared memory (a sweep failed here without them)
    _check_against_reference(IMPLS["triton"].apply, (1, 2, 700, 128), (1, 2, 700, 128), True, torch.float32,
                             "cuda", 6, "autotuned d=128")


def test_pinned_tiles_run_the_given_tile_and_restore(kernel_device):
    """A tile other than the default on CPU too (the interpreter runs any tile, slowly)."""
    kernel = TUNED_KERNELS["forward"]
    before = kernel.configs
    with pinned_tiles((32, 16, 4, 1), (32, 16, 4, 1)):
        assert [c.kwargs for c in kernel.configs] == [{"BLOCK_M": 32, "BLOCK_N": 16}]
        _check_against_reference(IMPLS["triton"].apply, (2, 45, 16), (2, 45, 16), True, torch.float32,
                                 kernel_device, 3, "pinned 32x16")
    assert kernel.configs is before



def test_tile_lists_keep_the_causal_split_exact():
    """Every outer tile is a multiple of its inner tile (else the unmasked causal loop overruns), and a
    tile that breaks this is refused by name."""
    assert all(outer % inner == 0 for outer, inner, *_ in FWD_TILES + BWD_TILES + FLOAT32_TILES)
    with pytest.raises(ValueError, match=r"\(32, 64, 4, 2\)"):
        tile_config((32, 64, 4, 2), "BLOCK_M", "BLOCK_N")


def test_kernel_resources_see_the_float32_spills(tmp_path):
    """Compiled for the H100 on the CPU: a tile that spills with IEEE float32 dots spills less with the
    default tf32x3 dots (not at all, today) and not at all in bfloat16; every row has its registers.
    In a process of its own: compiling needs Triton's JIT, not the interpreter this process runs."""
    out = tmp_path / "resources.csv"
    subprocess.run([sys.executable, "-m", "cs336_systems.bench.kernel_resources", "--kernels", "forward",
                    "--dtypes", "fp32", "bf16", "--float32-dots", "ieee", "tf32x3", "--head-dims", "64",
                    "--tiles", "64,64,4,3", "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = pd.read_csv(out).set_index("dot")
    failed = rows[rows["status"] != "ok"]
    assert failed.empty, failed.get("error", failed["status"]).to_dict()  # the compiler's own words
    assert (rows["registers"] > 0).all() and (rows["arch"] == "sm_90").all()
    fp32 = rows[rows["dtype"] == "fp32"]["spill_store_bytes"]
    assert fp32["ieee"] > 0 and fp32["tf32x3"] < fp32["ieee"], fp32.to_dict()
    assert (rows[rows["dtype"] == "bf16"]["spill_store_bytes"] == 0).all()


@pytest.mark.skipif(not INTERPRET, reason="the error is for processes running the kernels under the interpreter")
def test_kernel_resources_in_an_interpreter_process_is_a_clear_error():
    from cs336_systems.bench import kernel_resources

    with pytest.raises(RuntimeError, match="process of their own"):
        kernel_resources.flash_module()
