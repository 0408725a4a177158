"""What each provider of the 8B step runs: ours, the plain-PyTorch anchors, and the ablations of ours (each
changing one of ours' choices), as typed recipes; the sized ablations `ours-keep:N` and `ours-mm:N` parsed from
their names; the checkpoint policy of each pass."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cs336_systems.model import CheckpointPolicy


@dataclass(frozen=True)
class Recipe:
    """What a provider runs.

    model: "ours" (TransformerLM) or "plain" (bench/plain_model.py);
    attention: ours' attention backend (the plain model always calls SDPA);
    loss: "fused" (our LM head + CE kernel), "full_logits" (plain CE of the whole logits) or "chunked"
        (the plain model's chunked, checkpointed head + CE);
    optimizer: "ours_fused" (cs336_systems.optim.AdamW, fused Triton) or "torch_fused";
    checkpoint: ours: a CheckpointPolicy text ("selective", "every:1"); plain: "sac" or "ac";
    moments: "param" (AdamW moments in the parameters' dtype) or "fp32";
    state: where the optimizer's state lives between steps: "device", or "host" (pinned host memory, fetched back
        during the last pass's backward: cs336_systems/offload.py);
    microbatch: sequences per forward and backward pass, their gradients accumulated (None: the whole batch)."""

    model: str
    attention: str
    loss: str
    optimizer: str
    checkpoint: str
    moments: str = "param"
    state: str = "device"
    microbatch: int | None = None


# Ours' checkpointing: selective, with as many of the blocks saving their matmul outputs as the memory left free
# by a plain selective step holds, chosen per point by `probe_matmul_blocks` (model/checkpointing.py has the policy).
AUTO = "selective:auto"
# A policy per pass, for the first pass and the later ones (`pass_policies`): "selective:0,27 then selective:0,21".
PASS_SEPARATOR = " then "
# The correctness check's model has 2 blocks: in the first pass both save their matmul outputs, in the later
# ones one of them, the other plain selective (both paths, and the switch between passes).
CHECK_CHECKPOINT = f"selective:0,2{PASS_SEPARATOR}selective:0,1"
OURS = Recipe("ours", "flash_triton", "fused", "ours_fused", AUTO, microbatch=1)
PLAIN_SAC = Recipe("plain", "sdpa", "chunked", "torch_fused", "sac")
PROVIDERS: dict[str, Recipe] = {
    "ours": OURS,
    "torch_plain_sac": PLAIN_SAC,
    "torch_plain_ac": replace(PLAIN_SAC, checkpoint="ac"),
}
# Each ablation switches one of ours' choices off (or, for the moments, changes the numerics; for the state's home,
# tries a lever not yet adopted).
ABLATIONS: dict[str, Recipe] = {
    "ours-no_fused_ce": replace(OURS, loss="full_logits"),
    "ours-torch_adamw": replace(OURS, optimizer="torch_fused"),
    "ours-sdpa_attention": replace(OURS, attention="sdpa"),
    "ours-full_ac": replace(OURS, checkpoint="every:1"),
    "ours-fp32_moments": replace(OURS, moments="fp32"),
    "ours-selective": replace(OURS, checkpoint="selective"),
    "ours-whole_batch": replace(OURS, microbatch=None),
    "ours-state_on_host": replace(OURS, state="host"),
}
RECIPES = {**PROVIDERS, **ABLATIONS}
# Ablations that use the memory selective checkpointing leaves free, sized by N in their name: the policy
# text each one gives ours (model/checkpointing.py, CheckpointPolicy.parse).
SIZED_ABLATIONS = {"ours-keep:": "selective:{}", "ours-mm:": "selective:0,{}"}


def _sized(name: str) -> tuple[str, int] | None:
    """(prefix, N) of an `ours-keep:N` or `ours-mm:N` name (None for any other name); a ValueError naming a
    bad N."""
    for prefix in SIZED_ABLATIONS:
        if name.startswith(prefix):
            text = name.removeprefix(prefix)
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"ablation {name!r}: {prefix}N needs N, a number of blocks, a positive integer; "
                                 f"got {text!r}")
            return prefix, int(text)
    return None


def sized_blocks(name: str) -> int | None:
    """N of a sized ablation's name (None for any other name)."""
    sized = _sized(name)
    return sized and sized[1]


def recipe(provider: str) -> Recipe:
    """A provider's recipe: a named one, or ours with the checkpoint policy of a sized ablation."""
    sized = _sized(provider)
    if sized is not None:
        return replace(OURS, checkpoint=SIZED_ABLATIONS[sized[0]].format(sized[1]))
    if provider not in RECIPES:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(RECIPES)}, "
                         f"{', '.join(p + 'N' for p in SIZED_ABLATIONS)}")
    return RECIPES[provider]


def pass_policies(text: str) -> tuple[CheckpointPolicy, ...]:
    """The policy of each pass from a checkpoint text: one policy, or "FIRST then LATER" (selective both: the
    first pass's, then every later pass's)."""
    policies = tuple(CheckpointPolicy.parse(part) for part in text.split(PASS_SEPARATOR))
    if len(policies) > 2 or (len(policies) == 2 and any(p.kind != "selective" for p in policies)):
        raise ValueError(f"checkpoint {text!r}: one policy, or two selective ones as 'FIRST{PASS_SEPARATOR}LATER'")
    return policies


def sequences_per_pass(provider: str, batch: int) -> int:
    """How many sequences one forward and backward pass of the provider holds at this batch."""
    return min(recipe(provider).microbatch or batch, batch)

