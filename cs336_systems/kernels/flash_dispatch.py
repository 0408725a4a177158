"""Which forward kernel the `flash_triton` attention backend runs: the Gluon one (`flash_gluon.py`, Hopper only)
or the Triton FlashAttention-2 one (`flash_triton.py`, everywhere, the CPU interpreter included).

Both write the same O (q's layout) and L (natural-log logsumexp, float32, contiguous q.shape[:-1]), so either
forward feeds FA2's backward. The choice is made here and nowhere else: `choose_forward` is called by
`flash_triton.flash_forward`, which both the eager path and the custom op `cs336_systems::flash_triton_forward`
run, so `torch.compile` sees one opaque op whichever kernel runs inside it (no graph break, no guard on the
choice).

The path can be forced, for tests and benchmarks: `choose_forward(..., forward="triton")`, or for a whole process
the setting `FlashSettings.forward` (`use_flash_settings(forward="triton")`, or the environment variable
CS336_FLASH_FORWARD=auto|triton|gluon, read at each call, so a test or a benchmark can switch it between calls). A forced "gluon" that cannot run is a ValueError naming why, never a silent FA2 run.

`flash_gluon` is imported on first need only: machines that are not Hopper never load Triton's experimental
Gluon, whose API has changed with each Triton release.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton

from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.settings import ENV_VARS, FORWARDS, flash_settings

FORWARD_ENV = ENV_VARS["forward"]

# The Gluon kernel's wgmma and setmaxnreg exist on sm_90a only (H100, H200), not on later architectures.
HOPPER = (9, 0)
# Keys a query row attends to at most, from which the Gluon forward runs in "auto". Measured on an H100
# (kernels/NOTES.md, "Gluon forward (stage 1)", run 2, bf16): Gluon took 0.76-0.88x FA2's time at every shape
# with 4096 keys or more (d=128 at 4096 and 32768, causal or not; d=64 causal at 16384), and 1.02x at the one
# shorter shape (8 x 16 x 2048, d=64, non-causal), where FA2 stays. 2049-4095 keys are unmeasured: the threshold
# sits at the shortest measured win. Below it Gluon's host side (four TMA descriptors per call) would also weigh.
GLUON_MIN_KEYS = 4096


def forward_setting(forward: str | None = None) -> str:
    """`forward` if given, else the settings' (`FlashSettings.forward`: CS336_FLASH_FORWARD, default "auto")."""
    if forward is None:
        return flash_settings().forward
    if forward not in FORWARDS:
        raise ValueError(f"forward={forward!r}: choose one of {', '.join(FORWARDS)}")
    return forward


def gluon_pays(capability: tuple[int, int] | None, n_queries: int, n_keys: int, is_causal: bool) -> bool:
    """The shape rule of "auto": whether the Gluon forward was measured faster than FA2 at such a call.
    `capability` is the device's compute capability, None on the CPU or under Triton's interpreter. Causal rows
    see keys 0..i (aligned at the start of both sequences), so the longest row is min(n_queries, n_keys) keys."""
    if capability != HOPPER:
        return False
    longest_row = min(n_queries, n_keys) if is_causal else n_keys
    return longest_row >= GLUON_MIN_KEYS


def _capability(q: torch.Tensor) -> tuple[int, int] | None:
    if INTERPRET or not q.is_cuda:
        return None
    return _device_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # cached: the short-call path feels every microsecond


@functools.cache
def _gluon():
    """(the flash_gluon module, None), or (None, why it cannot be imported)."""
    try:
        from cs336_systems.kernels import flash_gluon
    except ImportError as error:
        return None, f"flash_gluon cannot be imported with triton {triton.__version__}: {error}"
    return flash_gluon, None


def gluon_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Gluon forward cannot take these inputs, or None."""
    if INTERPRET:
        return "flash_gluon: Triton's interpreter is on (TRITON_INTERPRET=1); the Gluon kernel needs the compiler"
    module, problem = _gluon()
    if module is None:
        return problem
    return module.layout_problem(q, k, v) or module.device_problem(q)


def choose_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   forward: str | None = None) -> str:
    """"gluon" or "triton": the kernel that computes this forward. `forward` (else CS336_FLASH_FORWARD, else
    "auto"): "auto" takes Gluon where the device is Hopper, the shape rule `gluon_pays` holds and the inputs are
    ones the kernel takes (bf16/fp16, head dim 64/128, TMA-aligned strides: flash_gluon.layout_problem), FA2
    otherwise; "triton" always FA2; "gluon" always Gluon, or a ValueError naming why it cannot."""
    setting = forward_setting(forward)
    if setting == "triton":
        return "triton"
    if setting == "gluon":
        problem = gluon_problem(q, k, v)
        if problem:
            raise ValueError(f"the Gluon forward was asked for (FlashSettings.forward, CS336_FLASH_FORWARD or forward='gluon'): {problem}")
        return "gluon"
    # auto: the cheap checks first, so short calls and other GPUs never import or inspect anything more
    if not gluon_pays(_capability(q), q.shape[-2], k.shape[-2], is_causal):
        return "triton"
    module, problem = _gluon()
    if module is None:
        warnings.warn(f"{problem}; the FA2 forward runs instead", stacklevel=2)
        return "triton"
    return "gluon" if module.gluon_supported(q, k, v, is_causal) else "triton"


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_gluon's forward (O, L), through the lazily imported module."""
    module, problem = _gluon()
    if module is None:
        raise ValueError(problem)
    return module.flash_attention_gluon_forward(q, k, v, is_causal)
