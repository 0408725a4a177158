# Handout 2026 §3: what autograd saves for backward (3.1, 3.2), and the peak memory and step time of
# activation checkpointing policies (3.2, Problem gradient_checkpointing (b)).


rule saved_tensors:
    output:
        totals=update(f"{R}/saved_tensors.csv"),
        tensors=update(f"{R}/saved_tensors_list.csv"),
        log=update(f"{LOGS}/saved_tensors.log"),
    log:
        f"{ATTEMPTS}/saved_tensors.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        s=S["checkpointing"]["saved_tensors"],
        cases=join(S["checkpointing"]["saved_tensors"]["cases"]),
        modes=join(S["checkpointing"]["saved_tensors"]["modes"]),
    shell:
        "python -m cs336_systems.bench.saved_tensors {params.device} --cases {params.cases}"
        " --modes {params.modes} --batch-size {params.s[batch_size]} --d-model {params.s[d_model]}"
        " --d-ff {params.s[d_ff]} --num-heads {params.s[num_heads]}"
        " --context-length {params.s[context_length]}"
        " --norm-context-length {params.s[norm_context_length]}"
        " --precision {params.s[precision]} --out {output.totals}"
        " --tensors-out {output.tensors} 2> {log}"
        " && cp {log} {output.log}"


rule checkpoint_sweep:
    output:
        csv=update(f"{R}/checkpointing.csv"),
        log=update(f"{LOGS}/checkpoint_sweep.log"),
    log:
        f"{ATTEMPTS}/checkpoint_sweep.log",
    conda:
        ENV
    resources:
        gpu=GPUS,
    params:
        device=DEVICE_ARGS,
        s=S["checkpointing"]["sweep"],
        policies=join(S["checkpointing"]["sweep"]["policies"]),
    shell:
        "python -m cs336_systems.bench.checkpointing {params.device} --edition {params.s[edition]}"
        " --size {params.s[size]} --batch-size {params.s[batch_size]}"
        " --context-length {params.s[context_length]} --precision {params.s[precision]}"
        " --attention {params.s[attention]} --compile {params.s[compile]}"
        " --optimizer {params.s[optimizer]} --policies {params.policies}"
        " --warmup {params.s[warmup]} --steps {params.s[steps]} --out {output.csv} 2> {log}"
        " && cp {log} {output.log}"
