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


# The settings every timed run of the 8B step shares (the bench's runs and the verdict's): size, context, steps,
# compilation, dtype and the correctness check, from config leaderboard_8b.
LB = S["leaderboard_8b"]
LEADERBOARD_STEP = (
    f"--size {LB['size']} --context {LB['context_length']} --warmup {LB['warmup']} --steps {LB['steps']}"
    f" --compile {LB['compile']} --param-dtype {LB['param_dtype']} --check-size {LB['check_size']}"
    f" --check-context {LB['check_context']}"
)


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
        step=LEADERBOARD_STEP,
        batches=join(LB["batches"]),
        providers=join(LB["providers"]),
        ablations=join(LB["ablations"]),
        ablation_batches=join(LB["ablation_batches"]),
        snapshots=f"{R}/leaderboard_8b_snapshots",
        runs=lambda wildcards, output: os.path.dirname(output.marker),
        handout_test=lambda wildcards, output: handout_test_command(
            os.path.dirname(output.marker)
        ),
    shell:
        "python -m cs336_systems.bench.leaderboard {params.device} {params.step}"
        " --batch {params.batches} --providers {params.providers}"
        " --ablations {params.ablations} --ablation-batch {params.ablation_batches}"
        " --profile {params.snapshots}"
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
        step=LEADERBOARD_STEP,
        v=LB["verdict"],
        providers=join(LB["verdict"]["providers"]),
        runs=lambda wildcards, output: os.path.dirname(output.marker),
    shell:
        ": > {log} && for run in $(seq {params.v[runs]}); do"
        " python -m cs336_systems.bench.leaderboard {params.device} {params.step}"
        " --batch {params.v[batch]} --providers {params.providers} --ablations"
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
        quote=join(LB["quote"]),
    shell:
        "(python -m cs336_systems.bench.merge {input.steps} --out {output.steps} --sort-by timestamp"
        " --quote {params.quote} --quote-per batch timer --default timer=steps"
        " && python -m cs336_systems.bench.merge {input.checks} --out {output.checks} --sort-by timestamp"
        " && python -m cs336_systems.bench.merge {input.profile} --out {output.profile} --sort-by timestamp"
        " --quote latest) 2> {log}"
        " && cp {log} {output.log}"
