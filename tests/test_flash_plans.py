"""The FA2 launchers' per-call-signature plans (fa2._Plan) and the lean runner (launch.lean_runner).

A plan keeps what a launcher derives from its inputs' layout and the settings, so a repeated call of one signature
skips that work: these check that a hit computes what a miss computes, bit for bit, on fresh inputs; that any change
of what the plan depends on (shape, strides, dtype, causality, settings, an environment variable) misses; that bad
input still fails with the same error after a plan exists; and that the lean runner calls Triton's C launcher as
Triton's own runner does.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels.flash import api, fa2
from cs336_systems.kernels.flash.host import launch
from cs336_systems.kernels.flash.settings import ENV_VARS, FlashSettings, set_flash_settings, use_flash_settings
from cs336_systems.model.attention import naive_attention
from tests.kernel_devices import INTERPRET

TILES = ((32, 16, 4, 1), (32, 16, 4, 1))  # one tile config per kernel: no autotuning (the interpreter is slow)


@pytest.fixture
def plans(monkeypatch):
    """No CS336_FLASH_* variable or code-chosen settings; a count of the launches derived afresh (plan misses)."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    set_flash_settings(None)
    derived = []
    real = fa2._launch_params

    def counted(q, k, settings):
        derived.append(settings)
        return real(q, k, settings)

    monkeypatch.setattr(fa2, "_launch_params", counted)
    with fa2.pinned_tiles(*TILES):
        yield derived
    set_flash_settings(None)


def _inputs(shape, device, dtype=torch.float32, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    if transposed:  # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
        b, h, n, d = shape
        return [torch.randn(b, n, h, d, generator=gen).to(device, dtype).transpose(1, 2) for _ in range(4)]
    return [torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(4)]


def _fwd_bwd(q, k, v, do, causal):
    out, lse = fa2.flash_forward_triton(q, k, v, causal)
    return (out, lse, *fa2.flash_backward_triton(q, k, v, out, lse, do, causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_plan_hit_computes_what_a_miss_computes(plans, kernel_device, causal, transposed):
    """Fresh random inputs of a layout planned by an earlier call (a hit: nothing derived again) give the same O,
    L, dQ, dK, dV bit for bit as the same inputs with every plan dropped (a miss), and both are right; awkward
    lengths (not tile multiples, 20 queries against 37 keys) and the model's transposed layout."""
    shape = (2, 3, 20, 24)
    q0, k0, v0, do0 = _inputs(shape, kernel_device, transposed=transposed)
    k0, v0 = (torch.cat([t, t[..., :17, :]], dim=-2) for t in (k0, v0))  # 37 keys
    _fwd_bwd(q0, k0, v0, do0, causal)  # plans this layout
    assert len(plans) == 2  # forward and backward each derived once
    q, k, v, do = _inputs(shape, kernel_device, seed=1, transposed=transposed)
    k, v = (torch.cat([t, t[..., :17, :]], dim=-2) for t in (k, v))
    assert all(a.stride() == b.stride() for a, b in zip((q, k, v, do), (q0, k0, v0, do0)))
    hit = _fwd_bwd(q, k, v, do, causal)
    assert len(plans) == 2, "the second call of the layout derived its launches again"
    launch.PLANS.clear()
    missed = _fwd_bwd(q, k, v, do, causal)
    assert len(plans) == 4
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), hit, missed):
        assert torch.equal(a, b), name
        assert a.stride() == b.stride(), name
    ref_q, ref_k, ref_v = (t.double().requires_grad_() for t in (q, k, v))
    ref = naive_attention(ref_q, ref_k, ref_v, causal)
    ref.backward(do.double())
    for name, got, want in zip(("O", "dQ", "dK", "dV"), (hit[0], *hit[2:]), (ref, ref_q.grad, ref_k.grad, ref_v.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-4, name


def test_a_change_of_what_the_plan_depends_on_misses(plans, kernel_device):
    """Each of shape, strides, dtype, causality and the settings (from code, or an environment variable set between
    calls) gives a plan of its own: the launch is derived again, with the new value (seen in what the launcher
    gets), and the result is right."""
    q, k, v, _ = _inputs((1, 2, 16, 16), kernel_device)
    seen = []

    class Spy:  # the forward's launcher, recording what each launch is given
        def __init__(self, launcher):
            self.launcher = launcher

        def __call__(self, grid, *args, **kwargs):
            seen.append((args[0].shape, args[5:9], args[0].dtype, kwargs["IS_CAUSAL"], kwargs["PRECISION"]))
            self.launcher(grid, *args, **kwargs)

    spy = Spy(fa2.LAUNCH["forward"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(fa2.LAUNCH, "forward", spy)

        def call(q, k, v, causal=True):
            expected = naive_attention(q.double(), k.double(), v.double(), causal)
            out, _ = fa2.flash_forward_triton(q, k, v, causal)
            assert ((out.double() - expected).norm() / expected.norm()).item() < 2e-2

        call(q, k, v)
        call(q, k, v)  # a hit: the same launch again, nothing derived
        assert len(plans) == 1 and len(seen) == 2 and seen[0] == seen[1]
        changes = [((q[..., :15, :], k, v), "shape"),
                   ((q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "strides"),
                   ((q.half(), k.half(), v.half()), "dtype")]
        for args, what in changes:
            call(*args)
            assert len(plans) == len(seen) - 1, what
            assert seen[-1] != seen[0], what
        call(q, k, v, causal=False)
        assert len(plans) == 5 and seen[-1][3] is False
        with use_flash_settings(float32_dot="ieee"):
            call(q, k, v)
        assert len(plans) == 6 and seen[-1][4] == "ieee"
        call(q, k, v)  # back to the environment's settings: the first plan's settings again, derived again
        assert len(plans) == 7 and seen[-1][4] == "tf32x3"
        set_flash_settings(FlashSettings(float32_dot="ieee"))  # the same change, set for the process
        call(q, k, v)
        assert len(plans) == 8 and seen[-1][4] == "ieee"
        set_flash_settings(None)
        call(q, k, v)
        assert len(plans) == 9 and seen[-1][4] == "tf32x3"


def test_bad_input_fails_as_before_after_a_plan_exists(plans, kernel_device):
    """A plan for a layout changes nothing for inputs the kernels do not take: the autograd Function's checks
    still raise their errors (a dtype mismatch, a head dim too large, mismatched shapes), and no plan is made."""
    q, k, v, _ = _inputs((1, 2, 16, 16), kernel_device)
    api.flash_attention_triton(q, k, v, True)
    made = len(plans)
    with pytest.raises(ValueError, match="FlashAttentionTriton: q, k, v must share a dtype"):
        api.flash_attention_triton(q, k.half(), v, True)
    big = torch.zeros(1, 2, 16, 129, device=kernel_device)
    with pytest.raises(ValueError, match="FlashAttentionTriton: head dim 129 is not supported"):
        api.flash_attention_triton(big, big, big, True)
    with pytest.raises(ValueError, match="FlashAttentionTriton: incompatible shapes"):
        api.flash_attention_triton(q, k[..., :8], v, True)
    assert len(plans) == made


def test_a_launch_that_raises_leaves_no_plan(plans, kernel_device):
    """A plan is kept only once its launches ran: a call whose launch raised is derived again next time."""
    q, k, v, _ = _inputs((1, 2, 16, 16), kernel_device)

    def broken(grid, *args, **kwargs):
        raise RuntimeError("launch failed")

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(fa2.LAUNCH, "forward", broken)
        with pytest.raises(RuntimeError, match="launch failed"):
            fa2.flash_forward_triton(q, k, v, True)
    assert not fa2._FORWARD_PLANS
    fa2.flash_forward_triton(q, k, v, True)
    assert len(plans) == 2 and len(fa2._FORWARD_PLANS) == 1


def test_clearing_a_launcher_drops_every_plan(plans, kernel_device):
    """New tile configs (pinned_tiles) clear the launchers, and with them the plans built on their entries."""
    q, k, v, do = _inputs((1, 2, 16, 16), kernel_device)
    _fwd_bwd(q, k, v, do, True)
    assert fa2._FORWARD_PLANS and fa2._BACKWARD_PLANS
    with fa2.pinned_tiles((16, 16, 4, 1), (16, 16, 4, 1)):
        assert not fa2._FORWARD_PLANS and not fa2._BACKWARD_PLANS
        _fwd_bwd(q, k, v, do, True)
    assert not fa2._FORWARD_PLANS and not fa2._BACKWARD_PLANS


@pytest.fixture
def recorded_launches(plans, monkeypatch):
    """As on a GPU (fast launch on, no interpreter), with Triton's compiled kernels replaced by recorders: the list
    of (grid, args) of every launch of a compiled kernel (the first call of a layout takes the public path, which
    launches nothing here)."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(fa2, "check_kernel_device", lambda t, name: None)  # CPU tensors, in any process
    runs = []

    class Compiled:  # Triton's compiled kernel: `[grid]` gives the runner, here a recorder
        def __getitem__(self, grid):
            return lambda *args: runs.append((grid, args))

    class Public:  # `kernel[grid](...)`: Triton's public path, which compiles (here: returns the recorder)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    for name, launcher in list(fa2.LAUNCH.items()):
        fresh = launch.FastLauncher(launcher.kernel)
        fresh.kernel = Public()
        if fresh.autotuner is not None:  # the tuned config Triton would have chosen: pinned_tiles' one
            monkeypatch.setattr(fresh.autotuner, "best_config", fresh.autotuner.configs[0], raising=False)
        monkeypatch.setitem(fa2.LAUNCH, name, fresh)
    return runs


def test_a_plan_hit_gives_the_binary_what_the_launcher_gives_it(plans, recorded_launches):
    """A plan hit hands each of the three binaries (forward; dQ with D, then dK dV) the arguments, in order, and the
    grid that the FastLauncher's own cached path hands it for the same call, without deriving anything."""
    runs = recorded_launches
    q, k, v, do = _inputs((2, 3, 20, 24), "cpu")
    out, lse = fa2.flash_forward_triton(q, k, v, True)  # first calls: the public path, plans made
    fa2.flash_backward_triton(q, k, v, out, lse, do, True)
    assert runs == [] and len(plans) == 2
    q, k, v, do = _inputs((2, 3, 20, 24), "cpu", seed=1)
    out, lse = fa2.flash_forward_triton(q, k, v, True)  # plan hits
    fa2.flash_backward_triton(q, k, v, out, lse, do, True)
    assert len(plans) == 2 and len(runs) == 3
    planned = list(runs)
    runs.clear()
    for table in ("fa2_forward", "fa2_backward", "fa2_backward_of_inputs"):  # the launchers keep their entries:
        launch.PLANS.table(table).clear()  # their cached path, with these inputs
    fa2.flash_forward_triton(q, k, v, True)
    fa2.flash_backward_triton(q, k, v, out, lse, do, True)
    assert len(plans) == 4 and len(runs) == 3
    inputs = {id(t): name for name, t in (("q", q), ("k", k), ("v", v), ("do", do))}

    def described(run):  # the call's inputs by name, O, L and fresh outputs by layout, every other value as it is
        grid, args = run
        return grid, [(inputs.get(id(a)) or (a.shape, a.stride(), a.dtype)) if isinstance(a, torch.Tensor) else a
                      for a in args]

    for got, want in zip(planned, runs, strict=True):
        assert described(got) == described(want)
    assert described(planned[0])[1][:5] == ["q", "k", "v", (out.shape, out.stride(), out.dtype),
                                            (lse.shape, lse.stride(), lse.dtype)]


# ----------------------------------------------------------------------------------------------
# the lean runner, on CPU: Triton's compiled-kernel and launcher classes around a recording C launch
# ----------------------------------------------------------------------------------------------
def _fake_compiled(monkeypatch, scratch=0):
    """A CompiledKernel with a CudaLauncher whose C `launch` records its arguments, and a current device and stream
    as torch's CUDA build would give them."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler.compiler import CompiledKernel

    calls = []
    launcher = object.__new__(CudaLauncher)
    launcher.launch = lambda *args: calls.append(args)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size, launcher.global_scratch_align = scratch, 128
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    compiled = object.__new__(CompiledKernel)
    compiled.module, compiled.function, compiled.packed_metadata, compiled._run = "module", 1234, (4, 1, 0), launcher
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    return compiled, launcher, calls


def test_lean_runner_calls_the_c_launcher_as_tritons_launcher_does(monkeypatch):
    """With no launch hook, the lean runner passes the C launch what Triton's CudaLauncher passes it for a runner
    call with no launch metadata and no hooks (the grid, the stream, the function, its flags, the packed metadata,
    then the kernel's arguments); with a hook registered it takes Triton's own runner, which calls the hook."""
    import triton
    import triton.compiler.compiler

    compiled, launcher, calls = _fake_compiled(monkeypatch)
    run = launch.lean_runner(compiled, (3, 2, 1))
    args = (torch.zeros(2), 5, 0.25)
    run(*args)
    type(launcher).__call__(launcher, 3, 2, 1, 77, 1234, (4, 1, 0), None, None, None, *args)  # Triton's own path
    assert len(calls) == 2 and calls[0] == calls[1]
    hooked = []
    monkeypatch.setattr(compiled, "launch_metadata", lambda grid, stream, *a: "metadata", raising=False)
    monkeypatch.setattr(triton.compiler.compiler, "driver", _FakeDriver(), raising=False)
    triton.knobs.runtime.launch_enter_hook.add(hooked.append)
    try:
        run(*args)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hooked.append)
    assert len(calls) == 3 and calls[2][10] == "metadata" and calls[2][11] is triton.knobs.runtime.launch_enter_hook


class _FakeDriver:
    """triton.runtime.driver's `active` driver as Triton's runner asks it for the current device and stream."""

    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 77)


def test_lean_runner_leaves_kernels_with_scratch_memory_to_triton(monkeypatch):
    """A kernel that needs global scratch memory (tensor descriptors built on the device) gets Triton's runner,
    which allocates it."""
    compiled, _, _ = _fake_compiled(monkeypatch, scratch=256)
    run = launch.lean_runner(compiled, (1, 1, 1))
    assert run.__qualname__.startswith("CompiledKernel.__getitem__")


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="launches compiled kernels")
def test_gpu_lean_runner_matches_tritons_runner(plans, monkeypatch):
    """On a GPU: forward and backward launched through plans and the lean runner give the same O, L, dQ, dK, dV bit
    for bit as through Triton's own runner, and a launch hook registered later is called at every launch (the lean
    runner hands those launches back to Triton's runner)."""
    import triton

    q, k, v, do = _inputs((2, 3, 100, 64), "cuda", dtype=torch.bfloat16, transposed=True)

    def twice():  # the first call of a layout takes Triton's public path; the second the cached one
        _fwd_bwd(q, k, v, do, True)
        return _fwd_bwd(q, k, v, do, True)

    lean = twice()
    with monkeypatch.context() as patch:
        patch.setattr(launch, "lean_runner", lambda compiled, grid: compiled[grid])
        launch.PLANS.clear()  # every launcher's binaries and the plans made from them
        tritons = twice()
    launch.PLANS.clear()
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), lean, tritons):
        assert torch.equal(a, b), name
    twice()
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 (a LazyDict)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        hooked = _fwd_bwd(q, k, v, do, True)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_flash_fwd_kernel", "_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"], seen  # dQ (and D) first
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), hooked, lean):
        assert torch.equal(a, b), name
