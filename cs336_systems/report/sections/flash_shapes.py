"""Beyond the handouts: our FlashAttention at the shapes a Transformer's training step gives it, beside
SDPA's flash and cuDNN backends in the same run (rule flash_llm_shapes), and how long the first call at a
new shape takes with an empty and a filled Triton cache. Every number in the prose is a cell of the
table or a formula over it."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.appendix import appendix, appendix_parts, outline, rows_of, statistic
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import Context, Deliverable, Quotes, Section, Table

PROVIDERS = {"flash_triton": "ours (ms)", "flash_triton_compiled": "ours compiled (ms)",
             "sdpa_flash": "SDPA flash (ms)", "sdpa_cudnn": "SDPA cuDNN (ms)"}
KEYS = ["batch", "heads", "seq_len", "head_dim", "causal", "pass"]


def llm_shapes_table(frame: pd.DataFrame) -> NumericTable:
    """One row per (shape, pass): each provider's median ms and our ratios, with the commit that ran it."""
    ok = frame[frame["status"] == "ok"]
    wide = ok.pivot_table(index=KEYS, columns="provider", values="median_ms").reset_index()
    commits = ok.groupby(KEYS)["git_commit"].first().str[:7].rename("commit").reset_index()
    wide = wide.merge(commits, on=KEYS)
    out = wide[KEYS].rename(columns={"seq_len": "seq", "head_dim": "d"})
    for provider, label in PROVIDERS.items():
        if provider in wide:
            out[label] = wide[provider]
    ours = wide.get("flash_triton")
    for provider, label in (("sdpa_flash", "ours ÷ flash"), ("sdpa_cudnn", "ours ÷ cuDNN"),
                            ("flash_triton_compiled", "compiled ÷ eager")):
        if ours is not None and provider in wide:
            ratio = wide[provider] / ours if provider.endswith("compiled") else ours / wide[provider]
            out[label] = ratio
    flags = {name: fixed_cost_bound(out, label) for name, label in
             (("eager", "ours (ms)"), ("compiled", "ours compiled (ms)")) if label in out}
    if flags:
        out["fixed cost"] = [", ".join(name for name, flag in flags.items() if flag[i]) for i in out.index]
    out["commit"] = wide["commit"]
    out = out.sort_values(["d", "causal", "seq", "batch", "pass"]).reset_index(drop=True)
    text = {"causal", "pass", "fixed cost", "commit"}
    return NumericTable(out, tuple(Col(c) if c in text else Col(c, "d") if c in ("batch", "heads", "seq", "d")
                                   else Col(c, ".3f") for c in out.columns))


FLAT = 4  # a time is fixed-cost bound when a point with at least FLAT times its work took no longer


def fixed_cost_bound(table: pd.DataFrame, column: str) -> pd.Series:
    """Whether each row's time in `column` is bound by fixed per-call costs (host time, launch latency)
    rather than by the kernel: some row of the same pass with at least FLAT× the work (batch·heads·seq²·d,
    halved when causal) took no longer, so the time does not grow with the work."""
    work = table["batch"] * table["heads"] * table["seq"] ** 2 * table["d"] * table["causal"].map({True: 0.5, False: 1.0})
    flat = []
    for i in table.index:
        others = (table["pass"] == table.at[i, "pass"]) & (work >= FLAT * work[i]) & (table[column] <= table.at[i, column])
        flat.append(bool(others.any()) if table.at[i, column] == table.at[i, column] else False)
    return pd.Series(flat, index=table.index)


def first_call_table(frame: pd.DataFrame) -> NumericTable:
    data = frame[["batch", "heads", "seq_len", "head_dim", "triton_cache", "first_call_s"]].rename(
        columns={"seq_len": "seq", "head_dim": "d", "triton_cache": "Triton cache", "first_call_s": "first call (s)"})
    return NumericTable(data, (Col("batch", "d"), Col("heads", "d"), Col("seq", "d"), Col("d", "d"),
                               Col("Triton cache"), Col("first call (s)", ".2f")))


def _fb(t: pd.DataFrame) -> pd.DataFrame:
    return t[t["pass"] == "forward_backward"]


PASS_NAMES = {"forward": "forward", "forward_backward": "forward+backward"}


def _compiled_paragraph(q: Quotes) -> str:
    """Compiled over eager, per pass: the range over all of the pass's rows, then apart the rows whose eager or
    compiled time is fixed-cost bound (they time the call, not the kernel) and the others."""
    def rows(pass_: str, bound: bool | None = None):
        def select(t: pd.DataFrame) -> pd.Series:
            chosen = t[t["pass"] == pass_]
            if bound is not None:
                chosen = chosen[(chosen["fixed cost"] != "") == bound]
            return chosen["compiled ÷ eager"].dropna()
        return select

    def span(pass_: str, bound: bool | None, what: str) -> str:
        low = q.derive(lambda t: rows(pass_, bound)(t).min(), ".2f", f"least compiled over eager, {what}")
        high = q.derive(lambda t: rows(pass_, bound)(t).max(), ".2f", f"largest compiled over eager, {what}")
        return f"{low}–{high}× {PASS_NAMES[pass_]}"

    def fixed_highest(p: str) -> bool:
        bound, other = rows(p, True)(q.frame), rows(p, False)(q.frame)
        return len(bound) > 0 and (len(other) == 0 or bound.max() > other.max())

    passes = [p for p in PASS_NAMES if len(rows(p)(q.frame))]
    worst_row = int(q.frame["compiled ÷ eager"].idxmax())
    worst = q.frame.loc[worst_row]
    text = ("Under torch.compile our Function's time over its eager time is "
            + " and ".join(span(p, None, f"{p}, all") for p in passes)
            + ". A time is fixed-cost bound (column 'fixed cost') where a point of the same pass "
            f"with at least {FLAT}× the work (batch·heads·seq²·d, halved when causal) took no longer: it does not "
            "grow with the work, so it times the call (host time, launch latency), not the kernel. "
            + ("The largest ratios are at such points: " if all(fixed_highest(p) for p in passes) else "Such points: ")
            + ", and ".join(
                f"{q.derive(lambda t, p=p: len(rows(p, True)(t)), 'd', f'fixed-cost {p} points')} {PASS_NAMES[p]} "
                f"points, up to {q.derive(lambda t, p=p: rows(p, True)(t).max(), '.2f', f'largest fixed-cost {p}')}×"
                for p in passes)
            + f" (the largest: ours {q.cell('ours (ms)', worst_row)} ms eager against "
              f"{q.cell('ours compiled (ms)', worst_row)} ms compiled, "
            f"{worst['fixed cost'] or 'neither'} fixed-cost bound). At the others compiled ÷ eager is "
            + " and ".join(span(p, False, f"{p}, not fixed-cost") + " (median "
                           + q.derive(lambda t, p=p: rows(p, False)(t).median(), ".2f", f"median {p}, not fixed-cost")
                           + ")" for p in passes) + ".")
    return text


def _timing(frame: pd.DataFrame) -> str:
    """How the rows were timed: in one run, and (grids from the interleaved benchmark on) in rounds."""
    ok = frame[frame["status"] == "ok"]
    if "rounds" in ok and ok["rounds"].notna().all() and ok["rounds"].nunique() == 1 and ok["rounds"].iloc[0] > 1:
        rounds = int(ok["rounds"].iloc[0])
        return (f"timed in one run, taking turns in {rounds} rounds (each row the median of its rounds' medians; on a "
                "GPU, do_bench windows of at least 10 calls in all)")
    return "timed in one run (medians; on a GPU, do_bench windows of at least 10 calls)"


def render_llm_shapes(ctx: Context) -> Section:
    frame = ctx.frame("flash_llm_shapes")
    table = ctx.numeric("flash_llm_shapes")
    q = Quotes(table)
    device = frame["device_name"].iloc[0]
    bh = frame["batch"] * frame["heads"]

    def span(values) -> str:
        values = sorted(set(values))
        return f"{values[0]}-{values[-1]}" if len(values) > 1 else f"{values[0]}"

    causal = {True: "causal", False: "not causal"}
    intro = (f"Answers no handout question; it checks the kernel where models use it. {device}, "
             f"{frame['dtype'].iloc[0]}, inputs in a model's layout ((batch, seq, heads, dim) viewed as (batch, heads, "
             f"seq, dim)), batch × heads {span(bh)}, sequences {span(frame['seq_len'])}, head dim "
             f"{' and '.join(map(str, sorted(set(frame['head_dim']))))}, "
             f"{' and '.join(causal[c] for c in sorted(set(frame['causal']), reverse=True))}; each point's providers "
             + _timing(frame) + ".")
    if frame["git_commit"].nunique() > 1:
        commits = frame.groupby("head_dim")["git_commit"].unique()
        if all(len(c) == 1 for c in commits):
            intro += (" Each head dim ran as a device call of its own, at its own commit: "
                      + ", ".join(f"head dim {d} at {c[0]}" for d, c in commits.items()) + ".")
        else:
            intro += " The rows name their commit (column git_commit): some points were measured again at a later one."
    checked = []
    ratio = lambda column: lambda t: _fb(t)[column].dropna()  # noqa: E731
    if "ours ÷ flash" in table.headers:
        long_ = lambda t: _fb(t)[_fb(t)["SDPA flash (ms)"] >= 1.0]["ours ÷ flash"].dropna()  # noqa: E731
        short = lambda t: _fb(t)[_fb(t)["SDPA flash (ms)"] < 1.0]["ours ÷ flash"].dropna()  # noqa: E731
        slower_long = lambda t: (long_(t) > 1).sum()  # noqa: E731
        checked.append(
            f"Forward+backward against SDPA flash: ours is faster at "
            f"{q.derive(lambda t: (ratio('ours ÷ flash')(t) < 1).sum(), 'd', 'points ours beats flash')} of "
            f"{q.derive(lambda t: len(ratio('ours ÷ flash')(t)), 'd', 'points with both')} points. Where SDPA "
            f"flash takes at least 1 ms, ours takes {q.derive(lambda t: long_(t).min(), '.2f', 'least long ratio')}–"
            f"{q.derive(lambda t: long_(t).max(), '.2f', 'largest long ratio')}× its time (slower at "
            f"{q.derive(slower_long, 'd', 'long points ours is slower')} of "
            f"{q.derive(lambda t: len(long_(t)), 'd', 'long points')}); below that ours is slower at "
            f"{q.derive(lambda t: (short(t) > 1).sum(), 'd', 'short points ours is slower')} of "
            f"{q.derive(lambda t: len(short(t)), 'd', 'short points')} points (up to "
            f"{q.derive(lambda t: short(t).max(), '.2f', 'worst short ratio')}×). Ours' forward+backward takes at "
            f"least {q.derive(lambda t: _fb(t)['ours (ms)'].min(), '.3f', 'least ours time')} ms at every point, "
            f"cuDNN's at least {q.derive(lambda t: _fb(t)['SDPA cuDNN (ms)'].min(), '.3f', 'least cudnn time')} ms: "
            "short calls are bound by a fixed per-call cost (host work and kernel launches), not by the kernels' "
            "arithmetic"
            + (", so the goal of never being slower than SDPA flash is not met there." if (short(q.frame) > 1).any()
               else ". There the flash_triton backend runs its C++ autograd node (kernels/flash/host/), whose "
                    "backward runs no Python, and the goal of never being slower than SDPA flash is met at every "
                    "point."))
    if "ours ÷ cuDNN" in table.headers:
        checked.append(
            f"Against cuDNN, ours takes a median {q.derive(lambda t: ratio('ours ÷ cuDNN')(t).median(), '.2f', 'median cudnn ratio')}× "
            f"its forward+backward time (best {q.derive(lambda t: ratio('ours ÷ cuDNN')(t).min(), '.2f', 'best cudnn ratio')}×; "
            f"at or below cuDNN's time at {q.derive(lambda t: (ratio('ours ÷ cuDNN')(t) <= 1.0).sum(), 'd', 'points at or below cudnn')} "
            "points). On this GPU large calls run our Gluon kernels (kernels/flash/gluon_fwd.py, gluon_bwd.py) and "
            "small ones our FA2 Triton kernels (the choice, per head dim by the longest row's keys and the call's "
            f"attention scores: kernels/flash/dispatch.py); where SDPA flash takes at "
            f"least 1 ms the median is {q.derive(lambda t: _fb(t)[_fb(t)['SDPA flash (ms)'] >= 1.0]['ours ÷ cuDNN'].dropna().median(), '.2f', 'median long cudnn ratio')}×.")
    moved = []  # why the compiled call costs more where it does: torch internals, for the appendix
    if "compiled ÷ eager" in table.headers:
        checked.append(_compiled_paragraph(q))
        compiled = frame[frame["provider"] == "flash_triton_compiled"]
        if "compiled_for" in frame and len(compiled) and (compiled["compiled_for"] == "point").all():
            moved.append(
                "Here dO is in the model's layout (column do_layout of the results), and the compiled provider is "
                "compiled for each point with static shapes (column compiled_for), as a model training at one shape "
                "is. With the torch these rows name (column torch_version), AOTAutograd hands the backward of such a "
                "standalone region a contiguous dO, copied at every call. Our C++ node keeps backward launches for "
                "that layout as well as for O's, so it copies nothing more; traced with torch's "
                "guess_tangent_strides_as_outputs on, torch's copy goes too, and so does the compiled call's extra "
                "time at the device-bound points timed that way (kernels/flash/DECISIONS.md). A region that goes on "
                "as a model's layer does hands our backward dO in O's layout, with no copy.")
        elif "do_layout" in frame and (frame["do_layout"] == "model").all():
            moved.append(
                "Here dO is in the model's layout too (column do_layout of the results). The compiled provider is "
                "one torch.compile called at every point, so from the second point on Dynamo runs a graph with "
                "dynamic sizes; for such a graph AOTAutograd copies the incoming dO into a contiguous layout, and our "
                "C++ node, whose backward plan was made for O's layout, copies it back (kernels/csrc/flash_node.cpp). "
                "A graph compiled for one shape, or a region that ends as a model's layer does, hands our backward dO "
                "in O's layout, with no copy (kernels/flash/DECISIONS.md). Where "
                "ours is not fixed-cost bound, the compiled call's extra time grows with dO's size.")
    longest = lambda t: ((t["seq"] == t["seq"].max()) & (t["d"] == t["d"].max())  # noqa: E731
                         & (t["pass"] == "forward_backward"))
    shown = tuple(h for h in table.headers if h not in ("fixed cost", "commit"))
    compiled = checked[-1:] if "compiled ÷ eager" in table.headers else []  # the compiled call: for the appendix
    body = checked[:len(checked) - len(compiled)]
    parts = [intro, *body, rows_of(table, longest, shown).to_markdown(),
             f"_{statistic(ctx.table('flash_llm_shapes'))}: the rows of the longest sequence at the largest head dim, "
             f"forward+backward, without the fixed-cost and "
             f"commit columns; the "
             f"full table has "
             f"{outline(table, ['batch', 'heads', 'seq', 'd', 'causal', 'pass'])}._",
             *(appendix_parts("FlashAttention at training shapes: our op under torch.compile", [*compiled, *moved])
               if compiled or moved else ()),
             appendix("FlashAttention at Transformer training shapes: every point", ctx.table("flash_llm_shapes"))]
    first = ctx.frame("flash_first_call")
    if first is not None:
        cold = first.loc[first["triton_cache"] == "cold", "first_call_s"]
        warm = first.loc[first["triton_cache"] == "warm", "first_call_s"]
        if len(cold) and len(warm):
            parts.append(f"The first forward+backward at the leaderboard shape in a fresh process took {cold.iloc[0]:.1f} s "
                         f"with an empty Triton cache (every kernel compiled, every kept tile config timed) and "
                         f"{warm.iloc[0]:.1f} s with the cache that run filled: compiled kernels and autotuning results "
                         "are read from disk (`triton.autotune(cache_results=True)`).")
            parts.append(ctx.table("flash_first_call"))
    return Section(parts, table, checked, q.derived, wording=("1", "2", "3", "16", "512", "32768", "64", "128", "10",
                                                              "3.6", "90", "21", "4"))


DELIVERABLES = [
    Deliverable("1.3.3, continued: FlashAttention at Transformer training shapes", "flash_llm_shapes",
                render_llm_shapes, ("flash_llm_shapes",),
                tables=(Table("flash_llm_shapes", "flash_llm_shapes", llm_shapes_table,
                              "Median ms per call, bf16, same run per point; ratios of medians"),
                        Table("flash_first_call", "flash_first_call", first_call_table,
                              "First call in a fresh process (compile and autotune included)")),
                cuda_only="SDPA's flash and cuDNN backends run on CUDA only"),
]
