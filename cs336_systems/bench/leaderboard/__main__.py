"""python -m cs336_systems.bench.leaderboard: see `--help`."""

from cs336_systems.bench.leaderboard.cli import main

main()
