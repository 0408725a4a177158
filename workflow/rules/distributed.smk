# Handout 2.1, 2.2, 2.3, 3: all-reduce, data-parallel training and optimizer-state sharding.
# Ranks are started with torchrun; NCCL rules ask for as many GPUs as they have ranks.

ALLREDUCE_POINTS = [f"gloo_{n}" for n in S["allreduce"]["gloo_world_sizes"]] + [
    f"nccl_{n}" for n in S["allreduce"]["nccl_world_sizes"]
]
DDP = S["ddp"]
TRAIN = S["train_matrix"]
FSDP_CFG = S["fsdp"]

needs_gpus(max(S["allreduce"]["nccl_world_sizes"], default=0), f"{R}/allreduce.csv")
needs_gpus(
    DDP["gpus"],
    *(f"{R}/{name}.csv" for name in DDP["configs"]),
    f"{R}/ddp_spread.csv",
    f"{R}/ddp_traces.csv",
    f"{R}/ddp_traces",
    f"{R}/ddp_overlap.csv",
)
needs_gpus(TRAIN["gpus"], f"{R}/train_matrix.csv")
needs_gpus(
    FSDP_CFG["gpus"],
    f"{R}/fsdp.csv",
    f"{R}/fsdp_traces.csv",
    f"{R}/fsdp_traces",
    f"{R}/fsdp_overlap.csv",
)


rule allreduce_point:
    output:
        csv=temp(f"{R}/raw/allreduce/{{backend}}_{{world}}.csv"),
        log=update(f"{LOGS}/allreduce/{{backend}}_{{world}}.log"),
    log:
        f"{ATTEMPTS}/allreduce/{{backend}}_{{world}}.log",
    wildcard_constraints:
        backend="gloo|nccl",
        world=r"\d+",
    conda:
        ENV
    resources:
        gpu=lambda wc: int(wc.world) if wc.backend == "nccl" else 0,
    params:
        sizes=join(S["allreduce"]["sizes_mb"]),
        iters=S["allreduce"]["iters"],
        ops=join(S["allreduce"].get("ops", ["all_reduce"])),
        # bursts of back-to-back all-reduces (2.3(b)'s per-call cost) on the backends config.yaml names
        burst=lambda wc: (
            f"--burst {S['allreduce']['burst']} --burst-sizes-mb {join(S['allreduce']['burst_sizes_mb'])}"
            if wc.backend in S["allreduce"].get("burst_backends", [])
            else ""
        ),
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {wildcards.world} -m cs336_systems.bench.allreduce"
        " --backend {wildcards.backend} --sizes-mb {params.sizes} --iters {params.iters} --ops {params.ops}"
        " {params.burst} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule allreduce:
    input:
        expand(f"{R}/raw/allreduce/{{point}}.csv", point=ALLREDUCE_POINTS),
    output:
        csv=update(f"{R}/allreduce.csv"),
        log=update(f"{LOGS}/allreduce.log"),
    log:
        f"{ATTEMPTS}/allreduce.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule ddp_benchmark:
    output:
        csv=update(f"{R}/{{deliverable}}.csv"),
        log=update(f"{LOGS}/{{deliverable}}.log"),
    log:
        f"{ATTEMPTS}/{{deliverable}}.log",
    wildcard_constraints:
        deliverable="|".join(DDP["configs"]),
    conda:
        ENV
    resources:
        gpu=DDP["gpus"],
    params:
        configs=lambda wc: join(DDP["configs"][wc.deliverable]),
        precisions=join(DDP["precisions"]),
        ddp=DDP,
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.ddp[world_size]} -m cs336_systems.bench.ddp"
        " --backend {params.ddp[backend]} --size {params.ddp[size]} --batch-size {params.ddp[batch_size]}"
        " --context-length {params.ddp[context_length]} --precisions {params.precisions}"
        " --attention {params.ddp[attention]} --warmup {params.ddp[warmup]} --steps {params.ddp[steps]}"
        " --compile {params.ddp[compile]} --adamw {params.ddp[adamw]}"
        " --rounds {params.ddp[rounds]} --configs {params.configs} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The round-to-round spread that sets `ddp.rounds` (report.ddp_analysis.rounds_paragraph): two configs close
# in speed, the tables' settings otherwise, in more interleaved rounds.
rule ddp_spread:
    output:
        csv=update(f"{R}/ddp_spread.csv"),
        log=update(f"{LOGS}/ddp_spread.log"),
    log:
        f"{ATTEMPTS}/ddp_spread.log",
    conda:
        ENV
    resources:
        gpu=DDP["gpus"],
    params:
        configs=join(DDP["spread"]["configs"]),
        spread=DDP["spread"],
        ddp=DDP,
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.ddp[world_size]} -m cs336_systems.bench.ddp"
        " --backend {params.ddp[backend]} --size {params.ddp[size]} --batch-size {params.ddp[batch_size]}"
        " --context-length {params.ddp[context_length]} --precisions {params.spread[precision]}"
        " --attention {params.ddp[attention]} --warmup {params.ddp[warmup]} --steps {params.ddp[steps]}"
        " --compile {params.ddp[compile]} --adamw {params.ddp[adamw]}"
        " --rounds {params.spread[rounds]} --configs {params.configs} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule ddp_traces:
    output:
        timings=update(f"{R}/ddp_traces.csv"),
        traces=directory(f"{R}/ddp_traces"),
        log=update(f"{LOGS}/ddp_traces.log"),
    log:
        f"{ATTEMPTS}/ddp_traces.log",
    conda:
        ENV
    resources:
        gpu=DDP["gpus"],
    params:
        configs=join(DDP["trace_configs"]),
        precisions=join(DDP["trace_precisions"]),
        ddp=DDP,
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.ddp[world_size]} -m cs336_systems.bench.ddp"
        " --backend {params.ddp[backend]} --size {params.ddp[size]} --batch-size {params.ddp[batch_size]}"
        " --context-length {params.ddp[context_length]} --precisions {params.precisions}"
        " --attention {params.ddp[attention]} --warmup {params.ddp[warmup]} --steps 2"
        " --compile {params.ddp[compile]} --adamw {params.ddp[adamw]} --configs {params.configs}"
        " --trace-dir {output.traces} --out {output.timings} 2> {log}"
        " && cp {log} {output.log}"


# Correctness in the writeup: the wrapper and sharded-optimizer tests (CPU, gloo) rerun with fresh seeds,
# counted per test. Needs the tests/ folder of this checkout. The tests are code, like the library: not input files
# (a checkout writes them after the committed table), so a change to them is measured with --forcerun.
rule ddp_correctness:
    output:
        csv=update(f"{R}/ddp_correctness.csv"),
        log=update(f"{LOGS}/ddp_correctness.log"),
    log:
        f"{ATTEMPTS}/ddp_correctness.log",
    conda:
        ENV
    params:
        tests=join(DDP["correctness_tests"]),
        repeats=DDP["correctness_repeats"],
        select=DDP["correctness_select"],
    shell:
        "python -m cs336_systems.bench.ddp_correctness {params.tests} -k '{params.select}' --repeats {params.repeats}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The traces are not committed (large): a report-only run (measure=false) keeps the committed table.
# The rows are the traces' run: device and commit for the figures.
rule ddp_overlap:
    input:
        # the traces are not committed, so ddp_traces' run reaches this rule; the rows are (ancient: common.smk)
        unpack(
            measured_inputs(
                traces=f"{R}/ddp_traces", rows=ancient(f"{R}/ddp_traces.csv")
            )
        ),
    output:
        csv=update(f"{R}/ddp_overlap.csv"),
        log=update(f"{LOGS}/ddp_overlap.log"),
    log:
        f"{ATTEMPTS}/ddp_overlap.log",
    conda:
        ENV
    params:
        figures=f"{F}/ddp_traces",
    shell:
        "python -m cs336_systems.report.traces {input.traces}/*.json --rows {input.rows} --figures-dir {params.figures}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# End to end: short training runs of our model, attention backend x data-parallel wrapper (train.py).


# The wrapper wildcard is a data-parallel spec from config.yaml, passed verbatim (train.py parses it);
# `none` is the single-GPU run: one process on the whole global batch, so every run sees the same tokens.
rule train_point:
    output:
        csv=temp(f"{R}/raw/train/{{attention}}_{{wrapper}}.csv"),
        log=update(f"{LOGS}/train/{{attention}}_{{wrapper}}.log"),
    log:
        f"{ATTEMPTS}/train/{{attention}}_{{wrapper}}.log",
    wildcard_constraints:
        attention="|".join(re.escape(a) for a in TRAIN["attention"]),
        wrapper="|".join(re.escape(w) for w in TRAIN["wrappers"]),
    conda:
        ENV
    # Every point reserves all the matrix's GPUs, the single-GPU runs too: Snakemake counts GPUs but
    # does not place jobs on them, so two single-GPU points would otherwise share one device.
    resources:
        gpu=TRAIN["gpus"],
    params:
        t=TRAIN,
        nproc=lambda wc: 1 if wc.wrapper == "none" else TRAIN["world_size"],
        batch=lambda wc: TRAIN["batch_size"]
        * (TRAIN["world_size"] if wc.wrapper == "none" else 1),
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.nproc} -m cs336_systems.train --size {params.t[size]}"
        " --wrapper {wildcards.wrapper} --attention {wildcards.attention} --batch-size {params.batch}"
        " --context-length {params.t[context_length]} --precision {params.t[precision]}"
        " --steps {params.t[steps]} --backend {params.t[backend]} --log-every 1000000"
        " --loss-log {output.csv} > {log} 2>&1"
        " && cp {log} {output.log}"


rule train_matrix:
    input:
        expand(
            f"{R}/raw/train/{{attention}}_{{wrapper}}.csv",
            attention=TRAIN["attention"],
            wrapper=TRAIN["wrappers"],
        ),
    output:
        csv=update(f"{R}/train_matrix.csv"),
        log=update(f"{LOGS}/train_matrix.log"),
    log:
        f"{ATTEMPTS}/train_matrix.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# 2026 handout, section 7 (fsdp, fsdp_accounting): our FSDP against torch's FSDP2, our bucketed DDP and our
# ZeRO-1, all in one run per model size (bench.ddp with the fully-sharded kinds), and a trace of one step.


rule fsdp_point:
    output:
        csv=update(f"{R}/fsdp/{{size}}.csv"),
        log=update(f"{LOGS}/fsdp/{{size}}.log"),
    log:
        f"{ATTEMPTS}/fsdp/{{size}}.log",
    wildcard_constraints:
        size="|".join(re.escape(s) for s in FSDP_CFG["sizes"]),
    conda:
        ENV
    resources:
        gpu=FSDP_CFG["gpus"],
    params:
        f=FSDP_CFG,
        configs=join(FSDP_CFG["configs"]),
        precisions=join(FSDP_CFG["precisions"]),
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.f[world_size]} -m cs336_systems.bench.ddp"
        " --backend {params.f[backend]} --size {wildcards.size} --batch-size {params.f[batch_size]}"
        " --context-length {params.f[context_length]} --precisions {params.precisions}"
        " --attention {params.f[attention]} --warmup {params.f[warmup]} --steps {params.f[steps]}"
        " --compile none --adamw {params.f[adamw]} --rounds {params.f[rounds]}"
        " --configs {params.configs} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule fsdp_benchmark:
    input:
        committed(
            "fsdp_point", *expand(f"{R}/fsdp/{{size}}.csv", size=FSDP_CFG["sizes"])
        ),
    output:
        csv=update(f"{R}/fsdp.csv"),
        log=update(f"{LOGS}/fsdp.log"),
    log:
        f"{ATTEMPTS}/fsdp.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule fsdp_traces:
    output:
        timings=update(f"{R}/fsdp_traces.csv"),
        traces=directory(f"{R}/fsdp_traces"),
        log=update(f"{LOGS}/fsdp_traces.log"),
    log:
        f"{ATTEMPTS}/fsdp_traces.log",
    conda:
        ENV
    resources:
        gpu=FSDP_CFG["gpus"],
    params:
        f=FSDP_CFG,
        configs=join(FSDP_CFG["trace_configs"]),
    shell:
        "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone"
        " --nproc_per_node {params.f[world_size]} -m cs336_systems.bench.ddp"
        " --backend {params.f[backend]} --size {params.f[trace_size]} --batch-size {params.f[batch_size]}"
        " --context-length {params.f[context_length]} --precisions {params.f[trace_precision]}"
        " --attention {params.f[attention]} --warmup {params.f[warmup]} --steps 2 --compile none"
        " --adamw {params.f[adamw]} --configs {params.configs} --trace-dir {output.traces}"
        " --out {output.timings} 2> {log}"
        " && cp {log} {output.log}"


# The traces are not committed (large): a report-only run (measure=false) keeps the committed table.
# The rows are the traces' run: device and commit for the figures.
rule fsdp_overlap:
    input:
        # the traces are not committed, so fsdp_traces' run reaches this rule; the rows are (ancient: common.smk)
        unpack(
            measured_inputs(
                traces=f"{R}/fsdp_traces", rows=ancient(f"{R}/fsdp_traces.csv")
            )
        ),
    output:
        csv=update(f"{R}/fsdp_overlap.csv"),
        log=update(f"{LOGS}/fsdp_overlap.log"),
    log:
        f"{ATTEMPTS}/fsdp_overlap.log",
    conda:
        ENV
    params:
        figures=f"{F}/fsdp_traces",
    shell:
        "python -m cs336_systems.report.traces {input.traces}/*.json --rows {input.rows} --figures-dir {params.figures}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"
