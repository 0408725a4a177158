"""The fused LM head + cross-entropy against a float64 reference (and the plain bf16 path's own error).

Sizes are tiny because the kernel runs under Triton's interpreter here; the vocab (37) is not a power of
two and, with block_v=16, takes three blocks per row (the last one ragged)."""

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.bench.linear_ce import LinearCEConfig, run
from cs336_systems.kernels import fused_linear_ce
from cs336_systems.kernels.fused_linear_ce import (
    cross_entropy_grad_,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)

VOCAB, D = 37, 16
# On a GPU machine the kernel is compiled for the GPU (no interpreter), so the inputs must live there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape=(2, 7), dtype=torch.float32, seed=0, ignore=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, D, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(VOCAB, D, generator=g) / D**0.5).to(DEVICE, dtype)
    targets = torch.randint(0, VOCAB, shape, generator=g).to(DEVICE)
    targets.view(-1)[:ignore] = -100
    return hidden, weight, targets


def _float64_reference(hidden, weight, targets):
    """Loss and gradients of F.cross_entropy(hidden @ Wᵀ) in float64 from the same (rounded) inputs."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy((h @ w.T).reshape(-1, w.shape[0]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _ours(hidden, weight, targets, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _rel_errors(got, want):
    """Max abs error of each tensor over the max abs of its reference."""
    return [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, want)]


@pytest.mark.parametrize("chunk_tokens, block_v", [(1, None), (4, 16), (100, 16)])
def test_float32_matches_float64(chunk_tokens, block_v):
    hidden, weight, targets = _inputs()  # 14 tokens: chunks of 4 leave a ragged last chunk
    errors = _rel_errors(_ours(hidden, weight, targets, chunk_tokens=chunk_tokens, block_v=block_v),
                         _float64_reference(hidden, weight, targets))
    assert max(errors) < 1e-5, errors


def test_ignore_index_is_left_out_of_loss_and_mean():
    hidden, weight, targets = _inputs(ignore=5)
    ours = _ours(hidden, weight, targets, chunk_tokens=3, block_v=16)
    assert max(_rel_errors(ours, _float64_reference(hidden, weight, targets))) < 1e-5
    assert torch.allclose(ours[0], linear_cross_entropy_ref(hidden, weight, targets), rtol=1e-6)
    assert ours[1].reshape(-1, D)[:5].abs().max() == 0  # ignored tokens get no gradient


def _plain(hidden, weight, targets):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy_ref(h, w, targets)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _check_16_bit(ours, plain, want):
    """Within a few bf16 ulps (2^-8 = 3.9e-3) of float64, and within 2x the plain path's error."""
    ours, plain = _rel_errors(ours, want), _rel_errors(plain, want)
    assert max(ours) < 2e-2, ours
    for name, e_ours, e_plain in zip(("loss", "grad_hidden", "grad_weight"), ours, plain):
        assert e_ours <= 2 * e_plain + 1e-4, (name, e_ours, e_plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_within_twice_the_plain_path_error(dtype):
    hidden, weight, targets = _inputs(shape=(3, 5), dtype=dtype, seed=1)
    _check_16_bit(_ours(hidden, weight, targets, chunk_tokens=4, block_v=16), _plain(hidden, weight, targets),
                  _float64_reference(hidden, weight, targets))


def test_autocast_casts_float32_inputs_like_linear():
    """float32 hidden and weight under bf16 autocast: computed in bf16, gradients in float32 (the inputs'
    dtypes), as accurate as the plain path under the same autocast."""
    hidden, weight, targets = _inputs(seed=2)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ours = _ours(hidden, weight, targets, chunk_tokens=5, block_v=16)
        plain = _plain(hidden, weight, targets)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    _check_16_bit(ours, plain, _float64_reference(hidden, weight, targets))


def test_gradients_scale_with_grad_output():
    hidden, weight, targets = _inputs(shape=(6,), seed=3)
    _, grad_h, grad_w = _ours(hidden, weight, targets, chunk_tokens=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (-2.5 * linear_cross_entropy(h, w, targets, chunk_tokens=4)).backward()
    torch.testing.assert_close(h.grad, -2.5 * grad_h)
    torch.testing.assert_close(w.grad, -2.5 * grad_w)


def test_frozen_weight_and_no_grad(monkeypatch):
    """Only the gradients autograd will ask for are computed: none under no_grad, dW not for a frozen W."""
    asked = []
    forward_and_grads = fused_linear_ce._forward_and_grads
    monkeypatch.setattr(fused_linear_ce, "_forward_and_grads", lambda *args, **kwargs: (
        asked.append((kwargs["need_hidden_grad"], kwargs["need_weight_grad"])) or forward_and_grads(*args, **kwargs)))
    hidden, weight, targets = _inputs(shape=(5,), seed=4)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, targets).backward()
    _, want_h, _ = _float64_reference(hidden, weight, targets)
    assert _rel_errors([h.grad], [want_h])[0] < 1e-5 and weight.grad is None
    with torch.no_grad():
        loss = linear_cross_entropy(h, weight.requires_grad_(), targets)
    assert torch.allclose(loss.double(), _float64_reference(hidden, weight, targets)[0], rtol=1e-6)
    assert asked == [(True, False), (False, False)]


def test_second_backward_accumulates_the_same_gradient():
    """The backward scales the stored gradients out of place, so it can run again (retain_graph)."""
    hidden, weight, targets = _inputs(shape=(3,))
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, targets)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    (3 * loss).backward()
    torch.testing.assert_close(h.grad, 4 * first)


def test_custom_op_registration_passes_opcheck():
    """The operator's schema, fake (meta) implementation and autograd formula against its real
    implementation (torch.library.opcheck: fake tensors, schema aliasing, AOT dispatch)."""
    hidden, weight, targets = _inputs(shape=(9,), seed=6)
    for need in [(True, True), (True, False), (False, False)]:
        args = (hidden.requires_grad_(need[0]), weight.requires_grad_(need[1]), targets, torch.float32, 4, -100,
                16, *need)
        torch.library.opcheck(torch.ops.cs336_systems.linear_cross_entropy.default, args)


def test_compiles_into_one_graph_with_the_model_around_it():
    """torch.compile(fullgraph=True) of a function that calls linear_cross_entropy between other ops:
    no graph break (fullgraph raises on one), and loss and gradients equal the eager call's.
    aot_eager runs the captured graphs without Inductor's C++ compiler."""
    hidden, weight, targets = _inputs(shape=(2, 5), seed=7)

    def step(h, w):
        return linear_cross_entropy(torch.tanh(h) * 2, w, targets) * 0.5

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    explained = torch._dynamo.explain(step)(hidden.clone().requires_grad_(), weight.clone().requires_grad_())
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_kernel_rows_match_softmax_minus_onehot():
    """The per-row kernel alone, bf16 logits stored in place: loss and gradient rows against float64."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(4, VOCAB, generator=g)).to(DEVICE, torch.bfloat16)
    targets = torch.tensor([0, VOCAB - 1, -100, 17], device=DEVICE)
    z = logits.double()
    want_loss = torch.logsumexp(z, -1) - z.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    want_grad = (torch.softmax(z, -1) - F.one_hot(targets.clamp(min=0), VOCAB)) / 3
    want_loss[2], want_grad[2] = 0, 0
    loss = cross_entropy_grad_(logits, targets, torch.tensor([1 / 3], device=DEVICE), block_v=16)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.double(), want_grad, rtol=2**-8, atol=1e-6)  # bf16 rounding of the store


def test_unchecked_out_of_range_target_gives_nan():
    hidden, weight, targets = _inputs(shape=(4,))
    targets[1] = VOCAB
    assert linear_cross_entropy(hidden, weight, targets, check_targets=False).isnan()


@pytest.mark.parametrize("change, match", [
    (lambda h, w, t: (h, w, t.clone().fill_(VOCAB)), f"\\[0, {VOCAB}\\).*{VOCAB}"),
    (lambda h, w, t: (h, w, t.clone().fill_(-3)), "-3"),
    (lambda h, w, t: (h[..., :-1], w, t), "must end in d"),
    (lambda h, w, t: (h, w, t[:, :-1]), "targets must have shape"),
    (lambda h, w, t: (h, w, t.float()), "int64"),
    (lambda h, w, t: (h, w[0], t), "weight must be"),
    (lambda h, w, t: (h.bfloat16(), w, t), "share a dtype"),
    (lambda h, w, t: (h.double(), w.double(), t), "unsupported dtype"),
    (lambda h, w, t: (h[:0], w, t[:0]), "no tokens"),
])
def test_bad_inputs_raise(change, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*change(*_inputs()), check_targets=True)  # (checked for free on the CPU only)


def test_bad_chunk_tokens_raise():
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int, got 0"):
        linear_cross_entropy(*_inputs(), chunk_tokens=0)


def test_benchmark_rows_on_cpu():
    config = LinearCEConfig(tokens=(5,), d_model=8, vocab=VOCAB, dtype="fp32", providers=("fused", "plain_eager"),
                            chunk_tokens=2, warmup_ms=1, rep_ms=1, device=DEVICE)
    fused, plain = run(config)
    assert (fused["provider"], plain["provider"]) == ("fused", "plain_eager")
    assert fused["status"] == plain["status"] == "ok" and fused["median_ms"] > 0
    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert (fused["chunk_tokens"], plain["chunk_tokens"]) == (2, 5)
