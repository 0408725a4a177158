"""Which kernels the `flash_triton` attention backend runs, chosen here and nowhere else:

    forward   the Gluon forward (`flash_gluon.py`, Hopper only)  or  the Triton FA2 forward (`flash_triton.py`)
    backward  the Gluon backward (`flash_gluon_bwd.py`, Hopper)  or  the Triton FA2 backward (`flash_triton.py`)

FA2 runs everywhere, the CPU interpreter included. Both forwards write the same O (q's layout) and L (natural-log
logsumexp, float32, contiguous q.shape[:-1]) and both backwards read just those, so each pass is chosen on its own
and any forward pairs with any backward. `choose_forward` is called by `flash_triton.flash_forward` and
`choose_backward` by `flash_triton.flash_backward`, which both the eager path and the custom ops
`cs336_systems::flash_triton_forward` / `cs336_systems::flash_triton_backward` run, so `torch.compile` sees one
opaque op per pass whichever kernel runs inside it (no graph break, no guard on the choice).

"auto" takes Gluon on sm_90 where the row rule holds (the longest query row sees at least GLUON_MIN_KEYS keys for
the forward, GLUON_BACKWARD_MIN_KEYS for the backward) and the kernel takes the inputs, FA2 otherwise. The
thresholds are the shortest shapes at which Gluon was measured faster on an H100: kernels/NOTES.md, "Gluon forward
(stage 1)" for the forward and "Wiring the backward" for the backward.

Either pass can be forced, for tests and benchmarks: `choose_forward(..., forward="triton")`,
`choose_backward(..., backward="gluon")`, or for a whole process the settings `FlashSettings.forward` and
`FlashSettings.backward` (`use_flash_settings(backward="triton")`, or the environment variables
CS336_FLASH_FORWARD / CS336_FLASH_BACKWARD = auto|triton|gluon, read at each call, so a test or a benchmark can
switch them between calls). A forced "gluon" that cannot run is a ValueError naming why, never a silent FA2 run.

`flash_gluon` and `flash_gluon_bwd` are imported on first need only: machines that are not Hopper never load
Triton's experimental Gluon, whose API has changed with each Triton release.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType

import torch
import triton

from cs336_systems.kernels.common import INTERPRET, cuda_capability
from cs336_systems.kernels.settings import CHOICES, ENV_VARS, flash_settings
from cs336_systems.kernels.settings import BACKWARDS, FORWARDS  # noqa: F401 (the choices, for callers)

FORWARD_ENV = ENV_VARS["forward"]
BACKWARD_ENV = ENV_VARS["backward"]

# The Gluon kernels' wgmma and setmaxnreg exist on sm_90a only (H100, H200), not on later architectures.
HOPPER = (9, 0)
# Keys a query row attends to at most, from which the Gluon forward runs in "auto". Measured on an H100
# (kernels/NOTES.md, "Gluon forward (stage 1)", run 2, bf16): Gluon took 0.76-0.88x FA2's time at every shape
# with 4096 keys or more (d=128 at 4096 and 32768, causal or not; d=64 causal at 16384), and 1.02x at the one
# shorter shape (8 x 16 x 2048, d=64, non-causal), where FA2 stays. 2049-4095 keys are unmeasured: the threshold
# sits at the shortest measured win. Below it Gluon's host side (four TMA descriptors per call) would also weigh.
GLUON_MIN_KEYS = 4096
# The same for the backward, from its own measurement (kernels/NOTES.md, "Wiring the backward"): Gluon's backward
# won at every shape from 4096 keys and lost at the one 2048-key shape, the forward's picture. Only square shapes
# were measured, so the row rule is the forward's; 2049-4095 keys are unmeasured.
GLUON_BACKWARD_MIN_KEYS = 4096


# ----------------------------------------------------------------------------------------------
# the settings and the shape rule
# ----------------------------------------------------------------------------------------------
def _setting(field: str, value: str | None) -> str:
    """`value` if given (checked), else the settings' field (from the environment unless set from code)."""
    if value is None:
        return getattr(flash_settings(), field)
    if value not in CHOICES[field]:
        raise ValueError(f"{field}={value!r}: choose one of {', '.join(CHOICES[field])}")
    return value


def forward_setting(forward: str | None = None) -> str:
    """`forward` if given, else the settings' (`FlashSettings.forward`: CS336_FLASH_FORWARD, default "auto")."""
    return _setting("forward", forward)


def backward_setting(backward: str | None = None) -> str:
    """`backward` if given, else the settings' (`FlashSettings.backward`: CS336_FLASH_BACKWARD, default "auto")."""
    return _setting("backward", backward)


def _longest_row_reaches(min_keys: int, capability: tuple[int, int] | None, n_queries: int, n_keys: int,
                         is_causal: bool) -> bool:
    """On Hopper, whether the longest query row sees at least `min_keys` keys. Causal rows see keys 0..i
    (aligned at the start of both sequences), so the longest row is min(n_queries, n_keys) keys."""
    if capability != HOPPER:
        return False
    longest_row = min(n_queries, n_keys) if is_causal else n_keys
    return longest_row >= min_keys


def gluon_pays(capability: tuple[int, int] | None, n_queries: int, n_keys: int, is_causal: bool) -> bool:
    """The shape rule of "auto" for the forward: whether the Gluon forward was measured faster than FA2's at such a
    call. `capability` is the device's compute capability, None on the CPU or under Triton's interpreter."""
    return _longest_row_reaches(GLUON_MIN_KEYS, capability, n_queries, n_keys, is_causal)


def gluon_backward_pays(capability: tuple[int, int] | None, n_queries: int, n_keys: int, is_causal: bool) -> bool:
    """The shape rule of "auto" for the backward, as `gluon_pays` with the backward's threshold."""
    return _longest_row_reaches(GLUON_BACKWARD_MIN_KEYS, capability, n_queries, n_keys, is_causal)


def device_capability(q: torch.Tensor) -> tuple[int, int] | None:
    """q's device's compute capability, cached per device; None on the CPU or under Triton's interpreter."""
    if INTERPRET or not q.is_cuda:
        return None
    return cuda_capability(q.device.index if q.device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------
# the Gluon modules, imported on first need
# ----------------------------------------------------------------------------------------------
@functools.cache
def _kernel_module(name: str) -> tuple[ModuleType | None, str | None]:
    """(the module cs336_systems.kernels.`name`, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module(f"cs336_systems.kernels.{name}"), None
    except ImportError as error:
        return None, f"{name} cannot be imported with triton {triton.__version__}: {error}"


_gluon = functools.partial(_kernel_module, "flash_gluon")
_gluon_bwd = functools.partial(_kernel_module, "flash_gluon_bwd")


def _module_problem(name: str, check: Callable[[ModuleType], str | None]) -> str | None:
    """Why the Gluon kernel of module `name` cannot run: the interpreter is on, the module does not import, or
    `check(module)` names a problem of the inputs; None if it can."""
    if INTERPRET:
        return f"{name}: Triton's interpreter is on (TRITON_INTERPRET=1); the Gluon kernel needs the compiler"
    module, problem = _kernel_module(name)
    return problem if module is None else check(module)


def gluon_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Gluon forward cannot take these inputs, or None."""
    return _module_problem("flash_gluon", lambda module: module.layout_problem(q, k, v) or module.device_problem(q))


def gluon_backward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           grad_out: torch.Tensor) -> str | None:
    """Why the Gluon backward cannot take these inputs (the forward's O and L, and dO), or None."""
    return _module_problem("flash_gluon_bwd", lambda module: module.backward_problem(q, k, v, out, grad_out, lse))


# ----------------------------------------------------------------------------------------------
# the choice
# ----------------------------------------------------------------------------------------------
def _choose(field: str, setting: str, *, problem: Callable[[], str | None], pays: bool,
            load: Callable[[], tuple[ModuleType | None, str | None]], supported: Callable[[ModuleType], bool]) -> str:
    """The rule both passes share: "triton" always FA2; "gluon" always Gluon, or a ValueError with `problem()`;
    "auto" Gluon where the shape rule `pays`, the module `load`s and `supported(module)` holds (the cheap checks
    first, so short calls and other GPUs never import or inspect anything more)."""
    if setting == "triton":
        return "triton"
    if setting == "gluon":
        why = problem()
        if why:
            raise ValueError(f"the Gluon {field} was asked for (FlashSettings.{field}, {ENV_VARS[field]} or "
                             f"{field}='gluon'): {why}")
        return "gluon"
    if not pays:
        return "triton"
    module, why = load()
    if module is None:
        warnings.warn(f"{why}; the FA2 {field} runs instead", stacklevel=3)
        return "triton"
    return "gluon" if supported(module) else "triton"


def choose_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   forward: str | None = None) -> str:
    """"gluon" or "triton": the kernel that computes this forward. `forward` (else CS336_FLASH_FORWARD, else
    "auto"): "auto" takes Gluon where the device is Hopper, the shape rule `gluon_pays` holds and the inputs are
    ones the kernel takes (bf16/fp16, head dim 64/128, TMA-aligned strides: flash_gluon.layout_problem), FA2
    otherwise; "triton" always FA2; "gluon" always Gluon, or a ValueError naming why it cannot."""
    return _choose("forward", forward_setting(forward), problem=lambda: gluon_problem(q, k, v),
                   pays=gluon_pays(device_capability(q), q.shape[-2], k.shape[-2], is_causal), load=_gluon,
                   supported=lambda module: module.gluon_supported(q, k, v, is_causal))


def choose_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, is_causal: bool, backward: str | None = None) -> str:
    """"gluon" or "triton": the kernel that computes this backward from the forward's O (`out`) and L (`lse`).
    `backward` (else CS336_FLASH_BACKWARD, else "auto"): "auto" takes Gluon where the device is Hopper, the shape
    rule `gluon_backward_pays` holds and the kernel takes the inputs (as the forward's, plus O and dO in q's shape
    and dtype, L contiguous float32: flash_gluon_bwd.backward_problem), FA2 otherwise; "triton" always FA2;
    "gluon" always Gluon, or a ValueError naming why it cannot."""
    return _choose("backward", backward_setting(backward),
                   problem=lambda: gluon_backward_problem(q, k, v, out, lse, grad_out),
                   pays=gluon_backward_pays(device_capability(q), q.shape[-2], k.shape[-2], is_causal), load=_gluon_bwd,
                   supported=lambda module: module.gluon_backward_supported(q, k, v, out, grad_out, lse))


# ----------------------------------------------------------------------------------------------
# the Gluon kernels' entry points, through the lazily imported modules
# ----------------------------------------------------------------------------------------------
def _loaded(load: Callable[[], tuple[ModuleType | None, str | None]]) -> ModuleType:
    module, problem = load()
    if module is None:
        raise ValueError(problem)
    return module


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *, chosen: bool = False,
                  fast_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_gluon's forward (O, L). `chosen`: `choose_forward` has just returned "gluon" for these inputs, which it
    does only where flash_gluon found no problem in them, so the kernel's entry does not look again. `fast_launch`:
    the caller's FlashSettings.fast_launch (None: read the settings)."""
    return _loaded(_gluon).flash_attention_gluon_forward(q, k, v, is_causal, checked=chosen, fast_launch=fast_launch)


def gluon_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool, *, chosen: bool = False,
                   fast_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_gluon_bwd's backward (dQ, dK, dV), taking its arguments in flash_backward_triton's order. `chosen`:
    `choose_backward` has just returned "gluon" for these inputs, which it does only where flash_gluon_bwd found no
    problem in them, so the kernel's entry does not look again. `fast_launch`: as gluon_forward's."""
    return _loaded(_gluon_bwd).flash_backward_gluon(q, k, v, out, grad_out, lse, is_causal, checked=chosen,
                                                    fast_launch=fast_launch)
