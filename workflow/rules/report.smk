# Tables (Markdown + LaTeX), figures (PNG) and the writeup, all computed from results files.

TABLE_INPUTS = {
    "e2e_timing": f"{R}/e2e.csv",
    "e2e_warmup": f"{R}/e2e_warmup.csv",
    "mixed_precision": f"{R}/e2e.csv",
    "compile_timing": f"{R}/e2e_compile.csv",
    "optimizer": f"{R}/optimizer.csv",
    "attention": f"{R}/attention.csv",
    "attention_compile": f"{R}/attention.csv",
    "flash_sweep": f"{R}/flash_sweep.csv",
    "flash_leaderboard": f"{R}/flash_leaderboard.csv",
    "flash_resources": f"{R}/flash_resources.csv",
    "flash_correctness": f"{R}/flash_correctness.csv",
    "profile_kernels": f"{R}/profile.csv",
    "profile_grid": f"{R}/profile.csv",
    "allreduce": f"{R}/allreduce.csv",
    "ddp_naive": f"{R}/ddp_naive.csv",
    "ddp_individual": f"{R}/ddp_individual.csv",
    "ddp_bucketed": f"{R}/ddp_bucketed.csv",
    "sharding": f"{R}/sharding.csv",
    "train_matrix": f"{R}/train_matrix.csv",
}
FIGURE_INPUTS = {
    "e2e_timing": f"{R}/e2e.csv",
    "e2e_warmup": f"{R}/e2e_warmup.csv",
    "compile_timing": f"{R}/e2e_compile.csv",
    "attention_memory": f"{R}/attention.csv",
    "flash_latency": f"{R}/flash_sweep.csv",
    "flash_tflops": f"{R}/flash_sweep.csv",
    "allreduce": f"{R}/allreduce.csv",
    "ddp_bucketed": f"{R}/ddp_bucketed.csv",
    "train_matrix": f"{R}/train_matrix.csv",
}


rule table:
    input:
        lambda wc: TABLE_INPUTS[wc.name],
    output:
        md=f"{R}/tables/{{name}}.md",
        tex=f"{R}/tables/{{name}}.tex",
    log:
        f"{LOGS}/tables/{{name}}.log",
    wildcard_constraints:
        name="|".join(TABLE_INPUTS),
    conda:
        ENV
    shell:
        "python -m cs336_systems.report table {wildcards.name} {input}"
        " --md {output.md} --tex {output.tex} 2> {log}"


rule figure:
    input:
        lambda wc: FIGURE_INPUTS[wc.name],
    output:
        f"{F}/{{name}}.png",
    log:
        f"{LOGS}/figures/{{name}}.log",
    wildcard_constraints:
        name="|".join(FIGURE_INPUTS),
    conda:
        ENV
    shell:
        "python -m cs336_systems.report figure {wildcards.name} {input} --out {output} 2> {log}"


rule writeup_md:
    input:
        tables=expand(f"{R}/tables/{{name}}.md", name=available(TABLE_INPUTS)),
        figures=expand(f"{F}/{{name}}.png", name=available(FIGURE_INPUTS)),
        anchors="config.yaml",
        accounting=f"{R}/communication_accounting.md",
        mixed_precision=wanted(f"{R}/mixed_precision.csv"),
        overlap=wanted(f"{R}/ddp_overlap.csv"),
        memory=(
            wanted(f"{R}/memory.csv", f"{R}/memory_allocations.csv")
            if S["memory"]["enabled"]
            else []
        ),
    output:
        f"{R}/writeup.md",
    log:
        f"{LOGS}/writeup.log",
    conda:
        ENV
    params:
        results=lambda wc, output: os.path.dirname(output[0]),
        figures=lambda wc, input: (
            os.path.dirname(input.figures[0]) if input.figures else F
        ),
        scale=SCALE,
        device=S["device"],
    shell:
        "python -m cs336_systems.report.writeup --results {params.results} --figures {params.figures}"
        " --scale {params.scale} --device {params.device} --anchors {input.anchors} --out {output} 2> {log}"


rule writeup_html:
    input:
        f"{R}/writeup.md",
    output:
        f"{R}/writeup.html",
    log:
        f"{LOGS}/writeup_html.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.html {input} --out {output} 2> {log}"


rule communication_accounting:
    output:
        f"{R}/communication_accounting.md",
    log:
        f"{LOGS}/communication_accounting.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.accounting --out {output} > {log} 2>&1"
