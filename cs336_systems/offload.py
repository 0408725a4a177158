"""An optimizer's state kept in host memory between steps (`offload_state`), for a step whose activations need the
device memory that AdamW's moments would hold.

    after step():      each parameter's state tensors are copied to one pinned host buffer per dtype, on a side
                       stream; the device copies are freed once those copies are done
    arm(), then the last backward of the next step:
                       each parameter's state is copied back as soon as its gradient is final (its
                       post-accumulate-grad hook), overlapped with the rest of the backward
    before step():     whatever is still on the host comes back, and the step waits for every copy

So the first passes of a step run with no optimizer state on the device, and the last pass's backward gains it
layer by layer while its activations are freed. The update itself is the optimizer's own, on the same values:
bit-identical to the optimizer without the offload (tests/test_offload.py). Without `arm()` (or for a parameter
whose hook does not run) the state comes back in the step's pre-hook, which is correct but not overlapped.

A state tensor is moved when it has its parameter's shape (AdamW's moments, a master copy); scalars such as a
step count stay where they are. On a CPU the "host" buffer is another CPU tensor and the copies are synchronous:
the same bookkeeping, no gain."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["StateOffload", "offload_state"]


class StateOffload:
    """The hooks of `offload_state` on one optimizer; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        devices = sorted({str(p.device) for p in params})
        if len(devices) != 1:
            raise ValueError(f"offload_state needs every parameter on one device; got {', '.join(devices) or 'none'}")
        self.optimizer = optimizer
        self.device = params[0].device
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.homes: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key) -> its view of a host buffer
        self.away: set[torch.Tensor] = set()  # parameters whose state is on the host now (compared by identity)
        self.armed = False
        self.handles = [optimizer.register_step_pre_hook(lambda *_: self.fetch_all()),
                        optimizer.register_step_post_hook(lambda *_: self.offload()),
                        optimizer.register_state_dict_pre_hook(lambda *_: self.wait()),
                        optimizer.register_load_state_dict_post_hook(lambda *_: self.away.clear())]
        self.handles += [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in params if p.requires_grad]

    def _stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _moved(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state tensors of `p` that move: those of its shape."""
        return {key: t for key, t in self.optimizer.state.get(p, {}).items()
                if torch.is_tensor(t) and t.shape == p.shape}

    def _make_homes(self) -> None:
        """Host homes for the state tensors that have none yet: one buffer per dtype, pinned on CUDA."""
        missing: dict[torch.dtype, list[tuple[tuple[int, str], torch.Tensor]]] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, t in self._moved(p).items():
                    if (id(p), key) not in self.homes:
                        missing.setdefault(t.dtype, []).append(((id(p), key), t))
        for dtype, entries in missing.items():
            buffer = torch.empty(sum(t.numel() for _, t in entries), dtype=dtype, device="cpu",
                                 pin_memory=self.side is not None)
            offset = 0
            for name, t in entries:
                self.homes[name] = buffer[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()

    @torch.no_grad()
    def offload(self) -> None:
        """Copy every parameter's state to its host home and let the device copies go (after the step)."""
        self._make_homes()
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))  # the step has written the state
        with self._stream():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    moved = {} if p in self.away else self._moved(p)
                    for key, t in moved.items():
                        home = self.homes[(id(p), key)]
                        home.copy_(t, non_blocking=True)
                        if self.side is not None:
                            t.record_stream(self.side)  # freed for reuse only once this copy is done
                        self.optimizer.state[p][key] = home
                    if moved:
                        self.away.add(p)

    @torch.no_grad()
    def fetch(self, p: torch.Tensor) -> None:
        """Bring `p`'s state back to the device (queued on the side stream; `fetch_all` orders the step after it)."""
        if p not in self.away:
            return
        self.away.discard(p)
        state = self.optimizer.state[p]
        with self._stream():
            for key, home in self._moved(p).items():
                state[key] = home.to(self.device, non_blocking=True, copy=True)

    def fetch_all(self) -> None:
        """Every parameter's state back on the device, and the current stream ordered after the copies (before the
        step)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.fetch(p)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.armed = False

    def wait(self) -> None:
        """Block until every copy is done (before the state is read on the host, by `state_dict`)."""
        if self.side is not None:
            self.side.synchronize()

    def arm(self) -> None:
        """Fetch each parameter's state in the coming backward, once its gradient is final: call it before the
        step's last pass (the step's pre-hook disarms)."""
        self.armed = True

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if self.armed:
            self.fetch(p)

    def remove(self) -> None:
        """Bring the state home for good and remove every hook."""
        self.fetch_all()
        for handle in self.handles:
            handle.remove()


def offload_state(optimizer: torch.optim.Optimizer) -> StateOffload:
    """Keep `optimizer`'s state in host memory between steps, fetched back during the armed backward; see the
    module docstring."""
    return StateOffload(optimizer)
