"""1.3.2 (e)'s prose: how our FlashAttention-2 compares with naive attention and SDPA over the
benchmark grid, and how its TFLOP/s are counted. Every number is a cell of the flash table
(tables.flash_sweep, read back from results/tables/flash_sweep.json) or a formula over its numbers. Kept apart from sections/attention.py, which registers it,
for length."""

from __future__ import annotations

import pandas as pd

from cs336_systems.analysis import attention_math
from cs336_systems.report.appendix import appendix, appendix_parts, outline, rows_of, statistic
from cs336_systems.report.section import Context, Quotes, Section, column_values

OURS_VS_SDPA = "ours ÷ SDPA flash"


def _rows(t: pd.DataFrame, pass_: str = "forward_backward", **where) -> pd.DataFrame:
    """The flash table's rows of one pass (and dtype=..., etc. if given)."""
    chosen = t[t["pass"] == pass_]
    for column, value in where.items():
        chosen = chosen[chosen[column] == value]
    return chosen


def _ratio(t: pd.DataFrame, numerator: str, denominator: str, **where) -> pd.Series:
    """numerator ms ÷ denominator ms over forward+backward rows where both ran (printed cells)."""
    rows = _rows(t, **where)
    return (column_values(rows, numerator) / column_values(rows, denominator)).dropna()


def _sdpa_dtypes(t: pd.DataFrame) -> list[str]:
    """The dtypes in which SDPA's flash backend ran (16-bit only): those of the rows with a ratio against it."""
    rows = _rows(t)
    return sorted(set(rows.loc[column_values(rows, OURS_VS_SDPA).notna(), "dtype"]))


def _crossover(t: pd.DataFrame) -> float:
    """The shortest length from which ours is faster than SDPA flash at every longer length and head dim
    (NaN if none)."""
    rows = _rows(t)
    ratio = column_values(rows, OURS_VS_SDPA)
    seqs = rows.loc[ratio.notna(), "seq"]
    ratio = ratio.dropna()
    behind = seqs[ratio >= 1]
    later = seqs[seqs > behind.max()] if len(behind) else seqs
    return later.min() if len(later) else float("nan")


def render_flash_sweep(ctx: Context) -> Section:
    frame = ctx.frame("flash_sweep")
    q = Quotes(ctx.numeric("flash_sweep"))
    table = q.frame  # the table's numbers: what every formula below reads
    providers = set(frame["provider"])
    checked = []
    if {"flash_triton", "naive"} <= providers:
        def oom(provider: str):
            def count(t: pd.DataFrame) -> int:
                status = f"{provider}: status"
                return int((_rows(t)[status] == "oom").sum()) if status in t else 0
            return count

        naive = lambda t: _ratio(t, "naive", "flash_triton")  # noqa: E731
        checked.append(
            f"Naive PyTorch attention takes {q.derive(lambda t: naive(t).min(), '.3g', 'least naive over ours')}–"
            f"{q.derive(lambda t: naive(t).max(), '.3g', 'largest naive over ours')}× the time of our Triton "
            f"FlashAttention-2 (forward+backward) where both run; naive attention runs out of memory at "
            f"{q.derive(oom('naive'), 'd', 'naive OOM cases')} of the grid's cases, ours at "
            f"{q.derive(oom('flash_triton'), 'd', 'our OOM cases')}.")
    if {"flash_triton", "sdpa_flash"} <= providers:
        ratio = lambda t: column_values(_rows(t), OURS_VS_SDPA).dropna()  # noqa: E731
        text = (f"Against PyTorch SDPA's flash backend (16-bit only) ours takes "
                f"{q.derive(lambda t: ratio(t).min(), '.2f', 'least ours over SDPA flash')}–"
                f"{q.derive(lambda t: ratio(t).max(), '.2f', 'largest ours over SDPA flash')}× its time (median "
                f"{q.derive(lambda t: ratio(t).median(), '.2f', 'median ours over SDPA flash')}×; the table's "
                f"'{OURS_VS_SDPA}', forward+backward) and is faster in "
                f"{q.derive(lambda t: (ratio(t) < 1).sum(), 'd', 'cases ours is faster')} of "
                f"{q.derive(lambda t: len(ratio(t)), 'd', 'cases with both')} cases.")
        crossover = _crossover(table)
        if crossover == crossover:  # not NaN: some length from which ours always wins
            def long(t: pd.DataFrame) -> float:
                rows = _rows(t)
                return column_values(rows[rows["seq"] >= _crossover(t)], OURS_VS_SDPA).median()

            def short(t: pd.DataFrame) -> pd.Series:
                rows = _rows(t)
                return column_values(rows[rows["seq"] < _crossover(t)], OURS_VS_SDPA).dropna()

            def short_backward(t: pd.DataFrame) -> float:  # in the dtypes SDPA flash ran: this paragraph's
                rows = _rows(t, "backward")
                rows = rows[rows["dtype"].isin(_sdpa_dtypes(t)) & (rows["seq"] <= 1024)]
                return column_values(rows, "flash_triton").median()

            text += (f" From {crossover} tokens on ours is faster at every head dim (median "
                     f"{q.derive(long, '.2f', 'median ratio past the crossover')}× SDPA flash's time). Below "
                     f"that, with batch 1 and one head, both are bound by fixed per-call costs, and ours is faster "
                     f"in {q.derive(lambda t: (short(t) < 1).sum(), 'd', 'short cases ours is faster')} of "
                     f"{q.derive(lambda t: len(short(t)), 'd', 'short cases with both')}: at ≤ 1024 tokens our "
                     f"{'/'.join(_sdpa_dtypes(table))} backward alone takes a median "
                     f"{q.derive(short_backward, '.3f', 'our short backward in the dtypes SDPA flash ran (ms)')} ms "
                     f"(three kernel launches from Python, where SDPA makes one call from C++).")
        else:
            text += " Ours is not faster at every head dim at any length of the grid."
        checked.append(text)
    checked += _flash_float32(q, frame, table)
    checked.append(_flash_coverage(ctx, frame))
    flops = [text for text in [_flop_convention(q, table)] if text]  # how TFLOP/s are counted: for the appendix
    checked = [text for text in checked if text]
    return Section([*checked, ctx.figure("flash_latency", "latency"), ctx.figure("flash_tflops", "TFLOP/s"),
                    *(appendix_parts("flash_benchmarking: how TFLOP/s are counted", flops) if flops else ()),
                    *_sweep_summary(q.table, statistic(ctx.table("flash_sweep"))),
                    appendix("flash_benchmarking: every point of the sweep", ctx.table("flash_sweep"))],
                   q.table, [*checked, *flops], q.derived,
                   wording=("16", "2", "4", "2.5", "5", "7", "3.5", "4.1", "1"))


def _sweep_summary(table, what: str) -> list[str]:
    """The body's part of the sweep: the largest head dim at the longest sequence."""
    longest = lambda t: (t["d"] == t["d"].max()) & (t["seq"] == t["seq"].max())  # noqa: E731
    return [rows_of(table, longest).to_markdown(),
            f"_{what}: the sweep's rows at the largest head dim and the longest sequence; the full table has "
            f"{outline(table, ['dtype', 'd', 'seq', 'pass'])}._"]


def _flash_float32(q: Quotes, frame: pd.DataFrame, table: pd.DataFrame) -> list[str]:
    """How ours does where PyTorch's fused backends do not run (float32), and its backward over forward,
    from 8192 tokens on."""
    text = []
    long = lambda t: t[t["seq"] >= 8192]  # noqa: E731
    fp32 = long(_rows(table, dtype="fp32"))
    if len(fp32) and {"flash_triton", "naive"} <= set(table.columns):
        naive = lambda t: _ratio(long(t), "naive", "flash_triton", dtype="fp32")  # noqa: E731
        if len(naive(table)):
            ours = frame[(frame["dtype"] == "fp32") & (frame["provider"] == "flash_triton")]
            commits = ", ".join(f"`{c}`" for c in sorted(ours["git_commit"].str[:7].unique()))
            dots = ", ".join(sorted(ours["float32_dot"].dropna().unique())) if "float32_dot" in ours else ""
            text.append(f"In float32 (our kernels at {commits}" + (f", {dots} dots" if dots else "")
                        + "; SDPA's flash and cuDNN backends take 16-bit inputs only) naive attention takes "
                        f"{q.derive(lambda t: naive(t).min(), '.2f', 'least float32 naive over ours')}–"
                        f"{q.derive(lambda t: naive(t).max(), '.2f', 'largest float32 naive over ours')}× our "
                        "forward+backward time from 8192 tokens on.")
    dtypes = sorted(set(table["dtype"]))

    def backward_over_forward(dtype: str):
        def ratio(t: pd.DataFrame) -> float:
            keys = ["d", "seq"]
            bwd = long(_rows(t, "backward", dtype=dtype)).set_index(keys)
            fwd = long(_rows(t, "forward", dtype=dtype)).set_index(keys)
            return (column_values(bwd, "flash_triton") / column_values(fwd, "flash_triton")).median()
        return ratio

    medians = [f"{q.derive(backward_over_forward(d), '.1f', f'backward over forward, {d}')}× our forward in {d}"
               for d in dtypes if backward_over_forward(d)(table) == backward_over_forward(d)(table)]
    if medians:
        text.append("From 8192 tokens on our backward takes a median " + ", ".join(medians)
                    + " (FlashAttention-2's backward does 2.5× the forward's matrix FLOPs, five products against "
                      "two; ours executes seven, 3.5× its forward).")
    return text


def _flop_convention(q: Quotes, table: pd.DataFrame) -> str:
    """How TFLOP/s are counted, and our throughput by that count and by what our kernels execute."""
    fwd, bwd = attention_math.GEMMS["flash_triton"][:2]
    text = ("TFLOP/s count FlashAttention-2's matrix FLOPs (Dao, FlashAttention-2, `arXiv:2307.08691`, §4.1): "
            "the forward 4·seq²·d per head (two products, QKᵀ and PV), the backward 2.5× that (five products: S "
            "recomputed, then dV, dP, dQ, dK), both halved when causal; SDPA's flash backend executes exactly "
            f"that. Our Triton forward executes {fwd} products, but our backward executes {bwd}: its dK/dV kernel "
            "and its dQ kernel each recompute S and dP, so the two kernels need no atomic adds. The table gives our "
            "throughput both ways ('FA2 count', the column of every comparison, and 'executed'). The TFLOP/s figure "
            "uses FA2's count too, except for the providers that compute the full masked matrix (naive attention; "
            "our PyTorch FA2's backward), drawn at the count they execute: halving their work would under-state it.")
    count, executed = "ours TFLOP/s, FA2 count", "ours TFLOP/s, executed"
    best = table.loc[column_values(table, count).idxmax()] if column_values(table, count).notna().any() else None
    if best is None:
        return text
    text += (f" Our best is {q.derive(lambda t: column_values(t, count).max(), '.0f', 'best TFLOP/s')} TFLOP/s by "
             f"the count ({best['pass']}, {best['dtype']}, d={best['d']}, seq={best['seq']})")
    backward = _rows(table, "backward")
    if column_values(backward, count).notna().any():
        top = backward.loc[column_values(backward, count).idxmax()]

        def top_backward(column: str):
            def value(t: pd.DataFrame) -> float:
                rows = _rows(t, "backward")
                return column_values(rows, column).loc[column_values(rows, count).idxmax()]
            return value

        text += (f"; our best backward {q.derive(top_backward(count), '.0f', 'best backward TFLOP/s')} TFLOP/s by "
                 f"the count, {q.derive(top_backward(executed), '.0f', 'its executed TFLOP/s')} executed "
                 f"({top['dtype']}, d={top['d']}, seq={top['seq']})")
    return text + "."


def _flash_coverage(ctx: Context, frame: pd.DataFrame) -> str:
    """Which (dtype, head dim) sweeps have rows, and where the missing ones' logs are."""
    dims = frame.groupby("dtype")["head_dim"].unique()
    every = sorted(frame["head_dim"].unique())
    measured = (f"{dtype} at d = {', '.join(map(str, sorted(d)))}" for dtype, d in dims.items())
    text = "Measured: " + "; ".join(measured) + "."
    for dtype, present in dims.items():
        for d in (d for d in every if d not in present):
            name = f"flash_benchmark/{dtype}_d{d}"
            text += f" {dtype} at d = {d} has no rows" + (
                f": its run did not finish (`logs/{name}.log` shows how far it got)." if ctx.log(name) else ".")
    return text
