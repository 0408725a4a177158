# Tables (Markdown + LaTeX), figures (PNG) and the writeup, all computed from results files.

from cs336_systems.report.sections import (
    figure_extra_inputs,
    figure_inputs,
    table_inputs,
)
from cs336_systems.report.submission import submission_files

# Which tables and figures exist, and the results file each is made from, is the deliverable registry's
# (cs336_systems/report/sections): a section adds its own there.
TABLE_INPUTS = table_inputs(R)
FIGURE_INPUTS = figure_inputs(R)
# Further results a figure draws beside its own data, where they exist (Figure.also).
FIGURE_EXTRA_INPUTS = figure_extra_inputs(R)
# Tables whose data this scale's rules do not make (the first-call times need a GPU and a fresh process).
NOT_MADE_HERE = [] if S["flash_llm_shapes"]["first_call"] else ["flash_first_call"]


rule table:
    input:
        lambda wc: TABLE_INPUTS[wc.name],
    output:
        md=update(f"{R}/tables/{{name}}.md"),
        tex=update(f"{R}/tables/{{name}}.tex"),
        # the numeric frame the Markdown prints: the writeup quotes its cells (one build per table)
        json=update(f"{R}/tables/{{name}}.json"),
        log=update(f"{LOGS}/tables/{{name}}.log"),
    log:
        f"{ATTEMPTS}/tables/{{name}}.log",
    wildcard_constraints:
        name="|".join(TABLE_INPUTS),
    conda:
        ENV
    shell:
        "python -m cs336_systems.report table {wildcards.name} {input}"
        " --md {output.md} --tex {output.tex} --json {output.json} 2> {log}"
        " && cp {log} {output.log}"


rule figure:
    input:
        lambda wc: [FIGURE_INPUTS[wc.name], *wanted(*FIGURE_EXTRA_INPUTS[wc.name])],
    output:
        png=update(f"{F}/{{name}}.png"),
        log=update(f"{LOGS}/figures/{{name}}.log"),
    log:
        f"{ATTEMPTS}/figures/{{name}}.log",
    wildcard_constraints:
        name="|".join(FIGURE_INPUTS),
    conda:
        ENV
    shell:
        "python -m cs336_systems.report figure {wildcards.name} {input} --out {output.png} 2> {log}"
        " && cp {log} {output.log}"


rule writeup_md:
    input:
        tables=expand(
            f"{R}/tables/{{name}}.{{ext}}",
            ext=["md", "json"],
            name=[n for n in available(TABLE_INPUTS) if n not in NOT_MADE_HERE],
        ),
        figures=expand(f"{F}/{{name}}.png", name=available(FIGURE_INPUTS)),
        accounting=f"{R}/communication_accounting.md",
        mixed_precision=wanted(f"{R}/mixed_precision.csv"),
        overlap=wanted(f"{R}/ddp_overlap.csv"),
        spread=wanted(f"{R}/ddp_spread.csv"),
        fsdp_overlap=wanted(f"{R}/fsdp_overlap.csv"),
        memory=(
            wanted(f"{R}/memory.csv", f"{R}/memory_allocations.csv")
            if S["memory"]["enabled"]
            else []
        ),
    output:
        md=update(f"{R}/writeup.md"),
        log=update(f"{LOGS}/writeup.log"),
    log:
        f"{ATTEMPTS}/writeup.log",
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
        " --scale {params.scale} --device {params.device} --out {output.md} 2> {log}"
        " && cp {log} {output.log}"


rule writeup_html:
    input:
        f"{R}/writeup.md",
    output:
        html=update(f"{R}/writeup.html"),
        log=update(f"{LOGS}/writeup_html.log"),
    log:
        f"{ATTEMPTS}/writeup_html.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.html {input} --out {output.html} 2> {log}"
        " && cp {log} {output.log}"


# The PDF a student hands in, typeset from the same Markdown by the typst package (report/typst.py), figures and all.
rule writeup_pdf:
    input:
        md=f"{R}/writeup.md",
        figures=expand(f"{F}/{{name}}.png", name=available(FIGURE_INPUTS)),
    output:
        pdf=update(f"{R}/writeup.pdf"),
        log=update(f"{LOGS}/writeup_pdf.log"),
    log:
        f"{ATTEMPTS}/writeup_pdf.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.typst {input.md} --out {output.pdf} 2> {log}"
        " && cp {log} {output.log}"


# The code half of the submission (the handout's code.zip): the package, tests, workflow and config, no results.
rule code_zip:
    input:
        submission_files("."),
    output:
        zip=update(f"{R}/code.zip"),
        log=update(f"{LOGS}/code_zip.log"),
    log:
        f"{ATTEMPTS}/code_zip.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.submission --out {output.zip} > {log} 2>&1"
        " && cp {log} {output.log}"


rule communication_accounting:
    output:
        md=update(f"{R}/communication_accounting.md"),
        log=update(f"{LOGS}/communication_accounting.log"),
    log:
        f"{ATTEMPTS}/communication_accounting.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.report.accounting --out {output.md} > {log} 2>&1"
        " && cp {log} {output.log}"
