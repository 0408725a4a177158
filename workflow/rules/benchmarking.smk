# Handout 1.1.3 (b, c), 1.1.5 (c), 1.3.1 (b): end-to-end timing of the Transformer LM.


rule e2e_timing:
    output:
        f"{R}/e2e.csv",
    log:
        f"{LOGS}/e2e_timing.log",
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
        " --warmup {params.warmup} --steps {params.steps} --out {output} 2> {log}"


rule e2e_warmup_point:
    output:
        temp(f"{R}/raw/warmup/{{size}}_w{{warmup}}.csv"),
    log:
        f"{LOGS}/warmup/{{size}}_w{{warmup}}.log",
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
        " --out {output} 2> {log}"


rule e2e_warmup:
    input:
        expand(
            f"{R}/raw/warmup/{{size}}_w{{warmup}}.csv",
            size=S["model_sizes"],
            warmup=S["warmup_sweep"]["warmups"],
        ),
    output:
        f"{R}/e2e_warmup.csv",
    log:
        f"{LOGS}/e2e_warmup.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output} 2> {log}"


rule compile_timing_size:
    output:
        # kept, not temp(): the sizes' files are committed (results/raw/compile/) so that one size can be measured
        # again and merged with the others; as temp() a rebuild of the report deleted them after merging
        f"{R}/raw/compile/{{size}}.csv",
    log:
        f"{LOGS}/compile/{{size}}.log",
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
        " --warmup {params.warmup} --steps {params.steps} --out {output} 2> {log}"


# One job per model size: the large compiled points take longest, and a cut-short run keeps the rest.
rule compile_timing:
    input:
        expand(f"{R}/raw/compile/{{size}}.csv", size=S["model_sizes"]),
    output:
        f"{R}/e2e_compile.csv",
    log:
        f"{LOGS}/compile_timing.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output} 2> {log}"


# 1.3.1(b): our model and the plain-PyTorch baseline (same config, SDPA, torch.compile, torch's fused AdamW)
# timed in one process, one after the other, so the comparison is within one run on one GPU.
rule e2e_baseline:
    output:
        f"{R}/e2e_baseline.csv",
    log:
        f"{LOGS}/e2e_baseline.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        common=f"{DEVICE_ARGS} {MODEL_ARGS}",
        b=S["baseline"],
        sizes=join(S["baseline"]["sizes"]),
        scopes=join(S["baseline"]["scopes"]),
    shell:
        "python -m cs336_systems.bench.e2e {params.common} --sizes {params.sizes} --modes train_step"
        " --models ours plain --precisions {params.b[precision]} --attention {params.b[attention]}"
        " --compile-scopes {params.scopes} --optimizers {params.b[optimizer]}"
        " --warmup {params.b[warmup]} --steps {params.b[steps]} --out {output} 2> {log}"


# The optimizer step: our AdamW's two update paths against torch's fused AdamW, every model size. Eager,
# since the optimizer step is not compiled either way and the compiled points cost minutes each.
rule optimizer_timing:
    output:
        f"{R}/optimizer.csv",
    log:
        f"{LOGS}/optimizer_timing.log",
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
        " --warmup {params.o[warmup]} --steps {params.o[steps]} --out {output} 2> {log}"


rule mixed_precision:
    output:
        f"{R}/mixed_precision.csv",
    log:
        f"{LOGS}/mixed_precision.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
    shell:
        "python -m cs336_systems.bench.mixed_precision {params.device} --out {output} 2> {log}"


rule profile_size:
    output:
        temp(f"{R}/raw/profile/{{size}}.csv"),
    log:
        f"{LOGS}/profile/{{size}}.log",
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
        " --steps {params.steps} --nsys-reports {params.reports} --out {output} 2> {log}"


# One job per model size, so a size that fails or is cut short costs only its own points.
rule profile:
    input:
        expand(f"{R}/raw/profile/{{size}}.csv", size=S["model_sizes"]),
    output:
        f"{R}/profile.csv",
    log:
        f"{LOGS}/profile.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.bench.merge {input} --out {output} 2> {log}"


# 1.1.5(c): kernel time against wall time of eager bf16 steps, every size (is the step host-bound?).
rule profile_bf16:
    output:
        f"{R}/profile_bf16.csv",
    log:
        f"{LOGS}/profile_bf16.log",
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
        " --steps {params.steps} --out {output} 2> {log}"


# The allocator history is CUDA's: a scale without a GPU switches 1.1.6 off, and its section says pending.
if not S["memory"]["enabled"]:
    SWITCHED_OFF.update({f"{R}/memory.csv", f"{R}/memory_allocations.csv"})


rule memory_profile:
    output:
        peaks=f"{R}/memory.csv",
        snapshots=directory(f"{R}/memory_snapshots"),
    log:
        f"{LOGS}/memory_profile.log",
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


rule memory_timelines:
    input:
        snapshots=f"{R}/memory_snapshots",
        rows=f"{R}/memory.csv",  # the snapshots' run: device and commit for the figures
    output:
        f"{R}/memory_allocations.csv",
    log:
        f"{LOGS}/memory_timelines.log",
    conda:
        ENV
    params:
        figures=f"{F}/memory",
    shell:
        "python -m cs336_systems.report.memory {input.snapshots}/*.pickle --rows {input.rows} --figures-dir {params.figures}"
        " --out {output} 2> {log}"
