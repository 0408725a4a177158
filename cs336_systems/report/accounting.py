"""Handout 2.4 communication_accounting: memory and compute-bound batch size of the XXL model,
computed from the stated assumptions and printed with the derivation.

    python -m cs336_systems.report.accounting --out results/communication_accounting.md

Assumptions (the handout's): each block is two linear layers d_model→d_ff→d_model, no attention,
embeddings or head; FP32 master weights, accumulated gradients and AdamW state (two moments);
BF16 activations and communication; TPU v5p numbers from the Scaling Book: W_ici = 2·9e10 B/s,
C = 4.6e14 FLOP/s, mesh M_X = 2, M_Y = 1, FSDP X = 16, TP Y = 4. The numbers come from
analysis/communication_accounting.py; this module writes them out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cs336_systems.analysis.communication_accounting import XXL, derivation


def markdown(v: dict[str, float], model: XXL = XXL()) -> str:
    return f"""**(a)** Parameters: {model.num_blocks} blocks × 2 × {model.d_model} × {model.d_ff} = {v['params']:.4g}.
FP32 master weights, accumulated gradients and AdamW's two moments take 4 × 4 B = 16 B per parameter:
{v['state_gb']:,.0f} GB, the memory of {v['h100s_for_state']:.1f} H100s (80 GB) before any activation.
Saved for backward (BF16): each linear keeps its input, so per token {model.num_blocks} × ({model.d_model} +
{model.d_ff}) × 2 B = {v['activation_mb_per_token']:.1f} MB — for a batch of T tokens, T × that.

**(b)** With weights, gradients, optimizer state and half the activations A sharded over N_FSDP devices,
each holds (16·P + A/2)/N_FSDP + A/2 bytes. Even with A → 0, fitting 95 GB needs
N_FSDP ≥ ⌈{v['state_gb']:,.0f} / 95⌉ = {v['n_fsdp_min']}; the unsharded half of the activations must also fit,
A/2 < 95 GB, which bounds the tokens per device.

**(c)** Forward pass, per layer (Scaling Book notation, N = X·Y devices, B tokens):
T_math = 4·B·D·F / (N·C); FSDP all-gathers weights: T_FSDP = 4·D·F / (Y·W_ici·M_X); TP moves activations:
T_TP = 4·B·D / (X·W_ici·M_Y). Compute-bound needs T_math ≥ T_FSDP, i.e. B/X ≥ C / (W_ici·M_X) =
{v['per_shard_batch']:.0f} tokens per FSDP shard, and T_math ≥ T_TP, i.e. F ≥ Y·C / (W_ici·M_Y) =
{v['tp_condition_d_ff_min']:.0f} (true: F = {model.d_ff}). So each FSDP shard needs ≥ {v['per_shard_batch']:.0f} tokens,
{v['per_device_batch']:.0f} per device (its 4 TP peers share that batch), and the overall batch is
X × {v['per_shard_batch']:.0f} ≈ {v['global_batch']:,.0f} tokens.

**(d)** To shrink the global batch while staying compute-bound, raise arithmetic intensity per byte
communicated or hide communication: (1) more tensor/sequence parallelism inside fast links (larger Y lowers
the per-device FSDP weight traffic 4·D·F/Y; Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022);
(2) pipeline parallelism, which sends only activations between stages and needs no weight gathering
(GPipe, Huang et al. 2019; PipeDream, Narayanan et al. 2019), at the cost of bubbles that micro-batching
reduces; (3) overlap the FSDP all-gather of layer i+1 with the compute of layer i (prefetching, as in
ZeRO-3 / PyTorch FSDP; Rajbhandari et al. 2020; Zhao et al. 2023) so T_FSDP only needs to be hidden, not
smaller; (4) communicate in lower precision (BF16/FP8 gathers halve or quarter the bytes); (5) expert or
other model parallelism that lets each device's weights stay resident. The derivation in (c) follows the
Scaling Book's training chapter (Austin et al., 2025); by it, with FSDP alone every device needs
B/N ≥ C/(W_ici·M_X), and mixing in TP over Y devices divides that per-device requirement by Y.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="Markdown file with the derivation")
    args = parser.parse_args(argv)
    text = markdown(derivation())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
