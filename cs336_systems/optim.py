"""AdamW (Loshchilov & Hutter, 2019), written to match torch.optim.AdamW step for step, and the choice
between our two update paths and torch's fused AdamW that the benchmarks make.

A training utility beside the model, not part of it: with `fused=True` it launches a Triton kernel
(`kernels/adamw_triton.py`), imported when a fused step first runs, so that `import cs336_systems`
does not import Triton (bench/kernel_resources.py configures Triton before importing it)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch


class AdamW(torch.optim.Optimizer):
    """Decoupled weight decay: p ← p − lr·λ·p, then the bias-corrected Adam update
    m ← β1 m + (1−β1) g,  v ← β2 v + (1−β2) g²,  p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε).

    The operations are ordered as in torch.optim.AdamW, so results agree with it to float32 rounding.
    With `foreach=True` (the default) each operation runs once over all tensors of a device, dtype
    and step count (`torch._foreach_*`, the multi-tensor kernels torch.optim itself uses; PyTorch has
    no public multi-tensor API): a per-tensor loop costs several kernel launches per parameter,
    which dominated the optimizer step of the xl model in our first measurements.
    With `fused=True` each tensor is updated by one Triton kernel (`kernels/adamw_triton.py`) that
    reads and writes each tensor once, where the multi-tensor update makes about 20 tensor passes.

    `state_dtype` is the dtype of the moments m and v (None: the parameter's, as torch.optim.AdamW).
    bf16 parameters with float32 moments keep Adam's statistics exact while the weights take 2 bytes;
    the update is computed in float32 (the fused kernel always; the multi-tensor path in the wider of the
    parameter's and the moments' dtypes, on temporary copies) and the parameter rounded once. Master
    weights (`keep_master_weights`) go one step further: the parameter is a bf16 copy of a float32 master
    that the step updates. `load_state_dict` keeps each state tensor's saved dtype (torch's casts
    floating-point state to its parameter's, which would narrow float32 moments and masters of bf16
    parameters).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        foreach: bool = True,
        fused: bool = False,
        state_dtype: torch.dtype | None = None,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate lr={lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas={betas}")
        if eps < 0:
            raise ValueError(f"invalid eps={eps}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                                      fused=fused, state_dtype=state_dtype))

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        current = [p for group in self.param_groups for p in group["params"]]
        super().load_state_dict(state_dict)
        for index, p in zip(saved, current):
            for key, value in state_dict["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(p.device, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Tensors that share device, dtype and step count are updated together.
            batches: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state_dtype = group.get("state_dtype") or state.get("master", p).dtype
                if "step" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
                elif state["exp_avg"].dtype != state_dtype:  # load_state_dict casts state to the param's dtype
                    state["exp_avg"] = state["exp_avg"].to(state_dtype)
                    state["exp_avg_sq"] = state["exp_avg_sq"].to(state_dtype)
                state["step"] += 1
                if group["fused"]:
                    # Launched at once: the GPU starts on the first tensor while Python walks the rest
                    # (waiting for the whole walk left the GPU idle: cs336_systems/kernels/DECISIONS.md).
                    self._update([p], group)
                    continue
                key = ((p.device, p.dtype, state_dtype, state["step"], "master" in state) if group["foreach"]
                       else (id(p),))
                batches[key].append(p)
            for params in batches.values():
                self._update(params, group)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        t = self.state[params[0]]["step"]
        if group["fused"]:
            from cs336_systems.kernels.adamw_triton import adamw_step_  # here: see the module's docstring

            from torch.distributed.tensor import DTensor

            (p,) = params
            state = self.state[p]
            if "master" in state:
                adamw_step_(state["master"], p.grad, state["exp_avg"], state["exp_avg_sq"], lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=wd, step=t, copy=p)
                return
            tensors = (p, p.grad, self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"])
            # torch's FSDP2 hands over DTensors; the update is elementwise, so it runs on the local shards.
            p, grad, exp_avg, exp_avg_sq = (x.to_local() if isinstance(x, DTensor) else x for x in tensors)
            adamw_step_(p, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                        step=t)
            return
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad for p in params]
        narrow = None
        if "master" in self.state[params[0]]:  # update the float32 masters, then round them into the parameters
            narrow, params = params, [self.state[p]["master"] for p in params]
        # Computed in the wider of the parameters' and the moments' dtypes, on copies where they differ.
        work = torch.promote_types(params[0].dtype, m[0].dtype)
        originals = (params, m, v)
        params, m, v, grads = (tensors if tensors[0].dtype == work else [x.to(work) for x in tensors]
                               for tensors in (params, m, v, grads))
        self._foreach_adamw(params, grads, m, v, lr, beta1, beta2, eps, wd, t)
        for original, updated in zip(originals, (params, m, v)):
            if updated is not original:
                torch._foreach_copy_(original, updated)
        if narrow is not None:
            torch._foreach_copy_(narrow, originals[0])

    @staticmethod
    def _foreach_adamw(params, grads, m, v, lr, beta1, beta2, eps, wd, t) -> None:
        step_size = lr / (1 - beta1**t)
        torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - beta2**t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-step_size)


def keep_master_weights(optimizer: AdamW, params, dtype: torch.dtype = torch.bfloat16) -> None:
    """Cast each of `params` (float32 parameters of `optimizer`) to `dtype` in place, its float32 value kept as
    `optimizer`'s master copy: the step updates the master (moments in float32) and rounds it into the parameter.
    Under autocast to `dtype`, where these are the weights of matmuls, a step with one backward computes what it
    would with float32 parameters, minus the casts: autocast would cast them to the same values each forward,
    and their gradients are the narrow ones widened (several backwards per step would add the gradients up in
    `dtype`, not float32). Call it before loading a checkpoint of `optimizer`: the masters are optimizer state,
    saved and loaded with it (in float32), and a `model.load_state_dict` afterwards would leave them stale."""
    if not isinstance(optimizer, AdamW):
        raise ValueError(f"master weights are kept by cs336_systems.optim.AdamW; got {type(optimizer).__name__}")
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for p in params:
        if p.dtype != torch.float32:
            raise ValueError(f"master weights are kept for float32 parameters; got {p.dtype}")
        if id(p) not in owned:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not one of the optimizer's")
        if type(p.data) is not torch.Tensor:  # a DTensor's shards are cast by its own wrapper, not here
            raise ValueError(f"master weights need plain tensors; got a {type(p.data).__name__}")
        optimizer.state[p]["master"] = p.detach().clone()
        p.data = p.data.to(dtype)


STATE_DTYPES = (None, torch.float32, torch.bfloat16)

# The AdamW implementations the benchmarks choose between: ours with multi-tensor operations, ours with
# one Triton kernel per tensor, and torch's fused AdamW.
ADAMW_IMPLEMENTATIONS = ("foreach", "fused", "torch_fused")


def adamw_implementation(name: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and the extra constructor arguments of one of ADAMW_IMPLEMENTATIONS, in the form
    wrappers that build the optimizer themselves (ZeRO) take."""
    if name == "torch_fused":
        return torch.optim.AdamW, {"fused": True}
    if name in ("foreach", "fused"):
        return AdamW, {"fused": name == "fused"}
    raise ValueError(f"unknown AdamW implementation {name!r}; known: {', '.join(ADAMW_IMPLEMENTATIONS)}")
