# Handout 2026 §9 (the 8B training-step leaderboard): its parts, measured one by one. The fused LM head +
# cross-entropy against the plain (eager and compiled) loss at the 8B model's head (d_model 4096, vocab 151936).


rule linear_ce:
    output:
        f"{R}/linear_ce.csv",
    log:
        f"{LOGS}/linear_ce.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        c=S["linear_ce"],
        tokens=join(S["linear_ce"]["tokens"]),
    shell:
        "python -m cs336_systems.bench.linear_ce {params.device} --tokens {params.tokens}"
        " --d-model {params.c[d_model]} --vocab {params.c[vocab]} --dtype {params.c[dtype]}"
        " --chunk-tokens {params.c[chunk_tokens]} --out {output} 2> {log}"


# The whole 8B training step (2026 §9, issue 24): ours against the plain-PyTorch anchors (selective and full
# checkpointing) and the ablations of ours, one process, after a small-scale correctness check. After each
# point's timed steps one more step runs under the profiler: its time by category and peak memory split are the
# second output; on CUDA its allocator snapshot goes to leaderboard_8b_snapshots/ (large: not committed).
rule leaderboard_8b:
    output:
        steps=f"{R}/leaderboard_8b.csv",
        profile=f"{R}/leaderboard_8b_profile.csv",
    log:
        f"{LOGS}/leaderboard_8b.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        c=S["leaderboard_8b"],
        batches=join(S["leaderboard_8b"]["batches"]),
        providers=join(S["leaderboard_8b"]["providers"]),
        ablations=join(S["leaderboard_8b"]["ablations"]),
        ablation_batches=join(S["leaderboard_8b"]["ablation_batches"]),
        snapshots=f"{R}/leaderboard_8b_snapshots",
    shell:
        "python -m cs336_systems.bench.leaderboard {params.device} --size {params.c[size]}"
        " --batch {params.batches} --context {params.c[context_length]} --providers {params.providers}"
        " --ablations {params.ablations} --ablation-batch {params.ablation_batches}"
        " --warmup {params.c[warmup]} --steps {params.c[steps]} --compile {params.c[compile]}"
        " --param-dtype {params.c[param_dtype]} --check-size {params.c[check_size]}"
        " --check-context {params.c[check_context]} --profile {params.snapshots}"
        " --profile-out {output.profile} --out {output.steps} 2> {log}"
