"""Handout 1.2.1, 1.3.1 (a), 1.3.2 and 1.3.3 (workflow/rules/attention.smk): naive attention's time and
memory, compiled attention, and our FlashAttention-2 kernels (correctness, benchmark, resources,
leaderboard)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.analysis import attention_math
from cs336_systems.report import figures, tables
from cs336_systems.report.appendix import appendix, moved, outline
from cs336_systems.report.section import Context, Deliverable, Figure, Quotes, Section, Table, column_values
from cs336_systems.report.sections.flash_sweep import render_flash_sweep


def _memory_model(t: pd.DataFrame, d: int) -> tuple[float, float, float]:
    """From the 1.2.1 table at head dim d: P's MiB per seq² (the 'P saved' column over seq²) and the
    least-squares line (MiB per token, MiB) of the measured memory besides P against seq."""
    rows = t[t["d"] == d]
    besides = column_values(rows, "measured − P (MiB)")
    fitted = besides.notna()
    largest = rows.sort_values("seq").iloc[-1]
    per_token2 = column_values(rows.loc[[largest.name]], "P saved (MiB)").iloc[0] / largest["seq"] ** 2
    return (per_token2, *attention_math.remainder_line(rows.loc[fitted, "seq"], besides[fitted]))


# From this length on the seq² matrices dominate the memory of the sweep's points (P is 512 MiB at 4096, batch 8).
LONG_SEQ = 4096


def _added_squares(t: pd.DataFrame, d: int) -> pd.Series:
    """At head dim d and seq >= LONG_SEQ: (measured backward peak − memory before backward) / P, the number of
    seq²-sized matrices the backward holds at its peak besides what it started with."""
    rows = t[(t["d"] == d) & (t["seq"] >= LONG_SEQ)]
    added = column_values(rows, "measured backward peak (MiB)") - column_values(rows, "memory before backward (MiB)")
    return (added / column_values(rows, "P saved (MiB)")).dropna()


def _backward_squares(t: pd.DataFrame, d: int) -> int | None:
    """seq² matrices alive at the backward's peak, P included, as measured (None where no peak was measured)."""
    if "measured backward peak (MiB)" not in t:
        return None
    added = _added_squares(t, d)
    return None if added.empty else 1 + round(added.median())


def _memory_working(q: Quotes, table: pd.DataFrame, device: str) -> list[str]:
    """The memory of the largest measured point by tensor, and where an 80 GB H100 runs out (1.2.1)."""
    measured = table[column_values(table, "memory before backward (MiB)").notna()]
    if measured.empty:
        return []
    d = int(measured["d"].max())
    row = measured[measured["d"] == d].sort_values("seq").iloc[-1]

    def cell(header: str) -> str:
        return q.cell(header, row.name)

    working = (
        f"By tensor, at d={d} and seq={cell('seq')} (batch 8, float32, 4 bytes a number): autograd saves Q, K and "
        f"V, 3 × 8·seq·d·4 B = {cell('Q, K, V saved (MiB)')} MiB, and the softmax output P, 8·seq²·4 B = "
        f"{cell('P saved (MiB)')} MiB, for backward ({cell('predicted saved (MiB)')} MiB); the scores S are "
        f"freed as soon as P exists, and the forward's peak holds S and P together. The device held "
        f"{cell('memory before backward (MiB)')} MiB before backward: P and {cell('measured − P (MiB)')} MiB "
        f"besides (Q, K, V, the output O, the incoming gradient dO, the gradients left by earlier passes, "
        f"cuBLAS's workspace). Counting dP and dS, two more seq² matrices alive with P, the backward would peak at "
        f"{cell('memory before backward (MiB)')} + 2 × {cell('P saved (MiB)')} = "
        f"{cell('backward peak, + dP and dS (MiB)')} MiB")
    squares = _backward_squares(table, d)
    if squares is not None:
        fewest = q.derive(lambda t: _added_squares(t, d).min(), '.2f', 'seq² matrices the backward adds, fewest')
        most = q.derive(lambda t: _added_squares(t, d).max(), '.2f', 'seq² matrices the backward adds, most')
        added = fewest if fewest == most else f"{fewest}–{most}"
        working += (
            f"; measured: {cell('measured backward peak (MiB)')} MiB. At every length from {LONG_SEQ} on (d={d}) "
            f"the backward added {added} "
            f"seq² matrices to the memory it started with (measured peak − memory before backward, over P's size), "
            f"not 2: one seq² buffer beside dP and dS is alive at the backward's peak (which operation holds it is "
            f"not traced here; candidates are a temporary of the softmax backward and the gradient of the 1/√d "
            f"scaling, both seq²-sized). The model below counts the {squares} seq² matrices measured at the peak, "
            f"P included.")
    else:
        squares = 3  # P, dP and dS
        working += (" (predicted; the measured peak is pending: rerun "
                    "`snakemake results/attention.csv --cores all --resources gpu=1 --forcerun attention_timing`).")

    def fit(column: int):
        return lambda t: _memory_model(t, d)[column]

    def threshold(t: pd.DataFrame, dim: int = d) -> float:
        return attention_math.oom_seq_len(*_memory_model(t, dim), squares=squares)

    smallest = int(measured["d"].min())

    def doubled(t: pd.DataFrame, dim: int = smallest) -> float:
        return attention_math.peak_mib(*_memory_model(t, dim), seq=2 * int(t["seq"].max()), squares=squares) / 1024

    def doubled_p(t: pd.DataFrame) -> float:
        return _memory_model(t, smallest)[0] * (2 * int(t["seq"].max())) ** 2 / 1024

    extrapolation = (
        f"Where it runs out of memory on an 80 GB H100 (this sweep ran on the {device}): at d={d} the memory "
        f"besides P is a line in seq, {q.derive(fit(2), '.0f', 'fixed memory besides P (MiB)')} MiB + "
        f"{q.derive(lambda t: fit(1)(t) * 1024, '.0f', 'MiB besides P per 1024 tokens')} MiB per 1024 tokens "
        f"(least squares over the table's 'measured − P' column), and each seq² matrix is P's size, 8·seq²·4 B. "
        f"The backward runs out when {squares} seq² matrices and the line exceed 80 GiB (81920 MiB): solving the "
        f"quadratic gives seq ≈ {q.derive(threshold, ',.0f', 'sequence length that fills 80 GiB')} "
        f"(d={smallest}: {q.derive(lambda t: threshold(t, smallest), ',.0f', 'same at the smallest d')}; "
        f"the seq² terms dominate, so d hardly matters). Every length of the sweep therefore fits on an 80 GB "
        f"H100. Were the grid to keep doubling, the smallest configuration to run out would be "
        f"d={smallest}, seq {q.derive(lambda t: 2 * t['seq'].max(), 'd', 'the next doubling')}: there P alone "
        f"is {q.derive(doubled_p, '.0f', 'GiB of P at the next doubling')} GiB, and {squares} such matrices with the line "
        f"need {q.derive(doubled, '.1f', 'GiB at the next doubling')} GiB "
        f"({q.derive(lambda t: doubled(t, d), '.1f', 'GiB at the next doubling, largest d')} GiB at d={d}).")
    return [working, extrapolation]


def render_attention(ctx: Context) -> Section:
    frame = ctx.frame("attention")
    eager = frame[(frame["impl"] == "eager") & (frame["phase"] == "forward")]
    ooms = eager[eager["status"] == "oom"].sort_values(["seq_len", "head_dim"])
    parts = []
    if ooms.empty:
        parts.append(f"No configuration of the grid ran out of memory on the {eager['device_name'].iloc[0]}.")
    else:
        first = ooms.iloc[0]
        square = first["square_matrix_bytes"] / 2**30
        parts.append(
            f"The smallest configuration that runs out of memory is d={first['head_dim']}, "
            f"seq={first['seq_len']}. By the formulas (batch {first['batch']}, float32), each "
            f"(batch, seq, seq) matrix takes {square:.1f} GiB: autograd keeps Q, K, V and the softmax output P "
            f"for backward ({first['saved_for_backward_bytes'] / 2**30:.1f} GiB), the forward peaks with S and P "
            f"alive together ({first['forward_peak_bytes'] / 2**30:.1f} GiB) and the backward with P, dP and dS "
            f"({first['backward_peak_bytes'] / 2**30:.1f} GiB).")
    q = Quotes(ctx.numeric("attention"))
    table = q.frame
    memory = column_values(table, "memory before backward (MiB)")
    measured = table[memory.notna() & (memory > 0)]  # measured on CUDA only
    checked = []  # the out-of-memory paragraph above quotes the formulas' bytes, which the table does not show
    if len(measured):
        largest = measured.sort_values("seq").iloc[-1]
        smaller = measured[(measured["d"] == largest["d"]) & (measured["seq"] < largest["seq"])]
        if len(smaller):
            prev = smaller.sort_values("seq").iloc[-1]
            rows = [prev.name, largest.name]

            def growth(t: pd.DataFrame) -> float:
                before, after = column_values(t.loc[rows], "memory before backward (MiB)")
                return after / before

            def longer(t: pd.DataFrame) -> float:
                before, after = t.loc[rows, "seq"]
                return after / before

            factor = q.derive(longer, ".0f", "growth of the sequence length")
            memory_of = lambda row: q.cell("memory before backward (MiB)", row.name)  # noqa: E731
            checked.append(
                f"Memory saved for backward grows quadratically: from seq {q.cell('seq', prev.name)} to "
                f"{q.cell('seq', largest.name)} (×{factor}) the memory in use before backward grows "
                f"×{q.derive(growth, '.1f', 'growth of memory before backward')} "
                f"({memory_of(prev)} → {memory_of(largest)} MiB at d={q.cell('d', largest.name)}), while the inputs "
                f"grow only ×{factor}.")
        checked += _memory_working(q, measured, eager['device_name'].iloc[0])
    else:
        checked.append("The memory columns are measured on a GPU only (pending: `snakemake results/attention.csv "
                       "--cores all --resources gpu=1`); the formulas' columns stand alone.")
    parts += checked
    parts.append(
        "The seq² term disappears if the softmax matrix is never stored: FlashAttention-2 computes attention "
        "tile by tile with an online softmax, keeps only the per-row logsumexp L (seq floats) for backward "
        "and recomputes P from Q, K and L there, trading a second pass of matrix products for O(seq) memory.")
    # the sentences' constants: 1/√d, 3 tensors, batch 8, 4 bytes, 2 matrices, 80 GiB, MiB per 1024 tokens
    return Section([*parts, appendix("pytorch_attention: every head dim and length", ctx.table("attention")),
                    ctx.figure("attention_memory", "attention memory")], q.table,
                   checked, q.derived, wording=("1", "3", "8", "4", "2", "80", "81920", "1024"))


def render_attention_compile(ctx: Context) -> Section:
    frame = ctx.frame("attention")
    q = Quotes(ctx.numeric("attention_compile"))

    def speedup(phase: str):
        def ratios(t: pd.DataFrame) -> pd.Series:
            return (column_values(t, f"{phase} eager (ms)") / column_values(t, f"{phase} compiled (ms)")).dropna()
        return ratios

    fwd, bwd = speedup("forward"), speedup("backward")
    oom = frame[frame["status"] == "oom"].groupby("impl")[["head_dim", "seq_len"]].apply(
        lambda g: set(map(tuple, g.values)))
    text = (f"Speed-up of torch.compile over eager (eager time ÷ compiled time): forward "
            f"{q.derive(lambda t: fwd(t).min(), '.2f', 'least forward speed-up')}–"
            f"{q.derive(lambda t: fwd(t).max(), '.2f', 'largest forward speed-up')}× "
            f"(median {q.derive(lambda t: fwd(t).median(), '.2f', 'median forward speed-up')}×), backward "
            f"{q.derive(lambda t: bwd(t).min(), '.2f', 'least backward speed-up')}–"
            f"{q.derive(lambda t: bwd(t).max(), '.2f', 'largest backward speed-up')}× "
            f"(median {q.derive(lambda t: bwd(t).median(), '.2f', 'median backward speed-up')}×). The compiler fuses "
            f"the scaling, the softmax and its gradient into generated kernels; the matrix products stay cuBLAS calls "
            f"and the seq² matrices are still stored.")
    if len(oom):
        same = oom.get("eager", set()) == oom.get("compiled", set())
        text += (" The same configurations run out of memory with and without compilation." if same else
                 f" Out of memory: eager {sorted(oom.get('eager', set()))}, compiled {sorted(oom.get('compiled', set()))}.")
    return Section([text, ctx.table("attention_compile")], q.table, [text], q.derived)


def render_flash_correctness(ctx: Context) -> Section:
    frame = ctx.frame("flash_correctness")
    q = Quotes(ctx.numeric("flash_correctness"))
    table = q.frame
    skipped = table.loc[table["skipped"] == table["runs"], "test"]
    count = q.derive(lambda t: (t["skipped"] == t["runs"]).sum(), "d", "tests skipped")
    aside = f" ({count} skipped: {', '.join(skipped)})" if len(skipped) else ""
    repeats = int(table["runs"].max())
    fresh = (f" in each of their {q.derive(lambda t: t['runs'].max(), 'd', 'runs per test')} runs, every run on "
             f"fresh random inputs" if repeats > 1 else " in one run each")
    text = (f"{q.derive(lambda t: (t['passed'] == t['runs']).sum(), 'd', 'tests passed every run')} of "
            f"{q.derive(len, 'd', 'tests')} tests of `tests/test_flash.py` passed{fresh}{aside} on "
            f"{frame['device_name'].iloc[0]} ({q.derive(lambda t: t['passed'].sum(), 'd', 'runs passed')} of "
            f"{q.derive(lambda t: t['runs'].sum(), 'd', 'runs')} runs passed): "
            "O, L, dQ, dK and dV of both implementations against a float64 reference, causal and not, lengths "
            "from 1 to 100 (up to 1000 on a GPU) and rectangular cases, with and without a heads dimension, float32 "
            "(relative error < 1e-4) and 16-bit (error within 2× of PyTorch's own attention in the same dtype; "
            "bfloat16 on a GPU only).")
    if not table["test"].str.contains("cpu").any() and "cpu" not in frame["device_name"].iloc[0]:
        text += " The CPU-device cases of the file run in the test suite instead, on every push."
    if repeats == 1:
        text += (" Pending: the repeated runs on fresh inputs, `snakemake results/flash_correctness.csv "
                 "results/flash_accuracy.csv --cores all --resources gpu=1 --forcerun flash_correctness`.")
    # what the test file covers is its own wording, not results
    table = moved(ctx, "flash_correctness", "flash_forward / flash_backward: every configuration checked")
    return Section([text, *table], q.table, [text], q.derived,
                   wording=("1", "100", "1000", "1e-4", "16", "2"))


def render_flash_accuracy(ctx: Context) -> Section:
    frame = ctx.frame("flash_accuracy")
    q = Quotes(ctx.numeric("flash_accuracy"))
    table = q.frame
    ratio = lambda t: column_values(t, "ours ÷ SDPA")  # noqa: E731
    backends = ", ".join(sorted(set(table["SDPA backend"])))
    factor, slack = frame["allowed_factor"].iloc[0], frame["allowed_slack"].iloc[0]  # the check's own limits
    text = (f"bfloat16 against float64, beside PyTorch's SDPA ({backends} backend) on the same inputs: our error "
            f"is {q.derive(lambda t: ratio(t).min(), '.2f', 'least ratio')}–"
            f"{q.derive(lambda t: ratio(t).max(), '.2f', 'largest ratio')}× SDPA's (median "
            f"{q.derive(lambda t: ratio(t).median(), '.2f', 'median ratio')}×) over every implementation, case and "
            f"output; the worst, {q.derive(lambda t: t['ours'].max(), '.2e', 'largest error')}, "
            f"against SDPA's worst {q.derive(lambda t: t['SDPA'].max(), '.2e', 'largest SDPA error')}. "
            f"The check fails where ours exceeds {factor:g}× SDPA's plus {slack:g} (averaged over seeds); it passed. "
            "Relative error is ‖x − x₆₄‖ / ‖x₆₄‖, x₆₄ from float64 autograd through naive attention on the same "
            "bfloat16-rounded inputs, so only the computation's rounding counts. Where the backend is math (CPU), "
            "SDPA computes in float32 internally and rounds once at the end, a stricter bar than a bfloat16 "
            "FlashAttention kernel, which also uses the bfloat16 output O in the backward's rowsum(dO ∘ O).")
    if "flash_triton" not in set(table["implementation"]):
        text += " Our Triton kernels are not in these rows: on the CPU they run in Triton's interpreter, which "
        text += "cannot multiply bfloat16 (GPU rows: `snakemake results/flash_accuracy.csv --cores all --resources gpu=1`)."
    table = moved(ctx, "flash_accuracy", "flash accuracy: every bfloat16 error against SDPA's",
                  ("implementation", "SDPA backend", "causal", "tensor"))
    return Section([text, *table], q.table, [text], q.derived,
                   wording=("64", f"{factor:g}", f"{slack:g}", "16"))


def _fitting(rows: pd.DataFrame, limit: int = 232448) -> str:
    """Which d=128 tiles fit in the H100's shared memory (227 KiB per block), per kernel."""
    d128 = rows[rows["head_dim"] == 128]
    return "; ".join(
        f"{kernel} " + ", ".join(f"{r.outer}×{r.inner}/{r.warps}w/{r.stages}s" for r in group.itertuples()
                                 if r.shared_bytes <= limit)
        for kernel, group in d128.groupby("kernel", sort=False)) or "none measured"


def _spill_counts(table: pd.DataFrame, case: str) -> tuple[int, int]:
    """(configs that spill, configs compiled) over the resources table's columns of one case: 'bf16',
    'fp32 ieee', 'fp32 tf32x3' (each column is '<case> d=<head dim>', the registers, beside '<column> spilled
    (B)'; a config not compiled, or in error, has no registers)."""
    columns = [c for c in table.columns if c.rsplit(" d=", 1)[0] == case and c.rsplit(" d=", 1)[-1].isdigit()]
    compiled = [table.loc[table[c].notna(), f"{c} spilled (B)"] for c in columns]
    return int(sum((spilled > 0).sum() for spilled in compiled)), int(sum(len(spilled) for spilled in compiled))


def render_flash_resources(ctx: Context) -> Section:
    frame = ctx.frame("flash_resources")
    q = Quotes(ctx.numeric("flash_resources"))
    ok = frame[frame["status"] == "ok"]
    version = frame["triton_version"].iloc[0]
    intro = (f"Each kernel compiled by Triton {version} for {frame['arch'].iloc[0]} (H100 "
             f"and H200) on a machine without a GPU; `ptxas -v` reports the registers per thread and the bytes a "
             f"thread spills to local memory, which lives in DRAM behind the L1 cache. "
             f"`python -m cs336_systems.bench.kernel_resources` compiles any other tile the same way.")
    checked = []

    def counted(case: str, which: int):
        return lambda t: _spill_counts(t, case)[which]

    for (dtype, dot), rows in ok.groupby(["dtype", ok.get("dot", pd.Series("", index=ok.index))], sort=False):
        spilled = rows[rows["spill_store_bytes"] > 0]
        case = f"{dtype} {dot}" if dtype == "fp32" and isinstance(dot, str) and dot else dtype
        label = f"{dtype} ({dot} dots)" if case != dtype else dtype
        text = (f"{label}: {q.derive(counted(case, 0), 'd', f'{case} configs that spill')} of "
                f"{q.derive(counted(case, 1), 'd', f'{case} configs')} compiled configs spill")
        if len(spilled):
            worst = spilled.sort_values("spill_store_bytes").iloc[-1]
            clean_dims = sorted(set(rows["head_dim"]) - set(spilled["head_dim"]))
            text += (f", the most {worst['spill_store_bytes']:,} B per thread ({worst['kernel']}, "
                     f"{worst['outer']}×{worst['inner']} with {worst['warps']} warps, d={worst['head_dim']})")
            if clean_dims:
                text += f"; none at d = {', '.join(map(str, clean_dims))}"
        checked.append(text + ".")
    if "dot" in ok and {"ieee", "tf32x3"} <= set(ok["dot"]):
        fp32 = ok[ok["dtype"] == "fp32"]
        spills = fp32.groupby("dot")["spill_store_bytes"]
        checked.append(
            f"Float32 with IEEE dots (FMAs on the CUDA cores, operands held in registers): "
            f"{q.derive(counted('fp32 ieee', 0), 'd', 'ieee configs that spill')} of "
            f"{q.derive(counted('fp32 ieee', 1), 'd', 'ieee configs')} configs spill, up to "
            f"{spills.get_group('ieee').max():,} B per thread. With tf32x3 dots (three TF32 tensor-core products "
            f"per dot, the kernels' float32 path now): "
            f"{q.derive(counted('fp32 tf32x3', 0), 'd', 'tf32x3 configs that spill')} of "
            f"{q.derive(counted('fp32 tf32x3', 1), 'd', 'tf32x3 configs')}, up to "
            f"{spills.get_group('tf32x3').max():,} B. tf32x3 stages "
            f"float32 operands in shared memory instead, so at d=128 only these float32 configs fit in the "
            f"H100's 227 KiB per block (the 2-stage ones are the float32-only tiles): "
            f"{_fitting(fp32[fp32['dot'] == 'tf32x3'])}.")
    errors = frame[frame["status"] != "ok"]
    if len(errors):
        def in_error(t: pd.DataFrame) -> int:  # cells whose status is 'error' (printed ERROR)
            return int(sum((t[c] == "error").sum() for c in t.columns if c.endswith(": status")))

        checked.append(f"{q.derive(in_error, 'd', 'configs in error')} "
                       "configs did not compile (rows with status=error).")
    # the Triton version and the shared memory per block belong to the sentence, not to the table
    moved = appendix("registers / spilled bytes per thread of every kernel and tile", ctx.table("flash_resources"))
    return Section([intro, *checked, f"_The table of registers / spilled bytes per thread has "
                    f"{outline(q.table, ['kernel'])}, one column per dtype and head dim._", moved],
                   q.table, checked, q.derived,
                   wording=("227", "2", "3", str(version)))


def render_leaderboard(ctx: Context) -> Section:
    q = Quotes(ctx.numeric("flash_leaderboard"))
    providers = set(q.frame.loc[q.frame["pass"] == "forward_backward", "provider"])

    def cell(header: str, provider: str) -> str:
        return q.cell(header, **{"pass": "forward_backward", "provider": provider})

    checked = []
    if "flash_triton" in providers:
        text = f"Forward+backward of our Triton kernel: {cell('mean (ms)', 'flash_triton')} ms"
        if "sdpa_flash" in providers:
            text += f", {cell('÷ SDPA flash', 'flash_triton')}× SDPA flash ({cell('mean (ms)', 'sdpa_flash')} ms)"
        if "sdpa_cudnn" in providers:
            def versus_cudnn(t: pd.DataFrame) -> float:
                ms = t[t["pass"] == "forward_backward"].set_index("provider")["mean (ms)"]
                return ms["flash_triton"] / ms["sdpa_cudnn"]
            text += (f" and {q.derive(versus_cudnn, '.2f', 'ours over SDPA cuDNN')}× SDPA cuDNN "
                     f"({cell('mean (ms)', 'sdpa_cudnn')} ms)")
        checked.append(text + ", all timed in the same run as the handout's test times them.")
    return Section([*checked, ctx.table("flash_leaderboard")], q.table, checked, q.derived)


DELIVERABLES = [
    Deliverable("1.2.1 pytorch_attention: attention timings and memory", "attention_timing", render_attention,
                ("attention",),
                tables=(Table("attention", "attention", tables.attention,
                              "Naive attention (batch 8, one head, float32): mean ms over 100 passes"),),
                figures=(Figure("attention_memory", "attention", figures.attention_memory),)),
    Deliverable("1.3.1 (a) torch_compile: compiled versus vanilla attention", "attention_timing",
                render_attention_compile, ("attention",),
                tables=(Table("attention_compile", "attention", tables.attention_compile,
                              "Naive attention, eager versus torch.compile (mean ms over 100 passes)"),)),
    Deliverable("1.3.2 flash_forward / flash_backward: correctness", "flash_correctness", render_flash_correctness,
                ("flash_correctness",),
                tables=(Table("flash_correctness", "flash_correctness", tables.flash_correctness,
                              "FlashAttention-2 tests (tests/test_flash.py) run on the device: runs passed, "
                              "each repeat on fresh random inputs"),)),
    Deliverable("1.3.2 flash accuracy: bfloat16 errors against SDPA's", "flash_correctness",
                render_flash_accuracy, ("flash_accuracy",),
                tables=(Table("flash_accuracy", "flash_accuracy", tables.flash_accuracy,
                              "bfloat16 relative error against float64 (mean over seeds): ours and PyTorch SDPA's "
                              "on the same inputs (cs336_systems/bench/flash_accuracy.py)"),)),
    Deliverable("1.3.2 (e) flash_benchmarking", "flash_benchmark", render_flash_sweep, ("flash_sweep",),
                tables=(Table("flash_sweep", "flash_sweep", tables.flash_sweep,
                              "FlashAttention-2 benchmark, batch 1, causal: median ms (triton.testing.do_bench)"),),
                figures=(Figure("flash_latency", "flash_sweep", figures.flash_latency),
                         Figure("flash_tflops", "flash_sweep", figures.flash_tflops))),
    Deliverable("1.3.2 (e), continued: registers and spills of our kernels per tile", "flash_resources",
                render_flash_resources, ("flash_resources",),
                tables=(Table("flash_resources", "flash_resources", tables.flash_resources,
                              "Our FA2 Triton kernels compiled for the GPU: registers / bytes spilled per thread "
                              "(ptxas -v), causal, each tile the autotuner may pick for that dtype (— : not tried, "
                              "e.g. deep pipelines for fp32)"),)),
    Deliverable("1.3.3 leaderboard case", "flash_leaderboard", render_leaderboard, ("flash_leaderboard",),
                tables=(Table("flash_leaderboard", "flash_leaderboard", tables.flash_leaderboard,
                              "Leaderboard case: 16 heads x 16384 x 64, bf16, causal"),)),
]
