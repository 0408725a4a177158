# Handout 1.2.1, 1.3.1 (a), 1.3.2, 1.3.3: attention timing, FlashAttention-2 correctness and speed.


rule attention_timing:
    output:
        csv=update(f"{R}/attention.csv"),
        log=update(f"{LOGS}/attention_timing.log"),
    log:
        f"{ATTEMPTS}/attention_timing.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        head_dims=join(S["attention"]["head_dims"]),
        seqs=join(S["attention"]["seqs"]),
        batch=S["attention"]["batch_size"],
        warmup=S["attention"]["warmup"],
        iters=S["attention"]["iters"],
    shell:
        "python -m cs336_systems.bench.attention_sweep {params.device} --impls eager compiled"
        " --head-dims {params.head_dims} --seqs {params.seqs} --batch-size {params.batch}"
        " --warmup {params.warmup} --iters {params.iters} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The tests, `repeats` times on fresh inputs (a smoke run: the representative subset `select`), and the
# bfloat16 accuracy check against SDPA (seconds; a GPU run adds our Triton kernels to it).
rule flash_correctness:
    output:
        tests=update(f"{R}/flash_correctness.csv"),
        accuracy=update(f"{R}/flash_accuracy.csv"),
        log=update(f"{LOGS}/flash_correctness.log"),
    log:
        f"{ATTEMPTS}/flash_correctness.log",
    conda:
        ENV
    # Triton compiles are single-threaded CPU work; the tests are dealt out to this many processes. On a CPU (the
    # interpreter: nothing to compile) one, so that the job runs beside others instead of waiting for every core.
    threads: 16 if GPUS else 1
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        c=S["flash_correctness"],
        select=(
            f"--select '{S['flash_correctness']['select']}'"
            if S["flash_correctness"].get("select")
            else ""
        ),
    shell:
        "python -m cs336_systems.bench.flash_check {params.device} --workers {threads}"
        " --repeats {params.c[repeats]} {params.select} --accuracy-seeds {params.c[accuracy_seeds]}"
        " --out {output.tests} --accuracy-out {output.accuracy} > {log} 2>&1"
        " && cp {log} {output.log}"


rule flash_benchmark_point:
    output:
        csv=temp(f"{R}/raw/flash/{{dtype}}_d{{head_dim}}.csv"),
        log=update(f"{LOGS}/flash_benchmark/{{dtype}}_d{{head_dim}}.log"),
    log:
        f"{ATTEMPTS}/flash_benchmark/{{dtype}}_d{{head_dim}}.log",
    wildcard_constraints:
        head_dim=r"\d+",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        seqs=join(S["flash"]["seqs"]),
        providers=join(S["flash"]["providers"]),
        pytorch_max_seq=S["flash"]["pytorch_max_seq"],
        warmup_ms=S["flash"]["warmup_ms"],
        rep_ms=S["flash"]["rep_ms"],
    shell:
        "python -m cs336_systems.bench.flash_bench sweep {params.device} --seqs {params.seqs}"
        " --head-dims {wildcards.head_dim} --dtypes {wildcards.dtype} --providers {params.providers}"
        " --pytorch-max-seq {params.pytorch_max_seq} --warmup-ms {params.warmup_ms}"
        " --rep-ms {params.rep_ms} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# One job per (dtype, head dim): a float32 sweep over every head dim in one job outlasted the time a
# GPU job was given, and a job cut short keeps only its own points.
rule flash_benchmark:
    input:
        expand(
            f"{R}/raw/flash/{{dtype}}_d{{head_dim}}.csv",
            dtype=S["flash"]["dtypes"],
            head_dim=S["flash"]["head_dims"],
        ),
    output:
        csv=update(f"{R}/flash_sweep.csv"),
        log=update(f"{LOGS}/flash_benchmark.log"),
    log:
        f"{ATTEMPTS}/flash_benchmark.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# Compiled for the GPU architecture on the CPU: runs anywhere, no GPU resource.
rule flash_resources:
    output:
        csv=update(f"{R}/flash_resources.csv"),
        log=update(f"{LOGS}/flash_resources.log"),
    log:
        f"{ATTEMPTS}/flash_resources.log",
    conda:
        ENV
    params:
        r=S["flash_resources"],
        kernels=join(S["flash_resources"]["kernels"]),
        head_dims=join(S["flash_resources"]["head_dims"]),
        dtypes=join(S["flash_resources"]["dtypes"]),
        dots=join(S["flash_resources"]["float32_dots"]),
    shell:
        "python -m cs336_systems.bench.kernel_resources --arch {params.r[arch]} --kernels {params.kernels}"
        " --head-dims {params.head_dims} --dtypes {params.dtypes} --float32-dots {params.dots}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule flash_llm_shapes_point:
    output:
        # kept, not temp(): one head dim can be measured again and merged with the other's committed piece
        csv=update(f"{R}/raw/flash_llm_shapes/d{{head_dim}}.csv"),
        log=update(f"{LOGS}/flash_llm_shapes/d{{head_dim}}.log"),
    log:
        f"{ATTEMPTS}/flash_llm_shapes/d{{head_dim}}.log",
    wildcard_constraints:
        head_dim=r"\d+",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        f=S["flash_llm_shapes"],
        batch_heads=join(S["flash_llm_shapes"]["batch_heads"]),
        seqs=join(S["flash_llm_shapes"]["seqs"]),
        causal=join(S["flash_llm_shapes"]["causal"]),
        providers=join(S["flash_llm_shapes"]["providers"]),
    shell:
        "python -m cs336_systems.bench.flash_bench llm-shapes {params.device} --batch-heads {params.batch_heads}"
        " --seqs {params.seqs} --head-dims {wildcards.head_dim} --causal {params.causal}"
        " --max-tokens {params.f[max_tokens]} --providers {params.providers}"
        " --warmup-ms {params.f[warmup_ms]} --rep-ms {params.f[rep_ms]} --rounds {params.f[rounds]}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# One job per head dim: the whole grid in one job ran close to, and with a cold Triton cache past, the 10
# minutes a GPU job was given (results/README.md, "Still to run"); a job cut short keeps only its own points.
rule flash_llm_shapes:
    input:
        committed(
            "flash_llm_shapes_point",
            *expand(
                f"{R}/raw/flash_llm_shapes/d{{head_dim}}.csv",
                head_dim=S["flash_llm_shapes"]["head_dims"],
            ),
        ),
    output:
        csv=update(f"{R}/flash_llm_shapes.csv"),
        log=update(f"{LOGS}/flash_llm_shapes.log"),
    log:
        f"{ATTEMPTS}/flash_llm_shapes.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The first call at the leaderboard's shape in a fresh process (Triton compiling and autotuning): GPU scales only.
if S["flash_llm_shapes"]["first_call"]:

    rule flash_first_call:
        output:
            csv=update(f"{R}/flash_first_call.csv"),
            log=update(f"{LOGS}/flash_first_call.log"),
        log:
            f"{ATTEMPTS}/flash_first_call.log",
        conda:
            ENV
        resources:
            gpu=GPUS,
        params:
            device=DEVICE_ARGS,
        shell:
            "python -m cs336_systems.bench.flash_bench first-call {params.device} --out {output.csv} 2> {log}"
            " && cp {log} {output.log}"


rule flash_leaderboard:
    output:
        csv=update(f"{R}/flash_leaderboard.csv"),
        log=update(f"{LOGS}/flash_leaderboard.log"),
    log:
        f"{ATTEMPTS}/flash_leaderboard.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        lb=S["leaderboard"],
        providers=join(S["leaderboard"]["providers"]),
    shell:
        "python -m cs336_systems.bench.flash_bench leaderboard {params.device} --heads {params.lb[heads]}"
        " --seq-len {params.lb[seq_len]} --head-dim {params.lb[head_dim]} --dtype {params.lb[dtype]}"
        " --compile {params.lb[compile]} --providers {params.providers}"
        " --warmup-ms {params.lb[warmup_ms]} --rep-ms {params.lb[rep_ms]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"
