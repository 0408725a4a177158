import glob
import os
from snakemake.utils import validate

validate(config, workflow.source_path("../schemas/config.schema.yaml"))

SCALE = config["scale"]
S = config["scales"][SCALE]
R = S["results"]  # results directory of this scale
F = S["figures"]  # figures directory of this scale
GPUS = S["gpus_per_job"]
LOGS = f"{R}/logs"  # run logs travel with the results they explain
# A failed job leaves the results and logs already here as they were. Snakemake deletes a job's outputs and logs
# before it starts and again when it fails, except outputs flagged update(): those it backs up
# (.snakemake/backups) and restores when the job fails. So every rule flags what it writes under R update(), writes
# its log to ATTEMPTS while it runs (a failed attempt's log stays there, and Snakemake's error names it) and, once
# it has succeeded, copies that log to LOGS, an update() output too.
ATTEMPTS = f"logs/{SCALE}"  # gitignored
ENV = "../envs/cs336.yaml"
# measure=false builds tables, figures and the writeup from the results already present (e.g. the
# committed GPU results on a machine without a GPU) and leaves deliverables without data pending.
# The Snakefile leaves the measuring rules out of such a run.
MEASURE = str(config.get("measure", True)).lower() != "false"

# Arguments every benchmark CLI gets at this scale.
DEVICE_ARGS = f"--device {S['device']}"

# A CPU scale's jobs run the Triton kernels on CPU tensors, which needs Triton's interpreter; Triton
# reads TRITON_INTERPRET when a kernel is defined, so each job's shell sets it before Python starts.
# Only the jobs' shells: this process (which imports the package) and GPU scales keep the environment
# they were given. The prefix replaces Snakemake's default one, which is kept in front.
if S["device"] == "cpu":
    shell.prefix("set -euo pipefail; export TRITON_INTERPRET=1; ")
MODEL_ARGS = f"--batch-size {S['batch_size']} --context-length {S['context_length']}"


wildcard_constraints:
    size="|".join(re.escape(s) for s in S["model_sizes"]),
    warmup=r"\d+",
    dtype="fp32|bf16|fp16",


def join(values):
    return " ".join(str(v) for v in values)


# The most GPUs one job of this run may take (config max_gpus; on two GPUs: --resources gpu=2 --config
# max_gpus=2). A run that measures leaves the results of rules needing more out of its plan altogether, so that
# `snakemake writeup --forceall --resources gpu=1` remeasures every single-GPU deliverable and never waits for a
# second GPU; their sections keep the committed tables (or say pending, with the command).
MAX_GPUS = int(config["max_gpus"])
# results path -> GPUs its rule takes, for rules that take more than one (rules/*.smk fill it)
GPUS_NEEDED = {}


def needs_gpus(gpus, *paths):
    """Record that the rule making `paths` runs on `gpus` GPUs."""
    for path in paths:
        GPUS_NEEDED[path] = gpus


# results paths this scale does not make (a config section switched off with enabled = false; rules/*.smk fill it)
SWITCHED_OFF = set()


def usable(path):
    """Whether the report may ask for `path`: this run can make it, or it only reports and `path` is here."""
    if not MEASURE:
        return os.path.exists(path)
    return path not in SWITCHED_OFF and GPUS_NEEDED.get(path, 0) <= MAX_GPUS


def available(inputs):
    """The names whose data this run may ask for."""
    return [name for name, data in inputs.items() if usable(data)]


def wanted(*paths):
    """The paths this run may ask for."""
    return [p for p in paths if usable(p)]


def committed(maker, *paths):
    """Input function for committed files that the rule named `maker` (or any rule of a tuple of names) makes,
    where others read them (a merge of committed pieces): ancient() where this run does not make them again. A
    checkout writes files in its own order, and a piece newer than its table must not merge it again (merging
    reformats the numbers). Snakemake does not rerun a job for ancient inputs even when their rule runs, so a run
    told to make them (--forcerun RULE or PATH, --forceall) takes them as plain inputs, and its new pieces are
    merged.
    """

    def inputs(wildcards):
        force = workflow.dag_settings
        makers = (maker,) if isinstance(maker, str) else maker
        again = force.forceall or any(m in force.forcerun for m in makers)
        return [p if again or p in force.forcerun else ancient(p) for p in paths]

    return inputs


def measured_inputs(**named):
    """Input function (use with unpack) for what reads the uncommitted outputs (traces) of a job that takes more
    GPUs than one: a run whose max_gpus is too small stops and names the setting, rather than start without its
    inputs (a report-only run has no such rule: it keeps the committed result).
    """

    def inputs(wildcards):
        for path in named.values():
            if path in SWITCHED_OFF:
                raise ValueError(
                    f"{path} is switched off in this scale's config (enabled: false)"
                )
            gpus = GPUS_NEEDED.get(path, 0)
            if gpus > MAX_GPUS:
                raise ValueError(
                    f"{path} needs {gpus} GPUs and this run allows max_gpus={MAX_GPUS}:"
                    f" add --config max_gpus={gpus} --resources gpu={gpus}"
                )
        return dict(named)

    return inputs


# The 8B step's runs (leaderboard.smk): each run's own files under LEADERBOARD_RUNS, merged by rule leaderboard_8b.
LEADERBOARD_RUNS = f"{R}/runs"


def leaderboard_run_files(table):
    """Input function: every run file of `table` (after the measuring run, where this run measures), committed ones
    ancient (a checkout's file times never merge them again)."""

    def inputs(wildcards):
        if MEASURE:
            checkpoints.leaderboard_8b_run.get()
            checkpoints.leaderboard_8b_verdict.get()
        runs = sorted(glob.glob(f"{LEADERBOARD_RUNS}/{table}/*.csv"))
        return committed(("leaderboard_8b_run", "leaderboard_8b_verdict"), *runs)(
            wildcards
        )

    return inputs


# The leaderboard's own test after the bench, in a process of its own from empty caches (config
# leaderboard_8b.do_bench; CUDA only): ours at the leaderboard's batch timed by triton.testing.do_bench, one more
# run of the table (its rows' timer is do_bench, its run_wall_s the process's wall time).
def handout_test_command(runs):
    test = S["leaderboard_8b"]["do_bench"]
    if not test["enabled"]:
        return "true"
    return (
        f"python -m cs336_systems.bench.leaderboard {DEVICE_ARGS} --timer do_bench --cold-cache"
        f" --do-bench-ms {test['warmup_ms']} {test['rep_ms']} --size {S['leaderboard_8b']['size']}"
        f" --batch {test['batch']} --context {S['leaderboard_8b']['context_length']} --providers ours"
        f" --ablations --check-size none --compile {S['leaderboard_8b']['compile']}"
        f" --param-dtype {S['leaderboard_8b']['param_dtype']}"
        f" --out '{runs}/leaderboard_8b/{{run_id}}.csv'"
    )
