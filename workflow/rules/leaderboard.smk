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
