"""The 2026 leaderboard step (handout 2026 §9, issue 24): one whole training step of the 8B model, ours against
the plain-PyTorch anchors and the ablations of ours, in one process on one GPU (or data-parallel under torchrun),
after a correctness check at a scaled-down size.

    python -m cs336_systems.bench.leaderboard --out 'leaderboard_8b/{run_id}.csv'    # --help: the manual

Modules: `recipes` (what each provider runs), `config` (one run, checked), `provider` (building a provider and its
step, `cs336_systems.train_step`'s), `memory_probe` (ours' matmul-saving blocks), `check` (the correctness check),
`points` (the timed and profiled points), `cli` (the run and its command line).
As a library: `run(LeaderboardConfig(...), "out.csv")`.
"""

from cs336_systems.bench.leaderboard.cli import build_parser, main, run
from cs336_systems.bench.leaderboard.config import LeaderboardConfig, check_world
from cs336_systems.bench.leaderboard.provider import recipe_columns
from cs336_systems.bench.leaderboard.recipes import ABLATIONS, PROVIDERS, RECIPES, Recipe, recipe

__all__ = ["ABLATIONS", "PROVIDERS", "RECIPES", "LeaderboardConfig", "Recipe", "build_parser", "check_world", "main",
           "recipe", "recipe_columns", "run"]
