# Handout 1.1.3 (b, c), 1.1.5 (c), 1.3.1 (b): end-to-end timing of the Transformer LM.


rule e2e_timing:
    output:
        csv=update(f"{R}/e2e.csv"),
        log=update(f"{LOGS}/e2e_timing.log"),
    log:
        f"{ATTEMPTS}/e2e_timing.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        sizes=join(S["model_sizes"]),
        precisions=join(S["e2e"]["precisions"]),
        attention=join(S["e2e"]["attention"]),
        warmup=S["e2e"]["warmup"],
        steps=S["e2e"]["steps"],
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes}"
        " --modes forward_backward --precisions {params.precisions} --attention {params.attention}"
        " --warmup {params.warmup} --steps {params.steps} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule e2e_warmup_point:
    output:
        csv=temp(f"{R}/raw/warmup/{{size}}_w{{warmup}}.csv"),
        log=update(f"{LOGS}/warmup/{{size}}_w{{warmup}}.log"),
    log:
        f"{ATTEMPTS}/warmup/{{size}}_w{{warmup}}.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        steps=S["warmup_sweep"]["steps"],
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {wildcards.size}"
        " --modes forward_backward --warmup {wildcards.warmup} --steps {params.steps}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule e2e_warmup:
    input:
        expand(
            f"{R}/raw/warmup/{{size}}_w{{warmup}}.csv",
            size=S["model_sizes"],
            warmup=S["warmup_sweep"]["warmups"],
        ),
    output:
        csv=update(f"{R}/e2e_warmup.csv"),
        log=update(f"{LOGS}/e2e_warmup.log"),
    log:
        f"{ATTEMPTS}/e2e_warmup.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule compile_timing_size:
    output:
        # kept, not temp(): the sizes' files are committed (results/raw/compile/) so that one size can be measured
        # again and merged with the others; as temp() a rebuild of the report deleted them after merging
        csv=update(f"{R}/raw/compile/{{size}}.csv"),
        log=update(f"{LOGS}/compile/{{size}}.log"),
    log:
        f"{ATTEMPTS}/compile/{{size}}.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        precision=S["compile"]["precision"],
        attention=join(S["compile"]["attention"]),
        optimizer=S["compile"]["optimizer"],
        scopes=join(S["compile"]["scopes"]),
        warmup=S["compile"]["warmup"],
        steps=S["compile"]["steps"],
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {wildcards.size}"
        " --modes forward train_step --precisions {params.precision} --attention {params.attention}"
        " --compile-scopes {params.scopes} --optimizers {params.optimizer}"
        " --warmup {params.warmup} --steps {params.steps} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# One job per model size: the large compiled points take longest, and a cut-short run keeps the rest.
rule compile_timing:
    input:
        committed(
            "compile_timing_size",
            *expand(f"{R}/raw/compile/{{size}}.csv", size=S["model_sizes"]),
        ),
    output:
        csv=update(f"{R}/e2e_compile.csv"),
        log=update(f"{LOGS}/compile_timing.log"),
    log:
        f"{ATTEMPTS}/compile_timing.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# 1.3.1(b): our model and the plain-PyTorch baseline (same config, SDPA, torch.compile, torch's fused AdamW)
# timed in one process, one after the other, in interleaved rounds, so the comparison is within one run on one GPU.
rule e2e_baseline:
    output:
        csv=update(f"{R}/e2e_baseline.csv"),
        log=update(f"{LOGS}/e2e_baseline.log"),
    log:
        f"{ATTEMPTS}/e2e_baseline.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        b=S["baseline"],
        sizes=join(S["baseline"]["sizes"]),
        scopes=join(S["baseline"]["scopes"]),
        weights=join(S["baseline"]["weights"]),
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes} --modes train_step"
        " --models ours plain --precisions {params.b[precision]} --attention {params.b[attention]}"
        " --compile-scopes {params.scopes} --optimizers {params.b[optimizer]} --weights {params.weights}"
        " --warmup {params.b[warmup]} --steps {params.b[steps]} --rounds {params.b[rounds]}"
        " --out {output.csv} 2> {log} && cp {log} {output.log}"


# The optimizer step: our AdamW's two update paths against torch's fused AdamW, every model size. Eager,
# since the optimizer step is not compiled either way and the compiled points cost minutes each.
rule optimizer_timing:
    output:
        csv=update(f"{R}/optimizer.csv"),
        log=update(f"{LOGS}/optimizer_timing.log"),
    log:
        f"{ATTEMPTS}/optimizer_timing.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        sizes=join(S["model_sizes"]),
        o=S["optimizer"],
        optimizers=join(S["optimizer"]["optimizers"]),
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes} --modes train_step"
        " --precisions {params.o[precision]} --attention {params.o[attention]} --optimizers {params.optimizers}"
        " --warmup {params.o[warmup]} --steps {params.o[steps]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule mixed_precision:
    output:
        csv=update(f"{R}/mixed_precision.csv"),
        log=update(f"{LOGS}/mixed_precision.log"),
    log:
        f"{ATTEMPTS}/mixed_precision.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
    shell:
        "python -m cs336_systems.bench.mixed_precision {params.device} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


rule profile_size:
    output:
        csv=temp(f"{R}/raw/profile/{{size}}.csv"),
        log=update(f"{LOGS}/profile/{{size}}.log"),
    log:
        f"{ATTEMPTS}/profile/{{size}}.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        contexts=join(S["profile"]["context_lengths"]),
        batch=S["batch_size"],
        warmup=S["profile"]["warmup"],
        steps=S["profile"]["steps"],
        # where Nsight Systems writes reports (not on our GPU machines), they are kept here
        reports=f"{R}/nsys_reports",
    shell:
        "python -m cs336_systems.bench.profile {params.device} --sizes {wildcards.size}"
        " --context-lengths {params.contexts} --batch-size {params.batch} --warmup {params.warmup}"
        " --steps {params.steps} --nsys-reports {params.reports} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# One job per model size, so a size that fails or is cut short costs only its own points.
rule profile:
    input:
        expand(f"{R}/raw/profile/{{size}}.csv", size=S["model_sizes"]),
    output:
        csv=update(f"{R}/profile.csv"),
        log=update(f"{LOGS}/profile.log"),
    log:
        f"{ATTEMPTS}/profile.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# 1.1.5(c): kernel time against wall time of eager bf16 steps, every size (is the step host-bound?).
rule profile_bf16:
    output:
        csv=update(f"{R}/profile_bf16.csv"),
        log=update(f"{LOGS}/profile_bf16.log"),
    log:
        f"{ATTEMPTS}/profile_bf16.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        sizes=join(S["model_sizes"]),
        contexts=join(S["profile"]["bf16_context_lengths"]),
        batch=S["batch_size"],
        warmup=S["profile"]["warmup"],
        steps=S["profile"]["steps"],
    shell:
        "python -m cs336_systems.bench.profile {params.device} --tool torch --precision bf16 --sizes {params.sizes}"
        " --context-lengths {params.contexts} --batch-size {params.batch} --warmup {params.warmup}"
        " --steps {params.steps} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The allocator history is CUDA's: a scale without a GPU switches 1.1.6 off, and its section says pending.
if not S["memory"]["enabled"]:
    SWITCHED_OFF.update({f"{R}/memory.csv", f"{R}/memory_allocations.csv"})


rule memory_profile:
    output:
        peaks=update(f"{R}/memory.csv"),
        snapshots=directory(f"{R}/memory_snapshots"),
        log=update(f"{LOGS}/memory_profile.log"),
    log:
        f"{ATTEMPTS}/memory_profile.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        mem=S["memory"],
        contexts=join(S["memory"]["context_lengths"]),
        precisions=join(S["memory"]["precisions"]),
        batch=S["batch_size"],
    shell:
        "python -m cs336_systems.bench.memory {params.device} --size {params.mem[size]}"
        " --context-lengths {params.contexts} --precisions {params.precisions} --batch-size {params.batch}"
        " --snapshot-dir {output.snapshots} --out {output.peaks} 2> {log}"
        " && cp {log} {output.log}"


rule memory_timelines:
    input:
        # not committed: made on this machine, so memory_profile's run reaches this rule
        snapshots=f"{R}/memory_snapshots",
        # the snapshots' run: device and commit for the figures (committed: ancient, as common.smk's committed())
        rows=ancient(f"{R}/memory.csv"),
    output:
        csv=update(f"{R}/memory_allocations.csv"),
        log=update(f"{LOGS}/memory_timelines.log"),
    log:
        f"{ATTEMPTS}/memory_timelines.log",
    conda:
        ENV
    params:
        figures=f"{F}/memory",
    shell:
        "python -m cs336_systems.report.memory {input.snapshots}/*.pickle --rows {input.rows} --figures-dir {params.figures}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# ---- The 2026 handout's §2.1 questions with its own Table 1 (xl = our 2025 2.7B, and 10B) -------------------
# The rows carry size_table=2026; 2026 points are limited by memory, not by the 2025 1024-token cap (an
# out-of-memory point, such as the 10B model's fp32 optimizer step on one GPU, is a status=oom row).
E26 = S["edition2026"]
E26_RESULTS = {
    "e2e_timing_2026": f"{R}/e2e_2026.csv",
    "mixed_precision_2026": f"{R}/mixed_precision_2026.csv",
    "profile_2026": f"{R}/profile_2026.csv",
    "memory_profile_2026": f"{R}/memory_2026.csv",
    "memory_timelines_2026": f"{R}/memory_allocations_2026.csv",
    "memory_residuals_2026": f"{R}/block_memory_2026.csv",
}
# Where these are not made by `snakemake writeup` (config: measure_in_writeup false, the full scale until they are
# committed), the report asks only for those already here, so a plain `snakemake writeup` on a fresh clone plans no
# measuring job; each is made by naming it, e.g. `snakemake results/e2e_2026.csv --cores 1 --resources gpu=1`.
if not E26["measure_in_writeup"]:
    SWITCHED_OFF.update(p for p in E26_RESULTS.values() if not os.path.exists(p))
# The allocator history is CUDA's: a scale without a GPU switches the 2026 memory profile off too.
if not E26["memory"]["enabled"]:
    SWITCHED_OFF.update(
        {E26_RESULTS["memory_profile_2026"], E26_RESULTS["memory_timelines_2026"]}
    )
E26_MODEL_ARGS = f"--edition 2026 --batch-size {E26['batch_size']}"


# benchmarking_script (b): forward, backward and optimizer step of every 2026 size at context 512 (fp32).
rule e2e_timing_2026:
    output:
        csv=update(E26_RESULTS["e2e_timing_2026"]),
        log=update(f"{LOGS}/e2e_timing_2026.log"),
    log:
        f"{ATTEMPTS}/e2e_timing_2026.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {E26_MODEL_ARGS} --context-length {E26['context_length']}",
        sizes=join(E26["sizes"]),
        e=E26["e2e"],
        modes=join(E26["e2e"]["modes"]),
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes} --modes {params.modes}"
        " --precisions {params.e[precision]} --attention {params.e[attention]} --optimizers {params.e[optimizer]}"
        " --warmup {params.e[warmup]} --steps {params.e[steps]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# benchmarking_mixed_precision (c): forward and backward, fp32 against bf16 autocast, every 2026 size (10B too).
rule mixed_precision_2026:
    output:
        csv=update(E26_RESULTS["mixed_precision_2026"]),
        log=update(f"{LOGS}/mixed_precision_2026.log"),
    log:
        f"{ATTEMPTS}/mixed_precision_2026.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {E26_MODEL_ARGS} --context-length {E26['context_length']}",
        sizes=join(E26["sizes"]),
        m=E26["mixed_precision"],
        precisions=join(E26["mixed_precision"]["precisions"]),
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes} --modes forward_backward"
        " --precisions {params.precisions} --attention {params.m[attention]}"
        " --warmup {params.m[warmup]} --steps {params.m[steps]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# nsys_profile: two sizes over a ladder of power-of-two contexts above 128; the points that do not fit are
# status=oom rows, and the section discusses the three longest that fit.
rule profile_2026:
    output:
        csv=update(E26_RESULTS["profile_2026"]),
        log=update(f"{LOGS}/profile_2026.log"),
    log:
        f"{ATTEMPTS}/profile_2026.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {E26_MODEL_ARGS}",
        p=E26["profile"],
        sizes=join(E26["profile"]["sizes"]),
        contexts=join(E26["profile"]["context_lengths"]),
        reports=f"{R}/nsys_reports_2026",
    shell:
        "python -m cs336_systems.bench.profile {params.common} --sizes {params.sizes}"
        " --context-lengths {params.contexts} --warmup {params.p[warmup]} --steps {params.p[steps]}"
        " --nsys-reports {params.reports} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# memory_profiling (a-e): the 2026 xl at contexts 128 and 2048; a point naive attention cannot fit is recorded and
# run again with our flash attention.
rule memory_profile_2026:
    output:
        peaks=update(E26_RESULTS["memory_profile_2026"]),
        snapshots=directory(f"{R}/memory_snapshots_2026"),
        log=update(f"{LOGS}/memory_profile_2026.log"),
    log:
        f"{ATTEMPTS}/memory_profile_2026.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {E26_MODEL_ARGS}",
        mem=E26["memory"],
        contexts=join(E26["memory"]["context_lengths"]),
        precisions=join(E26["memory"]["precisions"]),
    shell:
        "python -m cs336_systems.bench.memory {params.common} --size {params.mem[size]}"
        " --context-lengths {params.contexts} --precisions {params.precisions}"
        " --attention {params.mem[attention]} --fallback-attention {params.mem[fallback_attention]}"
        " --snapshot-dir {output.snapshots} --out {output.peaks} 2> {log}"
        " && cp {log} {output.log}"


rule memory_timelines_2026:
    input:
        snapshots=f"{R}/memory_snapshots_2026",  # not committed: made on this machine (as memory_timelines)
        rows=ancient(E26_RESULTS["memory_profile_2026"]),
    output:
        csv=update(E26_RESULTS["memory_timelines_2026"]),
        log=update(f"{LOGS}/memory_timelines_2026.log"),
    log:
        f"{ATTEMPTS}/memory_timelines_2026.log",
    conda:
        ENV
    params:
        figures=f"{F}/memory_2026",
    shell:
        "python -m cs336_systems.report.memory {input.snapshots}/*.pickle --rows {input.rows}"
        " --figures-dir {params.figures} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# memory_profiling (f): residuals and gradient bytes per block (bench/block_memory.py; runs on a CPU too).
rule memory_residuals_2026:
    output:
        csv=update(E26_RESULTS["memory_residuals_2026"]),
        log=update(f"{LOGS}/memory_residuals_2026.log"),
    log:
        f"{ATTEMPTS}/memory_residuals_2026.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {E26_MODEL_ARGS}",
        b=E26["block_memory"],
        contexts=join(E26["block_memory"]["context_lengths"]),
    shell:
        "python -m cs336_systems.bench.block_memory {params.common} --size {params.b[size]}"
        " --context-lengths {params.contexts} --precision {params.b[precision]}"
        " --attention {params.b[attention]} --fallback-attention {params.b[fallback_attention]}"
        " --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"
