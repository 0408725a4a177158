"""The workflow keeps what is committed: a fresh checkout, whatever its file times, plans no measuring job; a failed
measuring job leaves the committed table and its log as they were; config keys it does not know are refused.

Each test works in a copy of the checkout's files (those git tracks, and new ones it does not ignore), so the
repository's own results are never touched.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# The rules that only turn results into tables, figures and the writeup (and the submission: the PDF and code.zip).
# Any other rule measures, tests, merges or reads what a measurement left (traces, snapshots): on a fresh checkout
# none of them may run.
REPORT_RULES = {"table", "figure", "writeup_md", "writeup_html", "writeup_pdf", "writeup", "communication_accounting",
                "code_zip", "submission"}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not available")


def tracked_files() -> list[str]:
    """The checkout's files in git's order (the index's, which is the order a checkout writes them in)."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    return sorted({name for name in listing.split("\0") if name and (ROOT / name).is_file()})


def checkout(dest: Path, *, reverse: bool) -> Path:
    """A copy of the checkout at `dest` whose files are one second apart, in git's order or its reverse: every pair
    of files (a rule's input and its output) is in the wrong order in one of the two."""
    names = tracked_files()
    start = 1_600_000_000
    for i, name in enumerate(reversed(names) if reverse else names):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
        os.utime(target, (start + i, start + i))
    return dest


def snakemake(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def planned_rules(result: subprocess.CompletedProcess) -> set[str]:
    """The rules of the jobs a dry run plans, from its job table."""
    assert result.returncode == 0, result.stdout + result.stderr
    if "Nothing to be done" in result.stdout:
        return set()
    table = result.stdout.split("Job stats:", 1)[1].split("total", 1)[0]
    return {line.split()[0] for line in table.splitlines()[3:] if line.strip()}


@pytest.fixture(scope="module", params=["git order", "reverse order"])
def fresh_checkout(request, tmp_path_factory):
    return checkout(tmp_path_factory.mktemp("checkout"), reverse=request.param == "reverse order")


@pytest.mark.parametrize("config", [["measure=false"], [], ["max_gpus=2"]],
                         ids=["measure=false", "plain", "max_gpus=2"])
def test_a_fresh_checkout_plans_no_measuring_job(fresh_checkout, config):
    """The committed results are used whatever the file times (issue 60, item 4): `ddp_correctness` was planned
    when git wrote tests/test_ddp.py after results/ddp_correctness.csv, `compile_timing` when it wrote
    results/raw/compile/*.csv after results/e2e_compile.csv."""
    args = ["writeup", "--dry-run", "--cores", "2"]
    if config:
        args += ["--config", *config]
    planned = planned_rules(snakemake(fresh_checkout, *args))
    assert planned <= REPORT_RULES, f"planned besides the report: {sorted(planned - REPORT_RULES)}"


@pytest.mark.parametrize("forced,follows", [
    ("compile_timing_size", "compile_timing"),
    ("results/raw/compile/xl.csv", "compile_timing"),
    ("flash_llm_shapes_point", "flash_llm_shapes"),
    ("memory_profile", "memory_timelines"),
])
def test_a_forced_measurement_still_reaches_what_reads_it(forced, follows):
    """The committed pieces a merge reads are ancient() so that file times do not merge them again, and Snakemake
    does not rerun a job for ancient inputs even when their rule runs: a run told to measure them takes them as
    plain inputs, so the new pieces are merged (and new snapshots drawn), not left beside a stale table."""
    planned = planned_rules(snakemake(ROOT, "writeup", "--dry-run", "--cores", "1", "--forcerun", forced))
    assert follows in planned, sorted(planned)


def test_a_report_only_run_has_no_measuring_rule():
    """measure=false leaves every other rule out of the workflow, so no rerun trigger (changed params or code in
    .snakemake's records, which a fresh clone lacks but a measuring machine has) can plan one."""
    result = snakemake(ROOT, "--list-rules", "--config", "measure=false")
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(result.stdout.split()) == REPORT_RULES


def committed_bytes(paths: list[str]) -> dict[str, bytes]:
    return {path: (ROOT / path).read_bytes() for path in paths}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU rule would measure here instead of failing")
@pytest.mark.parametrize("target,rule,kept", [
    ("results/e2e.csv", "e2e_timing", ["results/e2e.csv", "results/logs/e2e_timing.log"]),
    ("results/raw/compile/small.csv", "compile_timing_size",
     ["results/raw/compile/small.csv", "results/logs/compile/small.log"]),
])
def test_a_failed_measurement_leaves_the_committed_table_and_log(tmp_path, target, rule, kept):
    """A GPU rule started on a CPU machine fails at once; Snakemake used to delete the committed table and its log
    (issue 60, item 5). They are byte-identical afterwards, and the failed attempt's log says why it failed."""
    work = checkout(tmp_path, reverse=False)
    before = committed_bytes(kept)
    result = snakemake(work, target, "--cores", "1", "--forcerun", rule)
    assert result.returncode != 0, result.stdout + result.stderr
    assert {path: (work / path).read_bytes() for path in kept} == before
    attempt = work / "logs" / "full" / Path(kept[1]).relative_to("results/logs")
    assert "CUDA is not available" in attempt.read_text()


@pytest.mark.parametrize("setting", ["max_gpu=2", "measures=false"])
def test_an_unknown_config_key_is_refused_by_name(setting):
    """A typo in --config (max_gpu for max_gpus) was silently ignored (issue 60, item 6)."""
    result = snakemake(ROOT, "writeup", "--dry-run", "--cores", "1", "--config", setting)
    assert result.returncode != 0
    assert f"'{setting.split('=')[0]}'" in result.stdout + result.stderr
