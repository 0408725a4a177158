"""The Snakemake workflow: dry runs at both scales and on the Slurm profile, lint, formatting, and
that every deliverable the writeup names has a producing rule."""

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


def test_unknown_scale_is_rejected():
    result = snakemake("-n", "--cores", "1", "--config", "scale=huge")
    assert result.returncode != 0
    assert "huge" in result.stdout + result.stderr


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
    import yaml

    from cs336_systems.report.writeup import Context, build

    monkeypatch.chdir(ROOT)  # figure links are relative to the working directory
    anchors = yaml.safe_load((ROOT / "config.yaml").read_text())["anchors"]
    ctx = Context(Path("results"), Path("figures"), Path("results"), anchors)
    assert build(ctx, "full", "cuda") == (ROOT / "results" / "writeup.md").read_text()
