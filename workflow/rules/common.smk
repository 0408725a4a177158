from snakemake.utils import validate

validate(config, workflow.source_path("../schemas/config.schema.yaml"))

SCALE = config["scale"]
S = config["scales"][SCALE]
R = S["results"]  # results directory of this scale
F = S["figures"]  # figures directory of this scale
GPUS = S["gpus_per_job"]
LOGS = f"{R}/logs"  # run logs travel with the results they explain
ENV = "../envs/cs336.yaml"
# measure=false builds tables, figures and the writeup from the results already present (e.g. the
# committed GPU results on a machine without a GPU) and leaves deliverables without data pending.
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


def available(inputs):
    """The names whose data exists, or all of them when this run may measure."""
    return [name for name, data in inputs.items() if MEASURE or os.path.exists(data)]


def wanted(*paths):
    """The paths, unless this run only reports (measure=false) and they were never measured."""
    return [p for p in paths if MEASURE or os.path.exists(p)]
