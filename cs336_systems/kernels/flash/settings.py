"""The FlashAttention-2 Triton kernels' settings: one frozen `FlashSettings`, read when a call needs it.

The defaults come from environment variables, read once, at the first call that needs the settings
(`os.environ`, the public mapping), each documented on its field below:

    CS336_FLASH_FAST_LAUNCH=0|1       fast_launch   (default 1)
    CS336_FLASH_FLOAT32_DOT=tf32x3|ieee  float32_dot (default tf32x3)
    CS336_FLASH_TMA=0|1               tma           (default 1)
    CS336_FLASH_FORWARD=auto|triton|gluon  forward  (default auto)
    CS336_FLASH_BACKWARD=auto|triton|gluon backward (default auto)
    CS336_FLASH_NATIVE=0|1            native        (default 1)

From code, `set_flash_settings(FlashSettings(...))` replaces them for the whole process (None goes
back to the environment's, as first read; `set_flash_settings(FlashSettings.from_env())` reads it again) and `use_flash_settings(tma=False, ...)` changes some fields for a `with`
block. Both are process-wide, not per thread: autograd runs a CUDA backward on a thread of its own,
which must see the settings its forward ran with.

Each setting is part of what the kernels are specialised or autotuned on (PRECISION, TMA) or of how
they are launched, so a change applies to the next call without stale tuning results. This module
imports neither Triton nor torch: reading the settings never defines or configures a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

# How float32 inputs may be multiplied (see FlashSettings.float32_dot).
FLOAT32_DOTS = ("tf32x3", "ieee")
# Which kernel computes the forward, and the backward (see FlashSettings.forward and .backward; the rules of
# "auto" are in dispatch.py).
FORWARDS = ("auto", "triton", "gluon")
BACKWARDS = ("auto", "triton", "gluon")
# The environment variable behind each field that has one.
ENV_VARS = {"fast_launch": "CS336_FLASH_FAST_LAUNCH", "float32_dot": "CS336_FLASH_FLOAT32_DOT",
            "tma": "CS336_FLASH_TMA", "forward": "CS336_FLASH_FORWARD", "backward": "CS336_FLASH_BACKWARD",
            "native": "CS336_FLASH_NATIVE"}
# The allowed values of each text field.
CHOICES = {"float32_dot": FLOAT32_DOTS, "forward": FORWARDS, "backward": BACKWARDS}


@dataclass(frozen=True)
class FlashSettings:
    """How the FlashAttention-2 Triton kernels run. The defaults are the ones measured best on an H100
    (DECISIONS.md#host-path).

    fast_launch: after the first call per argument layout, launch the compiled binary directly instead
        of going through Triton's autotuner, heuristics and binder again (host/launch.py). Off, every
        launch takes Triton's public path. Never used under the interpreter.
    float32_dot: how float32 inputs are multiplied. "tf32x3" splits each operand into a TF32 high part
        and a TF32 remainder and sums three tensor-core products (hi·hi + hi·lo + lo·hi), keeping about
        float32's accuracy; "ieee" multiplies on the CUDA cores, which keeps the operands in registers
        and spills at d >= 64 for every 16-bit tile. Plain "tf32" (10-bit mantissa) is not offered: it
        fails the float32 checks.
    tma: the forward loads Q, K, V and stores O through tensor descriptors (Hopper's tensor-copy
        engine) where the layout allows and there are at least `tma_min_keys` keys; off, pointer loads
        everywhere.
    tma_min_keys: the fewest keys for which the forward uses tensor descriptors; below it they were
        slower than pointer loads on the H100. Ignored under the interpreter, which takes the
        descriptor path at any length when `tma` is on (so CPU tests cover it).
    forward: which kernel computes the forward: "auto" (the Gluon kernel on sm_90 where it was measured
        faster, else the Triton FA2 kernel: `dispatch.choose_forward`), "triton" (FA2 always) or
        "gluon" (an error where it cannot run).
    backward: which kernel computes the backward, from the forward's O and L (either forward's: they write
        them alike): "auto" (the Gluon backward, gluon_bwd.py, on sm_90 where it was measured faster,
        else the Triton FA2 kernels: `dispatch.choose_backward`), "triton" (FA2 always) or "gluon" (an
        error where it cannot run). Read when the backward runs, which may be on autograd's own thread. The
        Gluon backward's dQ is summed by float32 reduce-adds in arrival order, so it is not bitwise repeatable
        across runs (FA2's is): "triton" where that matters.
    native: once a layout's forward and backward have run (and fast_launch is on), the `flash_triton`
        backend's later calls of that layout go through a C++ autograd node that launches the same binaries
        (FA2's and Gluon's), and compiled graphs' flash operators through the same C++ launches
        (host/node.py: it is built on first need and needs a C++ compiler, ninja and CUDA's headers;
        where it cannot be built the Python Function runs, after one warning). Off, always the Python launchers.
        Both passes' kernels are then fixed when the forward runs.
    """

    fast_launch: bool = True
    float32_dot: str = "tf32x3"
    tma: bool = True
    tma_min_keys: int = 16384
    forward: str = "auto"
    backward: str = "auto"
    native: bool = True

    def __post_init__(self):
        for field, choices in CHOICES.items():
            if getattr(self, field) not in choices:
                raise ValueError(f"{field}={getattr(self, field)!r}: choose one of {', '.join(choices)}")
        if self.tma_min_keys < 0:
            raise ValueError(f"tma_min_keys must be at least 0, got {self.tma_min_keys}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FlashSettings:
        """The defaults, with each field that has an environment variable (ENV_VARS) taken from it where set."""
        values = {}
        for field, var in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None:
                continue
            if isinstance(getattr(cls, field), bool):
                if raw not in ("0", "1"):
                    raise ValueError(f"{var}={raw!r}: use 1 (on) or 0 (off)")
                values[field] = raw == "1"
            elif raw not in CHOICES[field]:
                raise ValueError(f"{var}={raw!r}: choose one of {', '.join(CHOICES[field])}")
            else:
                values[field] = raw
        return cls(**values)


_chosen: FlashSettings | None = None  # set from code; None: the environment's
_from_env: FlashSettings | None = None  # the environment's, read once at the first call of flash_settings


def flash_settings() -> FlashSettings:
    """The settings in force now: those set from code, else the environment's, read once (at the first call)."""
    global _from_env
    if _chosen is not None:
        return _chosen
    if _from_env is None:
        _from_env = FlashSettings.from_env()
    return _from_env


def made_with(made, settings: FlashSettings) -> bool:
    """Whether `made` (a plan or anything else holding the `settings` it was made with; None: nothing made yet) was
    made with `settings`: the same object, usually, else equal ones."""
    return made is not None and (made.settings is settings or made.settings == settings)


def set_flash_settings(settings: FlashSettings | None) -> None:
    """Use `settings` from now on in this process; None goes back to the environment's."""
    global _chosen
    if settings is not None and not isinstance(settings, FlashSettings):
        raise TypeError(f"expected FlashSettings or None, got {type(settings).__name__}")
    _chosen = settings


@contextlib.contextmanager
def use_flash_settings(**changes) -> Iterator[FlashSettings]:
    """The settings in force with `changes` (FlashSettings fields) for the `with` block, then the
    previous ones again: `with use_flash_settings(tma=False): ...`."""
    previous = _chosen
    settings = dataclasses.replace(flash_settings(), **changes)
    set_flash_settings(settings)
    try:
        yield settings
    finally:
        set_flash_settings(previous)
