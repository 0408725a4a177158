"""One run of the 8B step benchmark, typed and checked on construction (a ValueError naming the bad value),
and the check of its world under data parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cs336_systems.bench.checks import check_known, check_not_empty, check_positive
from cs336_systems.bench.leaderboard.handout_timer import HANDOUT_REP_MS, HANDOUT_WARMUP_MS
from cs336_systems.bench.leaderboard.recipes import ABLATIONS, PROVIDERS, sequences_per_pass, sized_blocks
from cs336_systems.bench.plain_model import DEFAULT_CHUNK_TOKENS
from cs336_systems.distributed.parallelize import DataParallelSpec
from cs336_systems.model import ModelConfig, get_config
from cs336_systems.timing import resolve_device

COMPILE_MODES = ("blocks", "none")
# How a point's step is timed: the bench's own loop (synchronized around each of --steps steps) or the leaderboard's
# test, triton.testing.do_bench over the whole step (handout_timer.py).
TIMERS = ("steps", "do_bench")
ANCHOR_DATA_PARALLEL = DataParallelSpec.parse("torch_ddp")

# The correctness check's model: the 8B model's head dim (128), vocabulary and d_ff / d_model ratio at
# 2 layers of d_model 256; or the tiny size on the CPU.
CHECK_SIZES = ("scaled", "tiny", "none")
SCALED_CHECK = ModelConfig(d_model=256, d_ff=688, num_layers=2, num_heads=2, vocab_size=151936)
# Tolerance floors of the check (relative L2 error of a gradient; relative error of the loss): below
# these, an error is within the dtype's rounding whatever the plain model's own error happens to be.
CHECK_FLOORS = {"bf16": {"grad": 1e-2, "loss": 2**-8}, "fp32": {"grad": 1e-4, "loss": 1e-5}}


@dataclass(frozen=True)
class LeaderboardConfig:
    """One run: the main providers at each batch, the ablations at each of `ablation_batches` (None: the
    last of `batches`, the cheapest by default), after the correctness check. Checked on construction (a
    ValueError naming the bad value)."""

    size: str = "8B"
    batches: tuple[int, ...] = (2, 1)
    context_length: int = 32768
    providers: tuple[str, ...] = tuple(PROVIDERS)
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    ablation_batches: tuple[int, ...] | None = None
    warmup: int = 2
    steps: int = 3
    compile: str = "blocks"
    param_dtype: str = "bf16"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    check_size: str = "scaled"
    check_context: int = 1024
    check_batch: int = 2
    lr: float = 1e-4
    memory_margin_gib: float = 4.0
    memory_capacity_gib: float | None = None
    profile_dir: str | None = None
    profile_out: str | None = None
    data_parallel: str = "none"
    timer: str = "steps"
    do_bench_warmup_ms: int = HANDOUT_WARMUP_MS
    do_bench_rep_ms: int = HANDOUT_REP_MS
    cold_cache: bool = False  # run in empty PyTorch/Triton compilation caches (handout_timer.empty_caches)
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")

    def __post_init__(self):
        check_not_empty("batches", self.batches)
        check_positive("batch", *self.batches, *(self.ablation_batches or ()))
        for batch in self.ablation_batches or ():
            if batch not in self.batches:
                raise ValueError(f"ablation batch {batch} is not one of the batches {self.batches}")
        check_positive("context length", self.context_length, self.check_context, self.check_batch)
        check_known("provider", self.providers, PROVIDERS)
        check_known("ablation", [a for a in self.ablations if sized_blocks(a) is None], ABLATIONS)
        layers = self.model_config().num_layers
        for name in self.ablations:
            if (sized_blocks(name) or 0) > layers:
                raise ValueError(f"ablation {name!r} names {sized_blocks(name)} blocks; size {self.size!r} has "
                                 f"{layers}")
        if self.profile_out is not None and self.profile_dir is None:
            raise ValueError(f"profile output {self.profile_out!r} given without a profile folder (--profile DIR)")
        check_known("compile mode", [self.compile], COMPILE_MODES)
        spec = self.data_parallel_spec()  # a ValueError naming a bad spec
        if spec.kind in ("fsdp", "torch_fsdp2") or spec.optimizer_sharding != "none":
            raise ValueError(f"data parallelism {self.data_parallel!r}: the leaderboard replicates the model (a DDP "
                             "kind without optimizer sharding, e.g. bucketed:100 or torch_ddp)")
        if spec.kind != "none" and self.profile_dir is not None:
            raise ValueError(f"--profile with data parallelism {self.data_parallel!r}: profile one rank's step without it")
        check_known("timer", [self.timer], TIMERS)
        check_positive("do_bench warm-up and repetition times (ms)", self.do_bench_warmup_ms, self.do_bench_rep_ms)
        if self.timer == "do_bench" and spec.kind != "none":
            raise ValueError(f"timer 'do_bench' with data parallelism {self.data_parallel!r}: the leaderboard's test "
                             "times one process's step")
        check_known("parameter dtype", [self.param_dtype], ("bf16", "fp32"))
        check_known("check size", [self.check_size], CHECK_SIZES)
        check_positive("warm-up steps (the first step compiles, so at least 1)", self.warmup)
        check_positive("timed steps", self.steps)
        check_positive("chunk tokens", self.chunk_tokens)
        check_positive("learning rate", self.lr)
        check_positive("memory margin (GiB)", self.memory_margin_gib)
        if self.memory_capacity_gib is not None:
            check_positive("memory capacity (GiB)", self.memory_capacity_gib)
        self.model_config()  # an unknown size raises here
        resolve_device(self.device)

    def data_parallel_spec(self) -> DataParallelSpec:
        """`data_parallel` parsed (checked on construction)."""
        return DataParallelSpec.parse(self.data_parallel)

    def model_config(self) -> ModelConfig:
        return get_config(self.size, edition="2026", context_length=self.context_length)

    def check_config(self) -> ModelConfig:
        base = SCALED_CHECK if self.check_size == "scaled" else get_config(self.check_size, edition="2026")
        return base.replace(context_length=self.check_context)

    def profile_csv(self) -> Path | None:
        """Where the profile rows go: `profile_out`, else leaderboard_8b_profile.csv beside the profile folder."""
        if self.profile_dir is None:
            return None
        return Path(self.profile_out or Path(self.profile_dir).parent / "leaderboard_8b_profile.csv")

    def points(self) -> list[tuple[int, str]]:
        """(batch, provider) in the order they run."""
        ablation_batches = self.batches[-1:] if self.ablation_batches is None else self.ablation_batches
        return [(batch, name) for batch in self.batches
                for name in (*self.providers, *(self.ablations if batch in ablation_batches else ()))]


def check_world(config: LeaderboardConfig, world: int) -> None:
    """Raise (naming the values) where the run's data parallelism does not fit its world: ranks without a spec
    would each train alone; every batch is split into equal shares; and a rank's share runs in one pass, since
    the data-parallel wrappers synchronize gradients during or after one backward, not across accumulated ones."""
    spec = config.data_parallel_spec()
    if world > 1 and spec.kind == "none":
        raise ValueError(f"{world} ranks with data parallelism 'none' would each train alone: give --data-parallel")
    for batch in (*config.batches, *((config.check_batch,) if config.check_size != "none" else ())):
        if batch % world:
            raise ValueError(f"batch {batch} does not split into {world} equal shares")
    if spec.kind != "none":
        for batch, provider in config.points():
            if sequences_per_pass(provider, batch // world) < batch // world:
                raise ValueError(f"{provider} at batch {batch} on {world} ranks passes "
                                 f"{sequences_per_pass(provider, batch // world)} of its {batch // world} sequences at "
                                 f"a time; with data parallelism a rank's share runs in one pass (more ranks, or a "
                                 "smaller batch)")

