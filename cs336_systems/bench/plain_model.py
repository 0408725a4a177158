"""The plain-PyTorch anchor: our architecture written as a competent PyTorch user would write it.

The benchmarks time it beside our model in the same run (`bench/e2e.py`, `bench/leaderboard.py`), so our
numbers are compared with a measurement, not a quoted figure, and a comparison is only as honest as this
baseline is strong. It is `cs336_systems.model.TransformerLM`'s function exactly (pre-norm blocks, RMSNorm
with eps 1e-5, RoPE on interleaved pairs, SwiGLU, untied embedding and LM head, no biases; the same
parameter count), written with what torch provides and what a user who has read the PyTorch and
torchtitan docs would do:

- one fused QKV projection (`nn.Linear(d, 3d)`: one GEMM instead of three), `nn.RMSNorm`, `nn.Embedding`;
- RoPE in the compute dtype (the angle tables stay float32 buffers and are cast once per forward);
- attention by `F.scaled_dot_product_attention(is_causal=True)`, whose default backend on H100/H200 in
  bf16 is cuDNN's fused attention;
- parameters built directly in the compute dtype on the device (`dtype=`, `device=`: bf16 end to end);
- activation checkpointing of each block, `checkpoint="ac"` (everything recomputed) or `"sac"`
  (torchtitan's selective checkpointing: everything recomputed except the attention kernel's outputs,
  which are saved, so the backward never reruns attention), inside the block's forward so that
  `compile_blocks()` compiles each checkpointed block whole (regional compilation, as torchtitan does);
- `loss(token_ids, targets)`: the LM head and cross-entropy in chunks of `chunk_tokens` tokens, each chunk
  under its own checkpoint, so the [tokens, vocab] logits never exist at once (at 2 x 32768 tokens and a
  151936 vocabulary they would take 20 GB in bf16 and twice that as float32);
- trained by the benchmarks with `torch.optim.AdamW(fused=True)` on the bf16 parameters.

`forward(token_ids)` still returns the full logits (the e2e benchmark's plain path uses it, under its own
compile scopes). `plain_state_dict(ours.state_dict())` renames our model's weights (and concatenates
q, k, v) so that both models can be loaded with the same weights; the tests check they compute the same
function.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from cs336_systems.model.config import ModelConfig

CHECKPOINT_MODES = ("none", "ac", "sac")
DEFAULT_CHUNK_TOKENS = 8192  # a 8192 x 151936 chunk of logits is 2.5 GB in bf16; small next to a step

# The ops `F.scaled_dot_product_attention` dispatches to, one per backend (cuDNN, FlashAttention-2,
# memory-efficient, and the CPU's flash kernel, which the CPU tests exercise). Selective checkpointing
# saves their outputs (the attention output and its logsumexp), as torchtitan's `_save_list` does.
_aten = torch.ops.aten
SDPA_OPS = frozenset({
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def _save_attention_only(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: keep what attention returns, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SDPA_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# Each mode's checkpoint call, bound once here: torch.compile traces a checkpoint whose context_fn is a
# functools.partial it can read as a constant (as torchtitan's checkpoint wrapper binds it), not one
# computed inside the compiled forward.
_CHECKPOINT_CALLS = {
    "ac": functools.partial(checkpoint, use_reentrant=False),
    "sac": functools.partial(checkpoint, use_reentrant=False,
                             context_fn=functools.partial(create_selective_checkpoint_contexts, _save_attention_only)),
}


def rope_tables(head_dim: int, context_length: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles pos * theta^(-2i/d), each (context_length, head_dim / 2) float32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(context_length, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of x (B, T, H, d) by the angles of cos/sin (T, 1, d/2), in x's dtype."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class PlainBlock(nn.Module):
    """x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)); checkpointed as `checkpoint` says."""

    def __init__(self, config: ModelConfig, checkpoint_mode: str = "none", dtype=None, device=None):
        super().__init__()
        d, f = config.d_model, config.d_ff
        kw = {"dtype": dtype, "device": device}
        self.num_heads = config.num_heads
        self.checkpoint_mode = checkpoint_mode
        self.ln1, self.ln2 = nn.RMSNorm(d, eps=1e-5, **kw), nn.RMSNorm(d, eps=1e-5, **kw)
        self.qkv = nn.Linear(d, 3 * d, bias=False, **kw)  # rows: q, then k, then v
        self.o = nn.Linear(d, d, bias=False, **kw)
        self.w1, self.w3 = nn.Linear(d, f, bias=False, **kw), nn.Linear(d, f, bias=False, **kw)
        self.w2 = nn.Linear(f, d, bias=False, **kw)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, -1).unbind(2)  # each (B, T, H, d_head)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)  # (B, H, T, d_head)
        x = x + self.o(out.transpose(1, 2).reshape(B, T, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_mode == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin)
        return _CHECKPOINT_CALLS[self.checkpoint_mode](self._forward, x, cos, sin)


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk's logits hidden @ weight.T (computed in float32)."""
    return F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")


class PlainTransformerLM(nn.Module):
    """token_ids (B, T) int64 → logits (B, T, vocab_size), with torch's own modules (module docstring).

    checkpoint: one of CHECKPOINT_MODES, applied to every block; dtype/device: where the parameters are
    created (default: float32 on the current default device); chunk_tokens: tokens per chunk of `loss`."""

    def __init__(self, config: ModelConfig, *, checkpoint: str = "none", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__()
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {checkpoint!r}; known: {', '.join(CHECKPOINT_MODES)}")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        kw = {"dtype": dtype, "device": device}
        self.config = config
        self.chunk_tokens = chunk_tokens
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **kw)
        cos, sin = rope_tables(config.head_dim, config.context_length, config.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.blocks = nn.ModuleList(PlainBlock(config, checkpoint, **kw) for _ in range(config.num_layers))
        self.ln_final = nn.RMSNorm(config.d_model, eps=1e-5, **kw)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        self._chunk_loss = _chunk_loss_sum

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states (B, T, d_model): everything but the LM head."""
        T = token_ids.shape[-1]
        if T > self.config.context_length:
            raise ValueError(f"sequence length {T} exceeds the model's context_length {self.config.context_length}")
        x = self.embed(token_ids)  # (B, T, d)
        # the angle tables in the compute dtype, shaped to broadcast over (B, T, H, d_head / 2)
        cos, sin = (t[:T, None, :].to(x.dtype) for t in (self.rope_cos, self.rope_sin))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.ln_final(x)

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with `targets`, `loss(token_ids, targets)` instead (a data-parallel wrapper, which sees only
        forward calls, then wraps the loss too)."""
        if targets is not None:
            return self.loss(token_ids, targets)
        return self.head(self.hidden(token_ids))

    def loss(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, the LM head and loss run chunk by chunk, each chunk checkpointed:
        the forward keeps only each chunk's loss, the backward recomputes one chunk's logits at a time."""
        hidden = self.hidden(token_ids).flatten(0, -2)  # (N, d)
        targets = targets.flatten()
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            chunk = slice(start, start + self.chunk_tokens)
            total = total + checkpoint(self._chunk_loss, hidden[chunk], self.head.weight, targets[chunk],
                                       use_reentrant=False)
        return total / targets.numel()

    def compile_blocks(self, **kwargs) -> None:
        """torch.compile each block (its checkpoint inside: the checkpointed block is compiled whole) and the
        per-chunk LM head + loss; the embedding and the chunk loop stay eager."""
        for block in self.blocks:
            block.compile(**kwargs)
        self._chunk_loss = torch.compile(_chunk_loss_sum, **kwargs)


# Our TransformerLM's parameter names → the plain model's (q, k and v are concatenated into qkv).
_RENAMES = (("token_embeddings.", "embed."), ("layers.", "blocks."), ("lm_head.", "head."),
            ("attn.output_proj.", "o."), ("ffn.", ""))
_QKV = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")


def plain_state_dict(ours: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our model's state dict (or any name → tensor map of its parameters, e.g. their gradients) under the
    plain model's names, q, k and v stacked into one (3d, d) `qkv.weight` per block."""
    out = {}
    for name, tensor in ours.items():
        if name.endswith(_QKV):
            prefix = name[: -len(_QKV[0])] if name.endswith(_QKV[0]) else None
            if prefix is None:
                continue  # k and v are taken with q
            name, tensor = prefix + "qkv.weight", torch.cat([ours[prefix + part] for part in _QKV])
        for old, new in _RENAMES:
            name = name.replace(old, new)
        out[name] = tensor
    return out
