"""Our FlashAttention-2 in bfloat16 against PyTorch's SDPA in bfloat16, both measured against float64.

For each case and seed: Q, K, V and dO drawn in float64, rounded once to bfloat16, and given to our
implementation and to SDPA (its flash backend on a GPU, the math backend on the CPU, where the flash
one does not exist); each one's O, dQ, dK and dV is compared with float64 autograd through naive
attention on the same (rounded) inputs. The error is relative in the Frobenius norm, ‖x − ref‖ / ‖ref‖.
The claim checked (`failures`): averaged over seeds, ours is no worse than SDPA's times a small factor,
plus a small absolute slack (bfloat16 rounds to 2⁻⁸ ≈ 3.9e-3 relative; the errors here are of that order).

On the CPU our Triton kernels run in Triton's interpreter, which cannot multiply bfloat16, so there the
rows are of our PyTorch implementation only. Used by `flash_check --accuracy-out` (the correctness rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.kernels import FlashAttentionPytorch, FlashAttentionTriton
from cs336_systems.model.attention import naive_attention

# (batch, heads, seq, d), causal: a GPU run's cases (odd lengths included) and a CPU run's small one.
CASES = {
    "cuda": [((2, 8, 1024, 64), True), ((2, 4, 1000, 128), False), ((1, 4, 4096, 64), True)],
    "cpu": [((1, 2, 77, 64), True)],  # one case: the CPU run is CI's, and each case recompiles our backward
}
TENSORS = ("O", "dQ", "dK", "dV")


def _impls(device: str) -> dict:
    impls = {"flash_pytorch": FlashAttentionPytorch.apply}
    if device == "cuda":  # the interpreter cannot multiply bfloat16
        impls["flash_triton"] = FlashAttentionTriton.apply
    return impls


def _sdpa(device: str):
    """SDPA with the backend the comparison is against, and that backend's name."""
    backend, name = (SDPBackend.FLASH_ATTENTION, "sdpa_flash") if device == "cuda" else (SDPBackend.MATH, "sdpa_math")

    def attend(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attend, name


def _outputs(fn, q, k, v, do, causal) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (Frobenius norms)."""
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy_rows(device: str = "cpu", seeds: int = 3, dtype: torch.dtype = torch.bfloat16,
                  cases: list | None = None) -> list[dict]:
    """One row per (implementation, case, seed, tensor): our error and SDPA's against float64."""
    if device not in CASES:
        raise ValueError(f"device must be one of {sorted(CASES)}, got {device!r}")
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    sdpa, reference = _sdpa(device)
    rows = []
    for (shape, causal) in cases or CASES[device]:
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            exact = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4)]
            low = [t.to(device=device, dtype=dtype) for t in exact]
            # the float64 reference sees the same rounded inputs, so only the computation's error counts
            ref = _outputs(naive_attention, *(t.double() for t in low), causal)
            theirs = _outputs(sdpa, *low, causal)
            for impl, apply in _impls(device).items():
                ours = _outputs(apply, *low, causal)
                for name, got, want, other in zip(TENSORS, ours, ref, theirs):
                    rows.append({"impl": impl, "reference": reference, "dtype": str(dtype).removeprefix("torch."),
                                 "shape": "x".join(map(str, shape)), "causal": causal, "seed": seed,
                                 "tensor": name, "ours_error": relative_error(got, want),
                                 "sdpa_error": relative_error(other, want)})
    return rows


def failures(rows: list[dict], factor: float = 1.1, slack: float = 2e-4) -> list[str]:
    """Per (implementation, shape, causal, tensor), where our mean error over seeds exceeds
    factor × SDPA's mean error + slack: one line each, naming the numbers."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["impl"], row["shape"], row["causal"], row["tensor"]), []).append(row)
    out = []
    for key, group in groups.items():
        ours = sum(r["ours_error"] for r in group) / len(group)
        theirs = sum(r["sdpa_error"] for r in group) / len(group)
        if not ours <= factor * theirs + slack:
            out.append(f"{key}: ours {ours:.3e}, SDPA {theirs:.3e} (limit {factor * theirs + slack:.3e})")
    return out
