"""The optimizer's state kept on the host between steps (cs336_systems/offload.py): the same update as the optimizer
alone, bit for bit; where the state is between, during and after the steps; frozen, unused and tied parameters;
`state_dict` and `load_state_dict`; bad input. On the CPU the host is the same device (the bookkeeping, no gain);
the GPU test runs the real pinned copies and streams with our fused AdamW in bf16."""

import copy

import pytest
import torch
import torch.nn as nn

from cs336_systems.offload import offload_state
from cs336_systems.optim import AdamW


class _Net(nn.Module):
    """Embedding, two linears, a frozen layer, one never used, the output tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, 2 * width)
        self.back = nn.Linear(2 * width, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.back(torch.relu(self.hidden(h)))
        h = self.frozen(h)
        logits = h @ self.embed.weight.T
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, dims=1).flatten())


def _steps(model: nn.Module, optimizer, batches, offload=None, arm=True) -> None:
    """Steps of two passes each (gradient accumulation), the second armed when `offload` is given and `arm`."""
    for pair in batches:
        optimizer.zero_grad(set_to_none=True)
        for i, tokens in enumerate(pair):
            if offload is not None and arm and i == len(pair) - 1:
                offload.arm()
            (model(tokens) / len(pair)).backward()
        optimizer.step()


def _batches(vocab: int, steps: int = 3, device="cpu"):
    return [[torch.randint(vocab, (2, 7), device=device) for _ in range(2)] for _ in range(steps)]


@pytest.mark.parametrize("arm", [True, False])
@pytest.mark.parametrize("state_dtype", [None, torch.float32])
def test_the_update_is_the_optimizers_own_bit_for_bit(arm, state_dtype):
    torch.manual_seed(0)
    plain_model = _Net()
    model = copy.deepcopy(plain_model)
    plain = AdamW(plain_model.parameters(), lr=1e-2, state_dtype=state_dtype)
    optimizer = AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    offload = offload_state(optimizer)
    batches = _batches(11)
    _steps(plain_model, plain, batches)
    _steps(model, optimizer, batches, offload, arm)
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq"):
            if q in plain.state:
                assert torch.equal(optimizer.state[p][key], plain.state[q][key]), (name, key)
            else:
                assert p not in optimizer.state, name  # frozen and unused parameters get no state


def test_the_state_is_on_the_host_between_steps_and_back_once_its_gradient_is_final():
    torch.manual_seed(1)
    model = _Net()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    offload = offload_state(optimizer)
    _steps(model, optimizer, _batches(11, steps=1), offload)

    def at_home(p):
        return all(optimizer.state[p][k].data_ptr() == offload.homes[(id(p), k)].data_ptr()
                   for k in ("exp_avg", "exp_avg_sq"))

    stateful = [p for p in model.parameters() if p in optimizer.state]
    assert len(stateful) == 5 and all(at_home(p) for p in stateful)  # embed (tied), hidden, back: weight and bias
    assert len(offload.homes) == 2 * 5 and offload.away == set(stateful)
    tokens = torch.randint(11, (2, 7))
    optimizer.zero_grad(set_to_none=True)
    model(tokens).backward()  # not armed: nothing moves
    assert all(at_home(p) for p in stateful)
    offload.arm()
    model(tokens).backward()
    assert not any(at_home(p) for p in stateful) and not offload.away  # every used parameter's state came back
    optimizer.step()
    assert all(at_home(p) for p in stateful) and not offload.armed


def test_an_unused_parameter_s_state_comes_back_in_the_steps_pre_hook():
    """A parameter with state whose gradient the armed pass does not produce (its gradient from an earlier pass):
    its state comes back before the update, which matches the optimizer alone."""
    torch.manual_seed(2)
    model, extra = _Net(), nn.Parameter(torch.randn(3))
    plain_model, plain_extra = copy.deepcopy(model), extra.detach().clone().requires_grad_()
    optimizer = AdamW([*model.parameters(), extra], lr=1e-2)
    plain = AdamW([*plain_model.parameters(), plain_extra], lr=1e-2)
    offload = offload_state(optimizer)
    for step in range(3):
        tokens = torch.randint(11, (2, 7))
        for net, param, opt, off in ((model, extra, optimizer, offload), (plain_model, plain_extra, plain, None)):
            opt.zero_grad(set_to_none=True)
            (param.square().sum() + net(tokens)).backward()  # extra's gradient: this pass only
            if off is not None:
                off.arm()
            net(tokens).backward()
            opt.step()
    assert torch.equal(extra, plain_extra)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


def test_state_dict_and_load_state_dict_see_the_values():
    torch.manual_seed(3)
    model = _Net()
    plain_model = copy.deepcopy(model)
    optimizer, plain = AdamW(model.parameters(), lr=1e-2), AdamW(plain_model.parameters(), lr=1e-2)
    offload = offload_state(optimizer)
    batches = _batches(11, steps=2)
    _steps(model, optimizer, batches, offload)
    _steps(plain_model, plain, batches)
    saved, expected = optimizer.state_dict(), plain.state_dict()
    assert saved["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert (torch.equal(saved["state"][index][key], value) if torch.is_tensor(value)
                    else saved["state"][index][key] == value), (index, key)
    optimizer.load_state_dict(copy.deepcopy(saved))  # the state back on the device; the next step offloads it again
    assert not offload.away
    more = _batches(11, steps=1)
    _steps(model, optimizer, more, offload)
    _steps(plain_model, plain, more)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    offload.remove()  # the state home for good: a step leaves it where the optimizer put it
    _steps(model, optimizer, _batches(11, steps=1))
    assert not offload.away and all(optimizer.state[p]["exp_avg"].data_ptr() != offload.homes[(id(p), "exp_avg")]
                                    .data_ptr() for p in optimizer.state)


def test_parameters_on_two_devices_are_refused_by_name():
    optimizer = AdamW([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(ValueError, match="one device; got cpu, meta"):
        offload_state(optimizer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned copies on a side stream")
def test_on_the_gpu_the_state_leaves_the_device_and_the_fused_update_is_unchanged():
    torch.manual_seed(4)
    device = torch.device("cuda", torch.cuda.current_device())
    plain_model = _Net(vocab=257, width=256).to(device, torch.bfloat16)
    model = copy.deepcopy(plain_model)
    plain = AdamW(plain_model.parameters(), lr=1e-2, fused=True)
    optimizer = AdamW(model.parameters(), lr=1e-2, fused=True)
    offload = offload_state(optimizer)
    batches = _batches(257, device=device)
    _steps(plain_model, plain, batches)
    _steps(model, optimizer, batches[:1], offload)
    torch.cuda.synchronize(device)
    state_bytes = sum(2 * p.numel() * p.element_size() for p in plain.state)
    held = torch.cuda.memory_allocated(device)
    assert all(optimizer.state[p]["exp_avg"].device.type == "cpu" and optimizer.state[p]["exp_avg"].is_pinned()
               for p in optimizer.state)
    _steps(model, optimizer, batches[1:], offload)
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) == held  # the state's device copies freed after every step
    optimizer.zero_grad(set_to_none=True)
    model(batches[0][0]).backward()
    offload.fetch_all()
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) >= held + state_bytes  # fetched: on the device again
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), name
        if q in plain.state:
            assert torch.equal(optimizer.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"]), name
