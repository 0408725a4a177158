"""Which kernels the `flash_triton` attention backend runs, chosen here and nowhere else:

    forward   the Gluon forward (`gluon_fwd.py`, Hopper only)  or  the Triton FA2 forward (`fa2.py`)
    backward  the Gluon backward (`gluon_bwd.py`, Hopper only) or  the Triton FA2 backward (`fa2.py`)

FA2 runs everywhere, the CPU interpreter included. Both forwards write the same O (q's layout) and L (natural-log
logsumexp, float32, contiguous q.shape[:-1]) and both backwards read just those, so each pass is chosen on its own
and any forward pairs with any backward. `flash_forward` and `flash_backward` choose and run a pass; api.py's
autograd Function and custom ops call them, so `torch.compile` sees one opaque op per pass whichever kernel runs
inside it (no graph break, no guard on the choice). `native_passes` gathers, for the C++ node, the binaries of the
kernels both passes of a layout would choose.

"auto" takes Gluon where the device is Hopper, the shape rule of the pass at the head dim holds and the kernel
takes the inputs, FA2 otherwise (`_choose`, the cheap checks first). The shape rules are data, one per head dim
with its reason (`GLUON_FORWARD_RULES`, `GLUON_BACKWARD_RULES`: the longest query row sees enough keys and the
call computes enough attention scores), where Gluon was measured faster on an H100, as flash-attention's
hopper/tile_size.h writes its choices (DECISIONS.md#dispatch-thresholds).

Either pass can be forced, for tests and benchmarks: `choose_forward(..., forward="triton")`,
`choose_backward(..., backward="gluon")`, or for a whole process the settings `FlashSettings.forward` and
`FlashSettings.backward` (`use_flash_settings(backward="triton")`, or the environment variables
CS336_FLASH_FORWARD / CS336_FLASH_BACKWARD = auto|triton|gluon, read once). A forced "gluon" that cannot run is a
ValueError naming why, never a silent FA2 run.

`gluon_fwd` and `gluon_bwd` are imported on first need only: machines that are not Hopper never load Triton's
experimental Gluon, whose API has changed with each Triton release.
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import triton

from cs336_systems.kernels.common import INTERPRET, device_capability
from cs336_systems.kernels.flash import fa2
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.host.launch import PLANS, layout
from cs336_systems.kernels.flash.settings import CHOICES, ENV_VARS, FlashSettings, flash_settings
from cs336_systems.kernels.flash.settings import BACKWARDS, FORWARDS  # noqa: F401 (the choices, for callers)

FORWARD_ENV = ENV_VARS["forward"]
BACKWARD_ENV = ENV_VARS["backward"]

# The Gluon kernels' wgmma and setmaxnreg exist on sm_90a only (H100, H200), not on later architectures.
HOPPER = (9, 0)


@dataclass(frozen=True)
class GluonRule:
    """From where a Gluon pass runs in "auto", at one head dim: the longest query row sees at least `min_keys` keys
    and the call computes at least `min_scores` attention scores (`attention_scores`: batch x heads x the (query,
    key) pairs computed, about half of them under causal masking). Below either, FA2 was measured as fast or
    faster (`reason`)."""

    min_keys: int
    min_scores: int
    reason: str = ""

    def holds(self, q_shape: Sequence[int], k_shape: Sequence[int], is_causal: bool) -> bool:
        n_queries, n_keys = q_shape[-2], k_shape[-2]
        longest_row = min(n_queries, n_keys) if is_causal else n_keys
        return longest_row >= self.min_keys and attention_scores(q_shape, k_shape, is_causal) >= self.min_scores


# The shape rules of "auto", per head dim (DECISIONS.md#dispatch-thresholds): FA2 against Gluon, both passes forced,
# over flash_llm_shapes' grid from 1024 to 4096 keys on an H100. The backward was measured in the same runs
# (forward+backward less forward) and gave the forward's picture, so it has the same rules.
GLUON_FORWARD_RULES = {
    64: GluonRule(min_keys=2048, min_scores=2**28,
                  reason="below 2048 keys or 2^28 scores Gluon lost to FA2 (short rows leave its pipeline little to "
                         "overlap)"),
    128: GluonRule(min_keys=1024, min_scores=2**27,
                   reason="from 2^27 scores Gluon took 0.76-0.94x FA2's time; below, the calls are host-bound and "
                          "Gluon's heavier host side lost"),
}
GLUON_BACKWARD_RULES = dict(GLUON_FORWARD_RULES)


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


def attention_scores(q_shape: Sequence[int], k_shape: Sequence[int], is_causal: bool) -> int:
    """Scores a call computes: batch x heads x (query, key) pairs, where causal row i (aligned at the start of both
    sequences) sees keys 0..i, i.e. min(i + 1, n_keys) of them."""
    n_queries, n_keys = q_shape[-2], k_shape[-2]
    if not is_causal:
        pairs = n_queries * n_keys
    else:
        ramp = min(n_queries, n_keys)  # rows 0..ramp-1 see i + 1 keys, the rest all n_keys
        pairs = ramp * (ramp + 1) // 2 + (n_queries - ramp) * n_keys
    return math.prod(q_shape[:-2]) * pairs


def _rule_holds(rules: dict[int, GluonRule], capability: tuple[int, int] | None, q_shape: Sequence[int],
                k_shape: Sequence[int], is_causal: bool) -> bool:
    rule = rules.get(q_shape[-1])
    return capability == HOPPER and rule is not None and rule.holds(q_shape, k_shape, is_causal)


def gluon_pays(capability: tuple[int, int] | None, q_shape: Sequence[int], k_shape: Sequence[int],
               is_causal: bool) -> bool:
    """The shape rule of "auto" for the forward: whether the Gluon forward was measured faster than FA2's at such a
    call (`GLUON_FORWARD_RULES` at q's head dim; none for head dims Gluon does not take). `capability` is the device's
    compute capability, None on the CPU or under Triton's interpreter."""
    return _rule_holds(GLUON_FORWARD_RULES, capability, q_shape, k_shape, is_causal)


def gluon_backward_pays(capability: tuple[int, int] | None, q_shape: Sequence[int], k_shape: Sequence[int],
                        is_causal: bool) -> bool:
    """The shape rule of "auto" for the backward, as `gluon_pays` with `GLUON_BACKWARD_RULES`."""
    return _rule_holds(GLUON_BACKWARD_RULES, capability, q_shape, k_shape, is_causal)


# ----------------------------------------------------------------------------------------------
# the Gluon modules, imported on first need
# ----------------------------------------------------------------------------------------------
@functools.cache
def _kernel_module(name: str) -> tuple[ModuleType | None, str | None]:
    """(the module cs336_systems.kernels.flash.`name`, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module(f"cs336_systems.kernels.flash.{name}"), None
    except ImportError as error:
        return None, f"{name} cannot be imported with triton {triton.__version__}: {error}"


_gluon = functools.partial(_kernel_module, "gluon_fwd")
_gluon_bwd = functools.partial(_kernel_module, "gluon_bwd")


def _module_problem(name: str, check: Callable[[ModuleType], str | None]) -> str | None:
    """Why the Gluon kernel of module `name` cannot run: the interpreter is on, the module does not import, or
    `check(module)` names a problem of the inputs; None if it can."""
    if INTERPRET:
        return f"{name}: Triton's interpreter is on (TRITON_INTERPRET=1); the Gluon kernel needs the compiler"
    module, problem = _kernel_module(name)
    return problem if module is None else check(module)


def gluon_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Gluon forward cannot take these inputs, or None."""
    return _module_problem("gluon_fwd", lambda module: module.layout_problem(q, k, v) or module.device_problem(q))


def gluon_backward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           grad_out: torch.Tensor) -> str | None:
    """Why the Gluon backward cannot take these inputs (the forward's O and L, and dO), or None."""
    return _module_problem("gluon_bwd", lambda module: module.backward_problem(q, k, v, out, grad_out, lse))


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
    ones the kernel takes (bf16/fp16, head dim 64/128, TMA-aligned strides: gluon_fwd.layout_problem), FA2
    otherwise; "triton" always FA2; "gluon" always Gluon, or a ValueError naming why it cannot."""
    return _choose("forward", forward_setting(forward), problem=lambda: gluon_problem(q, k, v),
                   pays=gluon_pays(device_capability(q), q.shape, k.shape, is_causal), load=_gluon,
                   supported=lambda module: module.gluon_supported(q, k, v, is_causal))


def choose_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, is_causal: bool, backward: str | None = None) -> str:
    """"gluon" or "triton": the kernel that computes this backward from the forward's O (`out`) and L (`lse`).
    `backward` (else CS336_FLASH_BACKWARD, else "auto"): "auto" takes Gluon where the device is Hopper, the shape
    rule `gluon_backward_pays` holds and the kernel takes the inputs (as the forward's, plus O and dO in q's shape
    and dtype, L contiguous float32: gluon_bwd.backward_problem), FA2 otherwise; "triton" always FA2;
    "gluon" always Gluon, or a ValueError naming why it cannot."""
    return _choose("backward", backward_setting(backward),
                   problem=lambda: gluon_backward_problem(q, k, v, out, lse, grad_out),
                   pays=gluon_backward_pays(device_capability(q), q.shape, k.shape, is_causal), load=_gluon_bwd,
                   supported=lambda module: module.gluon_backward_supported(q, k, v, out, grad_out, lse))


# choose_passes' answers by (the inputs' layout, is_causal, the two settings), all they depend on: a layout whose
# backward never runs (no_grad calls) asks at every call while the C++ node for it is pending
_PASS_CHOICES = PLANS.table("pass_choices")


def choose_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, settings: FlashSettings
                  ) -> tuple[str, str]:
    """The kernels of both passes of a call of these inputs with `settings`, where the backward gets the forward's O
    (q's shape, dtype and layout) and L and a dense dO: (choose_forward's, choose_backward's). What the C++ node
    fixes for a layout when its forward runs. Remembered per layout (at most 4096)."""
    key = (layout(q, k, v), is_causal, settings.forward, settings.backward)
    chosen = _PASS_CHOICES.get(key)
    if chosen is None:
        forward = choose_forward(q, k, v, is_causal, forward=settings.forward)
        # q stands in for O and dO (the same shape, dtype, device and, O being empty_like(q), layout); L is made here
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        chosen = (forward, choose_backward(q, k, v, q, lse, q, is_causal, backward=settings.backward))
        if len(_PASS_CHOICES) >= 4096:
            _PASS_CHOICES.clear()
        _PASS_CHOICES[key] = chosen
    return chosen


# ----------------------------------------------------------------------------------------------
# the passes, chosen and run
# ----------------------------------------------------------------------------------------------
def _loaded(load: Callable[[], tuple[ModuleType | None, str | None]]) -> ModuleType:
    module, problem = load()
    if module is None:
        raise ValueError(problem)
    return module


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and L of the kernel `choose_forward` picks: on Hopper at long sequences the Gluon forward, else FA2's.
    The settings are read once here, for the whole call."""
    settings = flash_settings()
    if choose_forward(q, k, v, is_causal, forward=settings.forward) == "gluon":
        return gluon_forward(q, k, v, is_causal, chosen=True, fast_launch=settings.fast_launch)
    return fa2.flash_forward_triton(q, k, v, is_causal, settings)


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the kernel `choose_backward` picks, independently of which forward wrote O and L (both write
    them alike): on Hopper at long sequences the Gluon backward, else FA2's. The settings are read once here."""
    settings = flash_settings()
    if choose_backward(q, k, v, out, lse, grad_out, is_causal, backward=settings.backward) == "gluon":
        return gluon_backward(q, k, v, out, lse, grad_out, is_causal, chosen=True, fast_launch=settings.fast_launch)
    return fa2.flash_backward_triton(q, k, v, out, lse, grad_out, is_causal, settings)


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *, chosen: bool = False,
                  fast_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon forward (O, L). `chosen`: `choose_forward` has just returned "gluon" for these inputs, which it does
    only where gluon_fwd found no problem in them, so the kernel's entry does not look again. `fast_launch`: the
    caller's FlashSettings.fast_launch (None: read the settings)."""
    return _loaded(_gluon).flash_attention_gluon_forward(q, k, v, is_causal, checked=chosen, fast_launch=fast_launch)


def gluon_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool, *, chosen: bool = False,
                   fast_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gluon backward (dQ, dK, dV), taking its arguments in FA2's order. `chosen`: `choose_backward` has just
    returned "gluon" for these inputs, which it does only where gluon_bwd found no problem in them, so the kernel's
    entry does not look again. `fast_launch`: as gluon_forward's."""
    return _loaded(_gluon_bwd).flash_backward_gluon(q, k, v, out, grad_out, lse, is_causal, checked=chosen,
                                                    fast_launch=fast_launch)


def native_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, settings: FlashSettings
                  ) -> node.NativePasses | None:
    """What the C++ node launches for calls of these inputs with `settings`: the binaries of the kernels
    `choose_passes` picks for both passes, once the forward and a backward (with the forward's O and L and a dense
    dO) have each run through their Python plans with fast launch; None before, or where a plan has no binary.
    FA2's plans are used only with the settings they were made with."""
    forward_kernel, backward_kernel = choose_passes(q, k, v, is_causal, settings)
    if forward_kernel == "gluon":
        forward = _loaded(_gluon).native_calls(q, k, v, is_causal)
    else:
        forward = fa2.native_forward_calls(q, k, v, is_causal, settings)
    if forward is None:
        return None
    if backward_kernel == "gluon":
        backward = _loaded(_gluon_bwd).native_calls(q, k, v, is_causal)
    else:
        backward = fa2.native_backward_calls(q, k, v, is_causal, settings)
    return None if backward is None else node.NativePasses(forward, *backward)
