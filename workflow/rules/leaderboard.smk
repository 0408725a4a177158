# Handout 2026 §9 (the 8B training-step leaderboard): its parts, measured one by one. The fused LM head +
# cross-entropy against the plain (eager and compiled) loss at the 8B model's head (d_model 4096, vocab 151936).


rule linear_ce:
    output:
        csv=update(f"{R}/linear_ce.csv"),
        log=update(f"{LOGS}/linear_ce.log"),
    log:
        f"{ATTEMPTS}/linear_ce.log",
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
        " --chunk-tokens {params.c[chunk_tokens]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"


# The whole 8B training step (2026 §9, issue 24): ours against the plain-PyTorch anchors (selective and full
# checkpointing) and the ablations of ours, one process, after a small-scale correctness check. After each
# point's timed steps one more step runs under the profiler (time by category, peak memory split); on CUDA its
# allocator snapshot goes to leaderboard_8b_snapshots/ (large: not committed).
# Each run writes files of its own, never rewritten: runs/leaderboard_8b/<run_id>.csv (timing rows),
# runs/leaderboard_8b_check/<run_id>.csv (the correctness check) and runs/leaderboard_8b_profile/<run_id>.csv.
# A run is added by `snakemake results/leaderboard_8b.csv --forcerun leaderboard_8b_run --cores 1 --resources gpu=1`;
# its marker (committed) keeps a plain rebuild from measuring again, as a committed results file does.


checkpoint leaderboard_8b_run:
    output:
        marker=touch(f"{LEADERBOARD_RUNS}/leaderboard_8b.measured"),
        log=update(f"{LOGS}/leaderboard_8b.log"),
    log:
        f"{ATTEMPTS}/leaderboard_8b.log",
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
        runs=lambda wildcards, output: os.path.dirname(output.marker),
        handout_test=lambda wildcards, output: handout_test_command(
            os.path.dirname(output.marker)
        ),
    shell:
        "python -m cs336_systems.bench.leaderboard {params.device} --size {params.c[size]}"
        " --batch {params.batches} --context {params.c[context_length]} --providers {params.providers}"
        " --ablations {params.ablations} --ablation-batch {params.ablation_batches}"
        " --warmup {params.c[warmup]} --steps {params.c[steps]} --compile {params.c[compile]}"
        " --param-dtype {params.c[param_dtype]} --check-size {params.c[check_size]}"
        " --check-context {params.c[check_context]} --profile {params.snapshots}"
        " --out '{params.runs}/leaderboard_8b/{{run_id}}.csv'"
        " --check-out '{params.runs}/leaderboard_8b_check/{{run_id}}.csv'"
        " --profile-out '{params.runs}/leaderboard_8b_profile/{{run_id}}.csv' 2> {log}"
        " && {params.handout_test} 2>> {log}"
        " && cp {log} {output.log}"


# The verdict (issue 59): config leaderboard_8b.verdict's runs of ours and the SAC anchor at one batch, one commit,
# each its own process (no ablations, no profiled step), added to the same run files. Made by
# `snakemake results/leaderboard_8b.csv --forcerun leaderboard_8b_verdict --cores 1 --resources gpu=1`.
checkpoint leaderboard_8b_verdict:
    output:
        marker=touch(f"{LEADERBOARD_RUNS}/leaderboard_8b_verdict.measured"),
        log=update(f"{LOGS}/leaderboard_8b_verdict.log"),
    log:
        f"{ATTEMPTS}/leaderboard_8b_verdict.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        c=S["leaderboard_8b"],
        v=S["leaderboard_8b"]["verdict"],
        providers=join(S["leaderboard_8b"]["verdict"]["providers"]),
        runs=lambda wildcards, output: os.path.dirname(output.marker),
    shell:
        ": > {log} && for run in $(seq {params.v[runs]}); do"
        " python -m cs336_systems.bench.leaderboard {params.device} --size {params.c[size]}"
        " --batch {params.v[batch]} --context {params.c[context_length]} --providers {params.providers}"
        " --ablations --warmup {params.c[warmup]} --steps {params.c[steps]} --compile {params.c[compile]}"
        " --param-dtype {params.c[param_dtype]} --check-size {params.c[check_size]}"
        " --check-context {params.c[check_context]}"
        " --out '{params.runs}/leaderboard_8b/{{run_id}}.csv'"
        " --check-out '{params.runs}/leaderboard_8b_check/{{run_id}}.csv' 2>> {log}; done"
        " && cp {log} {output.log}"


# The tables are merged from every run's files, in the order the runs ran; `quoted` marks the rows of the run the
# writeup quotes: per batch in the step table, by config leaderboard_8b.quote; the latest profiled run in the profile.
rule leaderboard_8b:
    input:
        steps=leaderboard_run_files("leaderboard_8b"),
        checks=leaderboard_run_files("leaderboard_8b_check"),
        profile=leaderboard_run_files("leaderboard_8b_profile"),
    output:
        steps=update(f"{R}/leaderboard_8b.csv"),
        checks=update(f"{R}/leaderboard_8b_check.csv"),
        profile=update(f"{R}/leaderboard_8b_profile.csv"),
        log=update(f"{LOGS}/leaderboard_8b_merge.log"),
    log:
        f"{ATTEMPTS}/leaderboard_8b_merge.log",
    conda:
        ENV
    params:
        quote=join(S["leaderboard_8b"]["quote"]),
    shell:
        "(python -m cs336_systems.bench.merge {input.steps} --out {output.steps} --sort-by timestamp"
        " --quote {params.quote} --quote-per batch timer --default timer=steps"
        " && python -m cs336_systems.bench.merge {input.checks} --out {output.checks} --sort-by timestamp"
        " && python -m cs336_systems.bench.merge {input.profile} --out {output.profile} --sort-by timestamp"
        " --quote latest) 2> {log}"
        " && cp {log} {output.log}"
