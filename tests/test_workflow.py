"""The Snakemake workflow: dry runs at both scales and on the Slurm profile, lint, formatting, and
that every deliverable the writeup names has a producing rule."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.report.writeup import DELIVERABLES

ROOT = Path(__file__).resolve().parents[1]


def snakemake(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("scale", ["smoke", "full"])
def test_dry_run_of_writeup(scale):
    result = snakemake("writeup", "-n", "--forceall", "--cores", "1", "--config", f"scale={scale}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "writeup_md" in result.stdout


def test_full_scale_gpu_rules_ask_for_a_gpu():
    result = snakemake("writeup", "-n", "-p", "--forceall", "--cores", "1", "--config", "scale=full")
    assert result.returncode == 0, result.stderr
    assert "gpu=1" in result.stdout and "--device cuda" in result.stdout


def test_one_gpu_writeup_never_asks_for_two():
    """On one GPU (max_gpus 1) remeasuring everything plans no job that takes two GPUs (the two-GPU deliverables
    keep their committed tables); with max_gpus=2 the same plan has them."""
    one = snakemake("writeup", "-n", "--forceall", "--cores", "1", "--resources", "gpu=1", "--config", "scale=full")
    assert one.returncode == 0, one.stdout + one.stderr
    assert "gpu=2" not in one.stdout
    two = snakemake("writeup", "-n", "--forceall", "--cores", "1", "--resources", "gpu=2", "--config", "scale=full",
                    "max_gpus=2")
    assert two.returncode == 0, two.stdout + two.stderr
    assert "gpu=2" in two.stdout and "fsdp_point" in two.stdout


def test_a_two_gpu_trace_reader_without_max_gpus_names_the_setting():
    """fsdp_overlap (and ddp_overlap, through the same measured_inputs) reads the traces of a two-GPU rule: without
    max_gpus=2 it stops at planning and names the setting (it once ran with no inputs and failed in its script's
    argument parsing). With the setting the plan has the traces' rule: the suggested-commands test dry-runs that."""
    result = snakemake("results/fsdp_overlap.csv", "-n", "--forcerun", "fsdp_overlap", "--cores", "1",
                       "--resources", "gpu=2")
    assert result.returncode != 0
    assert "results/fsdp_traces needs 2 GPUs" in result.stdout + result.stderr
    assert "max_gpus=2" in result.stdout + result.stderr


def test_unknown_scale_is_rejected():
    result = snakemake("-n", "--cores", "1", "--config", "scale=huge")
    assert result.returncode != 0
    assert "huge" in result.stdout + result.stderr


def test_the_config_schema_knows_every_ablation():
    """The schema's list of ablation names is the leaderboard's own (a name missing there fails every snakemake run
    that configures it; one the bench does not know fails only on the GPU)."""
    import yaml

    from cs336_systems.bench.leaderboard import ABLATIONS

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "ablations" in node and "anyOf" in node["ablations"].get("items", {}):
                found.append(node["ablations"]["items"]["anyOf"][0]["enum"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    assert found and all(sorted(names) == sorted(ABLATIONS) for names in found), found


def test_dry_run_on_the_slurm_profile():
    result = snakemake("writeup", "-n", "--profile", "workflow/profiles/slurm", "--config", "scale=full")
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_is_clean():
    result = snakemake("--lint")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("snakefmt") is None, reason="snakefmt not installed")
def test_snakefmt_clean():
    files = [ROOT / "workflow" / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]
    result = subprocess.run(["snakefmt", "--check", *map(str, files)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_deliverable_rule_exists():
    rules = set(snakemake("--list-rules", "--config", "scale=smoke").stdout.split())
    missing = [d.section for d in DELIVERABLES if d.rule is not None and d.rule not in rules]
    assert not missing, f"deliverables whose rule is not in the workflow: {missing}"
    without = [d.section for d in DELIVERABLES if d.rule is None]
    print("deliverables without a producing rule yet:", *without, sep="\n  ")


def test_committed_writeup_is_what_the_code_makes_of_the_committed_results(monkeypatch):
    """Every renderer runs on the real GPU results, and results/writeup.md is up to date with them
    (rebuild: snakemake writeup --cores 2 --forcerun writeup_md --config measure=false)."""
    from cs336_systems.report.writeup import Context, build

    monkeypatch.chdir(ROOT)  # figure links are relative to the working directory
    ctx = Context(Path("results"), Path("figures"), Path("results"))
    assert build(ctx, "full", "cuda") == (ROOT / "results" / "writeup.md").read_text()


# Where the project suggests snakemake commands: fenced blocks and `inline code` of these documents, and
# `#   snakemake ...` comment lines of these workflow files.
DOCUMENTS = ["README.md", "results/README.md"]
COMMENTED = ["workflow/Snakefile", "workflow/profiles/slurm/config.yaml"]


def _commands_in(text: str) -> list[str]:
    """The `snakemake ...` commands in a shell fragment: continuation lines joined, `&&` chains split."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        commands += [part.strip() for part in line.split("&&") if part.strip().startswith("snakemake ")]
    return commands


def suggested_commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of every snakemake command the documentation and the workflow's comments suggest."""
    found = []
    for name in DOCUMENTS:
        text = (ROOT / name).read_text()
        fence = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)
        for block in fence.findall(text):
            found += [(name, command) for command in _commands_in(block)]
        found += [(name, span) for span in re.findall(r"`(snakemake [^`]*)`", fence.sub("", text))]
    for name in COMMENTED:
        for line in (ROOT / name).read_text().splitlines():
            match = re.match(r"#\s+(snakemake .*)", line)
            if match:
                found.append((name, match.group(1)))
    return [(name, shlex.split(command, comments=True)) for name, command in found]


SUGGESTED = suggested_commands()
DISTINCT: dict[tuple[str, ...], str] = {}  # each command once (the Snakefile repeats the README's), its first source
for _source, _argv in SUGGESTED:
    DISTINCT.setdefault(tuple(_argv), _source)


def test_commands_are_found_in_every_source():
    assert {name for name, _ in SUGGESTED} == {*DOCUMENTS, *COMMENTED}
    assert len(SUGGESTED) >= 8, SUGGESTED


@pytest.mark.parametrize("source,argv", [(source, list(argv)) for argv, source in DISTINCT.items()],
                         ids=[" ".join(argv) for argv in DISTINCT])
def test_suggested_snakemake_command_dry_runs(source, argv):
    """Each suggested command as written, with --dry-run: a target placed after --resources or --config
    (read as a resource or config entry) or an unknown option fails here."""
    assert argv[0] == "snakemake"
    result = snakemake(*argv[1:], "--dry-run")
    assert result.returncode == 0, f"{source}: {' '.join(argv)}\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("argv", [["--cores", "1", "--resources", "gpu=2", "results/ddp_bucketed.csv"],
                                  ["--cores", "2", "--config", "scale=smoke", "writeup"]])
def test_a_target_after_a_many_valued_option_fails_the_dry_run(argv):
    """The malformed forms the documents once suggested: the check above can fail."""
    assert snakemake(*argv, "--dry-run").returncode != 0
