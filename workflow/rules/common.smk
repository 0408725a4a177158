from snakemake.utils import validate

validate(config, workflow.source_path("../schemas/config.schema.yaml"))

SCALE = config["scale"]
S = config["scales"][SCALE]
R = S["results"]  # results directory of this scale
F = S["figures"]  # figures directory of this scale
GPUS = S["gpus_per_job"]
LOGS = f"logs/{SCALE}"
ENV = "../envs/cs336.yaml"

# Arguments every benchmark CLI gets at this scale.
DEVICE_ARGS = f"--device {S['device']}"
MODEL_ARGS = f"--batch-size {S['batch_size']} --context-length {S['context_length']}"


wildcard_constraints:
    size="|".join(re.escape(s) for s in S["model_sizes"]),
    warmup=r"\d+",
    dtype="fp32|bf16|fp16",


def join(values):
    return " ".join(str(v) for v in values)
