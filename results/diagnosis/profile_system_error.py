"""Which part of the profiled step breaks the checkpointed compiled steps (diagnosis for issue #24; not a rule).

    python results/diagnosis/profile_system_error.py --size small --context 4096 --out DIR

The leaderboard's profiled step (`bench/step_profile.profile_step`) fails for `torch_plain_sac`, `torch_plain_ac`
and `ours-full_ac` on the GPU with "SystemError: <built-in method apply of FunctionMeta object> returned NULL without
setting an exception", raised in the backward where non-reentrant checkpointing recomputes a compiled region
(its unpack hook calls the compiled function's autograd Function). `ours` (selective, the checkpoint inside the
compiled block) profiles fine (it is not built here: its policy is resolved per point by the bench's probe). The
profiled step differs from a timed one in two things: the allocator's history
recording (`torch.cuda.memory._record_memory_history(stacks="python")`, for the snapshot) and the profiler
(`torch.profiler.profile`). One step per provider under each alone, then both, says which of them breaks it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

from cs336_systems.bench.leaderboard import LeaderboardConfig, build, forwards, _tokens
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows


@contextlib.contextmanager
def memory_history(stacks: str):
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks=stacks)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


VARIANTS = {
    "plain": lambda: contextlib.nullcontext(),
    "history_python": lambda: memory_history("python"),
    "history_all": lambda: memory_history("all"),
    "profiler": lambda: profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]),
    "profiler+history_python": lambda: _both(),
}


@contextlib.contextmanager
def _both():
    with memory_history("python"), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--providers", nargs="+", default=["torch_plain_ac", "ours-full_ac"])
    parser.add_argument("--device", default="cuda", help="cpu for a smoke run (no history variants there)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = LeaderboardConfig(size=args.size, batches=(2,), context_length=args.context, check_size="none",
                               device=args.device, **({} if device.type == "cuda" else {"param_dtype": "fp32"}))
    variants = VARIANTS if device.type == "cuda" else {"plain": VARIANTS["plain"]}
    model_config = config.model_config()
    rows = []
    for provider in args.providers:
        trainee = build(provider, model_config, config, device)
        inputs, targets = _tokens(model_config.vocab_size, 2, args.context, device, seed=0)
        for variant, context in [("warm-up", VARIANTS["plain"]), *variants.items()]:
            trainee.optimizer.zero_grad(set_to_none=True)
            try:
                with context():
                    for forward in forwards(trainee, inputs, targets):
                        forward().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                status, error = "ok", ""
            except Exception as caught:  # noqa: BLE001: the point is which variant raises what
                status, error = "error", f"{type(caught).__name__}: {caught}"[:300]
                traceback.print_exc(file=sys.stderr)
            print(f"{provider} {variant}: {status} {error}", file=sys.stderr, flush=True)
            rows.append({"provider": provider, "variant": variant, "status": status, "error": error})
        del trainee
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_rows([{**row, **provenance(device)} for row in rows], f"{args.out}/profile_system_error.csv")


if __name__ == "__main__":
    main()
