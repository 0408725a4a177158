"""The kernels' settings (kernels/flash/settings.py), read once, the launch fast path's check of
Triton (kernels/flash/host/launch.py) and its fallback, and what a kernel says when it cannot run on a tensor."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton

from cs336_systems.kernels.flash import api, fa2
from cs336_systems.kernels.flash import gluon_bwd as bwd
from cs336_systems.kernels.flash import settings as settings_module
from cs336_systems.kernels.flash.host import launch
from cs336_systems.kernels.flash.settings import (
    ENV_VARS,
    FlashSettings,
    flash_settings,
    set_flash_settings,
    use_flash_settings,
)
from cs336_systems.model.attention import naive_attention
from tests.kernel_devices import INTERPRET

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_flash_env(monkeypatch):
    """No CS336_FLASH_* variable set, the environment not read yet (as in a fresh process) and no settings chosen
    from code, whatever the caller's shell has."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(settings_module, "_from_env", None)
    set_flash_settings(None)
    yield monkeypatch
    set_flash_settings(None)


def test_environment_variables_are_read_once(no_flash_env):
    no_flash_env.setenv("CS336_FLASH_FLOAT32_DOT", "ieee")
    no_flash_env.setenv("CS336_FLASH_TMA", "0")
    assert flash_settings() == FlashSettings(float32_dot="ieee", tma=False)
    no_flash_env.setenv("CS336_FLASH_FAST_LAUNCH", "0")  # read once: a later change is not seen
    assert flash_settings() == FlashSettings(float32_dot="ieee", tma=False)
    set_flash_settings(FlashSettings.from_env())  # unless the settings are set from it again
    assert flash_settings() == FlashSettings(float32_dot="ieee", tma=False, fast_launch=False)
    set_flash_settings(None)  # back to the environment as first read
    assert flash_settings() == FlashSettings(float32_dot="ieee", tma=False)
    assert FlashSettings.from_env({}) == FlashSettings()


def test_bad_settings_are_clear_errors(no_flash_env):
    no_flash_env.setenv("CS336_FLASH_TMA", "yes")
    with pytest.raises(ValueError, match="CS336_FLASH_TMA='yes': use 1 .on. or 0 .off."):
        flash_settings()
    no_flash_env.setenv("CS336_FLASH_TMA", "1")  # a failed read keeps nothing: the next call reads again
    no_flash_env.setenv("CS336_FLASH_FLOAT32_DOT", "tf32")
    with pytest.raises(ValueError, match="CS336_FLASH_FLOAT32_DOT='tf32': choose one of tf32x3, ieee"):
        flash_settings()
    with pytest.raises(ValueError, match="float32_dot='tf32'"):
        FlashSettings(float32_dot="tf32")
    with pytest.raises(ValueError, match="tma_min_keys must be at least 0, got -1"):
        FlashSettings(tma_min_keys=-1)
    with pytest.raises(TypeError, match="got dict"):
        set_flash_settings({"tma": False})


def test_settings_from_code_override_the_environment_and_restore(no_flash_env):
    no_flash_env.setenv("CS336_FLASH_TMA", "0")
    with use_flash_settings(float32_dot="ieee") as outer:
        assert outer == flash_settings() == FlashSettings(float32_dot="ieee", tma=False)
        with use_flash_settings(tma=True, tma_min_keys=0):
            assert flash_settings() == FlashSettings(float32_dot="ieee", tma=True, tma_min_keys=0)
        assert flash_settings() == outer
    assert flash_settings() == FlashSettings(tma=False)
    set_flash_settings(FlashSettings(fast_launch=False))
    no_flash_env.setenv("CS336_FLASH_TMA", "1")  # chosen from code: the environment is not read
    assert flash_settings() == FlashSettings(fast_launch=False)


def test_settings_changed_after_import_reach_the_kernels(no_flash_env, kernel_device):
    """The forward's PRECISION and TMA follow the settings in force at each call, set from code long after the
    kernels were imported, and the output stays right."""
    seen = []

    class Spy:  # the forward's launcher, recording what it launches with
        def __init__(self, launcher):
            self.launcher = launcher

        def __call__(self, grid, *args, **kwargs):
            seen.append((kwargs["PRECISION"], kwargs["TMA"]))
            self.launcher(grid, *args, **kwargs)

    no_flash_env.setitem(fa2.LAUNCH, "forward", Spy(fa2.LAUNCH["forward"]))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen).to(kernel_device) for _ in range(3))
    expected = naive_attention(q.double(), k.double(), v.double(), True)

    def run():
        with fa2.pinned_tiles((32, 16, 4, 1), (32, 16, 4, 1)):  # on a GPU: no autotuning
            out = api.flash_attention_triton(q, k, v, True)
        assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-4, seen[-1]

    with use_flash_settings(tma=False):
        run()
    with use_flash_settings(tma=False, float32_dot="ieee"):
        run()
    tma_here = INTERPRET or torch.cuda.get_device_capability()[0] >= 9  # Hopper's copy engine, or the interpreter
    with use_flash_settings(tma=True, tma_min_keys=0):
        run()
    assert seen == [("tf32x3", False), ("ieee", False), ("tf32x3", tma_here)]


class KernelWithoutTritonInternals:
    """Launches like a Triton kernel (`kernel[grid](*args)`), without the internals the fast path reads."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_fast_launch_falls_back_to_the_public_path_with_one_warning(no_flash_env):
    no_flash_env.setattr(launch, "INTERPRET", False)  # as on a GPU: the fast path would be taken
    no_flash_env.setattr(launch, "_warned", set())
    kernel = KernelWithoutTritonInternals()
    launcher = launch.FastLauncher(kernel)
    assert launcher.problem == "KernelWithoutTritonInternals has no .arg_names"
    fallback = re.escape("has no .arg_names; launching through kernel[grid](...) instead")
    with pytest.warns(RuntimeWarning, match=fallback):
        launcher((4, 1), "x", 3, BLOCK=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough: a second warning would fail here
        launcher((4, 1), "y", 5, BLOCK=16)
        launch.FastLauncher(KernelWithoutTritonInternals())((1,), "z")
    assert kernel.launches == [((4, 1), ("x", 3), {"BLOCK": 16}), ((4, 1), ("y", 5), {"BLOCK": 16})]


def test_plain_int_grid_helpers_match_triton():
    """launch.cdiv and launch.next_power_of_2 replace Triton's on the hot path: the same values over a range that
    covers every power-of-two boundary a sequence length or head dim of ours crosses, random pairs included."""
    gen = torch.Generator().manual_seed(7)
    for n in [*range(1, 1100), *torch.randint(1, 1 << 20, (500,), generator=gen).tolist()]:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a, b in [*((a, b) for a in range(1, 200) for b in (1, 3, 16, 64, 128, 255)),
                 *torch.randint(1, 1 << 20, (500, 2), generator=gen).tolist()]:
        assert launch.cdiv(a, b) == triton.cdiv(a, b), (a, b)


class CompiledStub:
    """Stands for Triton's compiled kernel: `[grid]` gives a runner that records the arguments it is called with."""

    def __init__(self):
        self.runs = []

    def __getitem__(self, grid):
        return lambda *args: self.runs.append((grid, args))


def test_fast_path_passes_the_arguments_in_signature_order(no_flash_env):
    """After the first call of a layout, the runner gets every argument in the kernel's signature order: the
    positional ones, then the keywords (passed here in another order than the signature's); a new layout (here a
    new dtype) goes through the public path again, and so does every call with fast launch off."""
    no_flash_env.setattr(launch, "INTERPRET", False)
    kernel = bwd.PREPROCESS.kernel  # a plain JIT function: its signature is the arguments' order
    launcher = launch.FastLauncher(kernel)
    compiled, public = CompiledStub(), []
    launcher.kernel = type("Public", (), {"__getitem__": lambda self, grid: lambda *a, **kw: public.append(a)
                                          or compiled})()
    names = kernel.arg_names
    o, do, lse, rows = torch.zeros(2, 3, 8, 16), torch.zeros(2, 3, 8, 16), torch.zeros(2, 3, 8), torch.zeros(6, 8)
    args = (o, do, lse, rows, rows, torch.zeros(2, 3, 8, 16), *[384, 128, 16, 1] * 3, 3, 8, 8)
    assert len(args) + 2 == len(names)
    launcher((1, 6), *args, BLOCK=8, HEAD_DIM=16, fast_launch=True)
    launcher((1, 6), *args, BLOCK=8, HEAD_DIM=16, fast_launch=True)  # the same layout: the runner, HEAD_DIM first
    assert len(public) == 1 and compiled.runs == [((1, 6, 1), (*args, 16, 8))]
    launcher((1, 6), o.double(), *args[1:], BLOCK=8, HEAD_DIM=16, fast_launch=True)
    assert len(public) == 2 and len(compiled.runs) == 1
    launcher((1, 6), *args, BLOCK=8, HEAD_DIM=16, fast_launch=False)  # fast launch off: the public path
    assert len(public) == 3


def test_fast_path_is_only_taken_on_a_checked_triton_release(no_flash_env):
    kernel = fa2.TUNED_KERNELS["forward"]
    assert launch.fast_path_problem(kernel) is None  # the pinned Triton and its internals as checked
    assert launch.fast_path_problem(bwd.PREPROCESS.kernel) is None  # a plain JIT function too
    assert launch.fast_path_problem(kernel, version="3.9.0") == (
        "Triton 3.9.0 is not one of the checked releases " + ", ".join(launch.CHECKED_TRITON_VERSIONS))
    no_flash_env.setattr(launch, "INTERPRET", False)
    no_flash_env.setattr(triton, "__version__", "3.7.1")
    assert "Triton 3.7.1" in launch.FastLauncher(kernel).problem


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="the fast path launches compiled kernels")
def test_fast_path_caches_each_layout_on_the_gpu(no_flash_env):
    """On the checked Triton the fast path is taken, without a warning: after the first call of a layout,
    the binary is called directly, with the same result."""
    q, k, v = (torch.randn(1, 2, 100, 32, device="cuda") for _ in range(3))
    with warnings.catch_warnings(), fa2.pinned_tiles((64, 32, 4, 2), (64, 32, 4, 2)):
        warnings.simplefilter("error", RuntimeWarning)
        first = api.flash_attention_triton(q, k, v, True)
        assert len(fa2.LAUNCH["forward"].entries) == 1
        again = api.flash_attention_triton(q, k, v, True)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_import_sets_no_environment_and_cpu_tensors_without_the_interpreter_are_clear_errors():
    """In a process without TRITON_INTERPRET (the kernels defined compiled): importing the package sets
    nothing, and each Triton kernel refuses a CPU tensor, saying how to run it on the CPU."""
    code = """
import os
import torch
import cs336_systems
import cs336_systems.kernels
print(os.environ.get("TRITON_INTERPRET"))
from cs336_systems.kernels import flash_attention_triton
from cs336_systems.kernels.adamw_triton import adamw_step_
x = torch.randn(1, 8, 16)
calls = {"flash_triton": lambda: flash_attention_triton(x, x, x),
         "fused AdamW": lambda: adamw_step_(x, x.clone(), x.clone(), x.clone(), lr=1e-3, beta1=0.9, beta2=0.99,
                                            eps=1e-8, weight_decay=0.0, step=1)}
for name, call in calls.items():
    try:
        call()
    except ValueError as error:
        print(error)
    else:
        raise SystemExit(f"{name} ran on a CPU tensor without the interpreter")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "None"
    for line, name in zip(lines[1:], ("flash_triton", "fused AdamW"), strict=True):
        assert line.startswith(f"{name}: got a tensor on device cpu"), line
        assert "set TRITON_INTERPRET=1 before importing cs336_systems (or triton) to run them on the CPU" in line
