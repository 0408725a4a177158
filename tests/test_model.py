"""Our Transformer LM against independent references: torch's own ops, float64 math, formulas."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.model import (
    MODEL_SIZES,
    ModelConfig,
    TransformerLM,
    cross_entropy,
    forward_flops,
    get_config,
    leaderboard_flops,
    parameter_count,
    register_attention,
)
from cs336_systems.model.attention import GradInOutputStrides, get_attention, naive_attention, sdpa_attention
from cs336_systems.model.transformer import Linear, RotaryEmbedding
from cs336_systems.optim import AdamW, keep_master_weights

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, vocab_size=97, context_length=64)


def test_logits_shape_and_dtype():
    model = TransformerLM(TINY)
    tokens = torch.randint(TINY.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causality(attention):
    """Logits at position t do not change when tokens after t change."""
    torch.manual_seed(0)
    model = TransformerLM(TINY.replace(attention=attention))
    tokens = torch.randint(TINY.vocab_size, (2, 20))
    t = 11
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(TINY.vocab_size, (2, 20 - t - 1))
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])


def test_naive_and_sdpa_backends_agree():
    q, k, v = torch.randn(3, 2, 4, 19, 16, dtype=torch.float64)
    for causal in (False, True):
        torch.testing.assert_close(naive_attention(q, k, v, causal), sdpa_attention(q, k, v, causal))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("grad_layout", ["contiguous", "like_out", "expanded"])
def test_grad_in_output_strides_hands_on_the_gradient_in_the_outputs_strides(grad_layout, compiled):
    """What reaches the node below holds dO's values in O's strides, eager and under torch.compile, and eager it is
    dO itself where the strides agree."""
    q = torch.randn(2, 7, 3, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()  # (batch, heads, seq, dim)
    out = q * 2.0  # O in q's strides, as SDPA returns it
    seen = []
    out.register_hook(seen.append)
    grad = {"contiguous": torch.randn(2, 3, 7, 8, dtype=torch.float64),
            "like_out": torch.randn(2, 7, 3, 8, dtype=torch.float64).transpose(1, 2),
            "expanded": torch.randn((), dtype=torch.float64).expand(2, 3, 7, 8)}[grad_layout]
    guard = torch.compile(GradInOutputStrides.apply, fullgraph=True) if compiled else GradInOutputStrides.apply
    guard(out).backward(grad)
    assert seen[0].stride() == out.stride()
    assert torch.equal(seen[0], grad)
    if not compiled:
        assert (seen[0].data_ptr() == grad.data_ptr()) == (grad_layout == "like_out")
    torch.testing.assert_close(q.grad, 2.0 * grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's cuDNN kernel runs on CUDA")
@pytest.mark.parametrize("seq, calls", [(333, ("eager like_q", "eager contiguous", "eager like_q")),
                                        (334, ("eager like_q", "compiled contiguous", "eager contiguous",
                                               "compiled like_q"))])
def test_sdpa_cudnn_gradients_whatever_the_do_layouts_before(seq, calls):
    """torch 2.11's cuDNN backward reuses the plan of a call layout's first dO strides for any later dO: without
    GradInOutputStrides the second layout's dQ, dK, dV were off by a relative 1.41 (cs336_systems/kernels/
    DECISIONS.md). A call layout no other test runs, then dO in several layouts in turn, eager and, in
    the second case, compiled (where Inductor lays out what reaches cuDNN's backward itself)."""
    eager = get_attention("sdpa_cudnn")
    compiled = torch.compile(eager, fullgraph=True)
    gen = torch.Generator("cuda").manual_seed(0)
    batch, heads, dim = 1, 5, 64
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               .transpose(1, 2).requires_grad_() for _ in range(3))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = naive_attention(*exact, True)
    layouts = {"like_q": lambda: torch.randn(batch, seq, heads, dim, device="cuda", generator=gen).transpose(1, 2),
               "contiguous": lambda: torch.randn(batch, heads, seq, dim, device="cuda", generator=gen)}
    for call in calls:
        mode, layout = call.split()
        do = layouts[layout]().to(torch.bfloat16)
        attend = compiled if mode == "compiled" else eager
        grads = torch.autograd.grad(attend(q, k, v, True), (q, k, v), do)
        wants = torch.autograd.grad(want_out, exact, do.double(), retain_graph=True)
        for label, got, want in zip("qkv", grads, wants):
            error = ((got.double() - want).norm() / want.norm()).item()
            assert error < 1e-2, f"d{label} at the call '{call}': relative error {error:.3g} against float64"


def test_rope_depends_only_on_relative_position():
    rope = RotaryEmbedding(head_dim=16, context_length=64, theta=10_000.0)
    q, k = torch.randn(2, 16, dtype=torch.float32)

    def score(m: int, n: int) -> torch.Tensor:
        qm = rope(q[None, None], torch.tensor([m]))[0, 0]
        kn = rope(k[None, None], torch.tensor([n]))[0, 0]
        return qm @ kn

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score(0, 0), q @ k, rtol=1e-5, atol=1e-5)  # position 0 is the identity
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rope_preserves_norm():
    rope = RotaryEmbedding(head_dim=8, context_length=32, theta=10_000.0)
    x = torch.randn(2, 3, 32, 8)
    torch.testing.assert_close(rope(x, torch.arange(32)).norm(dim=-1), x.norm(dim=-1))


def test_context_longer_than_supported_is_an_error():
    model = TransformerLM(TINY.replace(context_length=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_unknown_size_is_an_error():
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        get_config("huge")


def test_bad_config_values_are_errors():
    with pytest.raises(ValueError, match="num_heads=5"):
        ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=5)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        ModelConfig(d_model=32, d_ff=64, num_layers=0, num_heads=4)


def test_unknown_attention_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown attention backend 'magic'"):
        TransformerLM(TINY.replace(attention="magic"))


@pytest.mark.parametrize("size", ["small", "medium", "large", "xl", "2.7B"])
def test_parameter_count_matches_formula(size):
    with torch.device("meta"):
        model = TransformerLM(MODEL_SIZES[size])
    assert sum(p.numel() for p in model.parameters()) == parameter_count(MODEL_SIZES[size])


def test_forward_flops_match_flop_counter():
    """Our formula against torch's own FLOP counter on the naive backend (all matmuls explicit)."""
    config = TINY.replace(attention="naive")
    model = TransformerLM(config)
    tokens = torch.randint(config.vocab_size, (2, 24))
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    assert counter.get_total_flops() == forward_flops(config, batch_size=2, seq_len=24)


def test_cross_entropy_matches_torch():
    logits = torch.randn(4, 7, 50) * 10
    targets = torch.randint(50, (4, 7))
    expected = F.cross_entropy(logits.double().reshape(-1, 50), targets.reshape(-1))
    torch.testing.assert_close(cross_entropy(logits, targets).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", ["foreach", "loop", "fused"])
@pytest.mark.parametrize("beta1", [0.85, 0.3])  # torch.lerp switches formulas at weight 0.5
def test_adamw_matches_torch(implementation, beta1, request):
    """The multi-tensor update, the per-tensor loop and the fused Triton kernel (on the session's kernel
    device: CUDA, or the CPU under the interpreter) against torch.optim.AdamW on the same device, both
    given the same gradients each step (the reference's): a rounding difference in the weights then
    stays a rounding difference, instead of changing the next gradients, which Adam's normalisation
    amplifies where a gradient is near zero."""
    device = request.getfixturevalue("kernel_device") if implementation == "fused" else "cpu"
    torch.manual_seed(0)
    model = TransformerLM(TINY).to(device)
    reference = TransformerLM(TINY).to(device)
    reference.load_state_dict(model.state_dict())
    kwargs = dict(lr=3e-3, betas=(beta1, 0.98), eps=1e-7, weight_decay=0.1)
    ours = AdamW(model.parameters(), foreach=implementation == "foreach", fused=implementation == "fused", **kwargs)
    theirs = torch.optim.AdamW(reference.parameters(), **kwargs)
    for _ in range(5):
        tokens = torch.randint(TINY.vocab_size, (2, 13)).to(device)
        theirs.zero_grad()
        cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = q.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_adamw_with_frozen_parameter_and_late_param_group():
    """Parameters without gradients are skipped; a group added later starts its own step count."""
    torch.manual_seed(1)
    a, b, c = (torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3))
    refs = [torch.nn.Parameter(t.detach().clone()) for t in (a, b, c)]
    ours, theirs = AdamW([a, b], lr=1e-2), torch.optim.AdamW(refs[:2], lr=1e-2)
    for step in range(4):
        if step == 2:
            ours.add_param_group({"params": [c]})
            theirs.add_param_group({"params": [refs[2]]})
        x = torch.randn(3)
        for params, opt in (((a, b, c), ours), (refs, theirs)):
            opt.zero_grad()
            (params[0] @ x).sum().backward()  # b never gets a gradient
            if step >= 2:
                (params[2] @ x).pow(2).sum().backward()
            opt.step()
    for p, q in zip((a, b, c), refs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_fused_adamw_rejects_what_its_kernel_cannot_update():
    double = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    double.grad = torch.ones_like(double)
    with pytest.raises(ValueError, match="param is torch.float64"):
        AdamW([double], fused=True).step()
    strided = torch.nn.Parameter(torch.zeros(4, 6).t())
    strided.grad = torch.ones(6, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        AdamW([strided], fused=True).step()


def test_fused_adamw_kernel_on_ragged_and_misaligned_tensors(kernel_device):
    """The kernel on awkward tensors: several blocks with a ragged last one, fewer elements than a
    block, a tensor whose address is not 16-byte aligned (a view one element into its storage);
    against torch.optim.AdamW on copies at its fourth step."""
    from cs336_systems.kernels.adamw_triton import BLOCK, adamw_step_

    torch.manual_seed(2)
    params = [torch.randn(n).to(kernel_device) for n in (2 * BLOCK + 37, 5)] + [torch.randn(101).to(kernel_device)[1:]]
    assert params[-1].data_ptr() % 16 != 0
    grads = [torch.randn_like(p) for p in params]
    moments = [(torch.rand_like(p), torch.rand_like(p)) for p in params]
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    theirs = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05, foreach=False)
    for q, g, (m, v) in zip(reference, grads, moments):
        q.grad = g.clone()
        theirs.state[q] = {"step": torch.tensor(3.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    theirs.step()
    for p, g, (m, v), q in zip(params, grads, moments, reference):
        adamw_step_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, step=4)
        torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, theirs.state[q]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, theirs.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def test_adamw_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="lr=-1"):
        AdamW([torch.nn.Parameter(torch.zeros(1))], lr=-1)


def test_communication_accounting_numbers():
    """2.4 from first principles: the XXL parameter count and the compute-bound batch."""
    from cs336_systems.analysis.communication_accounting import XXL, derivation

    v = derivation()
    assert v["params"] == 126 * 2 * 16384 * 53248
    assert v["state_gb"] == pytest.approx(16 * v["params"] / 1e9)
    assert v["n_fsdp_min"] == 38  # 3518 GB / 95 GB = 37.03
    assert v["per_shard_batch"] == pytest.approx(4.6e14 / (2 * 9e10 * 2))
    assert v["global_batch"] == pytest.approx(16 * v["per_shard_batch"])
    assert XXL().activation_bytes_per_token() == 126 * (16384 + 53248) * 2


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_adamw_on_bf16_parameters_tracks_the_float32_step(implementation, state_dtype, kernel_device):
    """bf16 parameters (awkward sizes, several steps, the same gradients given to both) against
    torch.optim.AdamW in float32 from the same start. float32 moments are computed from the same values
    as the reference's, so they match it to float32 rounding; the parameters differ by their bf16
    rounding each step (at most 1 ulp of 2^-8 relative each, truncating under the interpreter), and
    bf16 moments add a relative error of a few 2^-8 to each update of size lr."""
    torch.manual_seed(3)
    shapes = [(37, 5), (1029,), (3,)]
    start = [torch.randn(s, device=kernel_device).bfloat16() for s in shapes]
    ours_params = [torch.nn.Parameter(p.clone()) for p in start]
    ref_params = [torch.nn.Parameter(p.float()) for p in start]
    lr, steps = 1e-2, 4
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = AdamW(ours_params, foreach=implementation == "foreach", fused=implementation == "fused",
                 state_dtype=state_dtype, **kwargs)
    theirs = torch.optim.AdamW(ref_params, **kwargs)
    for _ in range(steps):
        for p, q in zip(ours_params, ref_params):
            g = torch.randn(p.shape, device=kernel_device).bfloat16()
            p.grad, q.grad = g, g.float()
        ours.step()
        theirs.step()
    for p, q, p0 in zip(ours_params, ref_params, start):
        assert p.dtype == torch.bfloat16 and ours.state[p]["exp_avg"].dtype == state_dtype
        torch.testing.assert_close(p.float(), q.detach(), rtol=steps * 2**-7, atol=steps * lr * 2**-5)
        for key in ("exp_avg", "exp_avg_sq"):
            mine, ref = ours.state[p][key], theirs.state[q][key]
            if state_dtype == torch.float32:
                torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)
            else:  # each step rounds the moment once (1 ulp at most), relative to the largest of them
                assert (mine.float() - ref).abs().max() <= steps * 2**-8 * ref.abs().max(), key
        # the step moved the weights by much more than the tolerance: the comparison can fail
        assert (q.detach() - p0.float()).abs().max() > 10 * lr * 2**-5


def test_adamw_rejects_an_unknown_state_dtype():
    with pytest.raises(ValueError, match="state_dtype must be one of .* got torch.float16"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], state_dtype=torch.float16)



def test_bf16_master_weights_give_autocasts_gradients():
    """One bf16 training step of a model whose matmul weights are bf16 (float32 masters kept by our AdamW)
    against autocast over the same model in float32, the reference: autocast casts each weight to the same
    bf16 value, so logits, loss and every gradient are the same numbers (a weight's bf16 gradient widened
    is the reference's float32 one). CPU; causal attention, a context not a power of two."""
    torch.manual_seed(4)
    reference = TransformerLM(TINY)
    model = TransformerLM(TINY)
    model.load_state_dict(reference.state_dict())
    keep_master_weights(AdamW(model.parameters()), [m.weight for m in model.modules() if isinstance(m, Linear)])
    tokens = torch.randint(TINY.vocab_size, (3, 22))
    outputs = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()
        outputs.append((logits, loss))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    narrow = 0
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        narrow += q.dtype == torch.bfloat16
        assert p.grad.dtype == torch.float32 and torch.equal(q.grad.float(), p.grad), name
    assert narrow == 7 * TINY.num_layers + 1  # q, k, v, output, w1, w2, w3 in each block, and the LM head


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_bf16_master_weights_step_like_torch_adamw_in_float32(implementation, request):
    """Several steps with the same gradients given to both: the masters track torch.optim.AdamW on float32
    parameters to float32 rounding, and each bf16 weight is its master rounded to nearest even (on a GPU;
    Triton's CPU interpreter truncates, within 1 bf16 ulp). Parameters left in float32 (norms) beside them,
    and a frozen one (no gradient: not stepped), step as before."""
    device = request.getfixturevalue("kernel_device") if implementation == "fused" else "cpu"
    torch.manual_seed(5)
    model = TransformerLM(TINY).to(device)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = AdamW(model.parameters(), foreach=implementation == "foreach", fused=implementation == "fused", **kwargs)
    theirs = torch.optim.AdamW(reference, **kwargs)
    narrow = [m.weight for m in model.modules() if isinstance(m, Linear)]
    keep_master_weights(ours, narrow)
    frozen = model.layers[0].attn.q_proj.weight
    start = ours.state[frozen]["master"].clone()
    for _ in range(4):
        for p, q in zip(model.parameters(), reference):
            g = None if p is frozen else torch.randn(p.shape, device=device).to(p.dtype)
            p.grad, q.grad = g, None if g is None else g.float()
        ours.step()
        theirs.step()
    exact = device == "cuda"
    for p, q in zip(model.parameters(), reference):
        master = ours.state[p].get("master", p)
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=1e-6, atol=1e-7)
        if p.dtype == torch.bfloat16:
            if exact or implementation == "foreach":
                assert torch.equal(p, master.bfloat16())
            else:
                assert ((p.float() - master).abs() <= master.abs() * 2**-7).all()
    assert torch.equal(ours.state[frozen]["master"], start) and torch.equal(frozen, start.bfloat16())


def test_master_weights_need_float32_parameters_of_our_adamw():
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="got torch.bfloat16"):
        keep_master_weights(AdamW([half]), [half])
    full, stray = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="got AdamW"):  # torch's: it has no masters
        keep_master_weights(torch.optim.AdamW([full]), [full])
    with pytest.raises(ValueError, match=r"shape \(2, 5\) is not one of the optimizer's"):
        keep_master_weights(AdamW([full]), [stray])


@pytest.mark.parametrize("masters", [True, False])
def test_adamw_checkpoint_keeps_float32_state_of_bf16_parameters(masters):
    """A state_dict round trip in the middle of training, with bf16 master weights or with bf16 parameters and
    float32 moments: the loaded optimizer keeps the masters and moments in float32 (torch's load_state_dict
    would cast them to the parameters' bf16) and its next steps are the uninterrupted run's, bit for bit."""
    torch.manual_seed(6)

    def build():
        model = TransformerLM(TINY)
        if not masters:
            model = model.bfloat16()
        optimizer = AdamW(model.parameters(), lr=1e-2, state_dtype=torch.float32)
        if masters:
            keep_master_weights(optimizer, [m.weight for m in model.modules() if isinstance(m, Linear)])
        return model, optimizer

    def step(model, optimizer, grads):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.to(p.dtype)
        optimizer.step()

    model, optimizer = build()
    grads = [[torch.randn(p.shape) for p in model.parameters()] for _ in range(4)]
    for g in grads[:2]:
        step(model, optimizer, g)
    resumed, resumed_optimizer = build()
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    for g in grads[2:]:
        step(model, optimizer, g)
        step(resumed, resumed_optimizer, g)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
        state, loaded = optimizer.state[p], resumed_optimizer.state[q]
        assert loaded.keys() == state.keys() and loaded["step"] == 4
        for key in state.keys() - {"step"}:
            assert loaded[key].dtype == torch.float32 and torch.equal(loaded[key], state[key]), key


# ---- the 8B step's model API ---------------------------------------------------------------------------


def test_8b_is_the_2026_leaderboard_model():
    """Handout 2026 §9: vocab 151936, d_model 4096, d_ff 11008, 34 layers, 32 heads, context 32768;
    built on the meta device (no memory) in bf16, it has the formula's 8.13B parameters."""
    config = get_config("8B", edition="2026")
    assert (config.vocab_size, config.d_model, config.d_ff, config.num_layers, config.num_heads,
            config.context_length) == (151936, 4096, 11008, 34, 32, 32768)
    model = TransformerLM(config, dtype=torch.bfloat16, device="meta")
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == parameter_count(config)
    assert round(parameter_count(config) / 1e9, 2) == 8.13
    assert {p.dtype for p in params} == {torch.bfloat16} and {p.device.type for p in params} == {"meta"}
    assert model.rope.cos.dtype == torch.float32 and model.rope.cos.device.type == "meta"


def test_parameter_dtype_at_construction():
    """Each weight is drawn in float32 and cast: the bf16 model holds the fp32 model's weights rounded
    (same seed); activations and logits follow the parameters; the default is unchanged (float32)."""
    torch.manual_seed(4)
    fp32 = TransformerLM(TINY)
    torch.manual_seed(4)
    bf16 = TransformerLM(TINY, dtype=torch.bfloat16)
    for (name, p), q in zip(fp32.named_parameters(), bf16.parameters()):
        assert p.dtype == torch.float32 and q.dtype == torch.bfloat16, name
        assert torch.equal(q, p.to(torch.bfloat16)), name
    tokens = torch.randint(TINY.vocab_size, (2, 9))
    assert bf16(tokens).dtype == torch.bfloat16 and bf16.hidden(tokens).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype or None, got torch.int32"):
        TransformerLM(TINY, dtype=torch.int32)


def _matmul_flops_of_a_step(config: ModelConfig, batch: int, context: int, attention: str) -> int:
    model = TransformerLM(config.replace(attention=attention))
    tokens = torch.randint(config.vocab_size, (batch, context + 1))
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return counter.get_total_flops()


def test_leaderboard_flops_against_torchs_flop_counter():
    """Independently: torch's FLOP counter over a whole training step (forward and backward) with an
    attention that does no matmul (v + 0 (q + k): elementwise, uncounted, and q and k still get
    gradients, so the step runs every matmul of the projections, MLP and LM head), plus
    the counter's count of the naive attention's step halved for the causal mask (the naive kernel
    computes the full score matrix), once per layer."""
    register_attention("flop_free", lambda q, k, v, is_causal: v + 0 * (q + k))
    config = TINY.replace(num_layers=3, vocab_size=53, context_length=32)
    batch, context = 2, 24
    matmuls = _matmul_flops_of_a_step(config, batch, context, "flop_free")
    q, k, v = (torch.randn(batch, config.num_heads, context, config.head_dim, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        naive_attention(q, k, v, True).sum().backward()
    attention = counter.get_total_flops() // 2 * config.num_layers
    assert leaderboard_flops(config, batch, context) == matmuls + attention
    with pytest.raises(ValueError, match="batch=0"):
        leaderboard_flops(config, 0, context)
