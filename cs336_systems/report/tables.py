"""Each handout table as a function of its results rows.

Builders return a NumericTable (report/frame.py: numbers plus one format per column, printed by one
formatter for the Markdown, the LaTeX and the prose). The `table` rule builds each table once and writes
it to results/tables/NAME.json, which the sections read back (`Context.numeric`) and quote."""

from __future__ import annotations

import pandas as pd

from cs336_systems.model import get_config, parameter_count
from cs336_systems.analysis import attention_math
from cs336_systems.analysis.collectives import all_reduce_rows
from cs336_systems.report.frame import Col, NumericTable

SIZE_ORDER = ["tiny", "mini", "small", "medium", "large", "xl", "2.7B", "10B"]  # 10B: the 2026 table's


def ordered_by_size(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    frame["size"] = pd.Categorical(frame["size"], [s for s in SIZE_ORDER if s in set(frame["size"])], ordered=True)
    return frame.sort_values("size")


def weights_of(frame: pd.DataFrame) -> pd.Series:
    """Each e2e row's weights (bench/e2e.py WEIGHTS); rows measured before the column existed had float32 ones."""
    return frame["weights"].fillna("float32") if "weights" in frame else pd.Series("float32", index=frame.index)


def float32_weights(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows with float32 weights: the tables that do not compare weights show no bf16 master weights."""
    return frame[weights_of(frame).eq("float32")]


# --- 1.1.3 and 1.1.5: step times per model size ---------------------------------------------------------

def phase_table(frame: pd.DataFrame, columns: dict[str, dict], phases: list[str]) -> NumericTable:
    """One row per model size; for each named column filter (e.g. precision=fp32) and phase, the mean ms ±
    its std (or the status, OOM, of a run that did not finish; '—' where nothing ran). An OOM row has phase
    'step', so it is looked up under any phase."""
    out, status, headers = [], {}, []
    for size, rows in ordered_by_size(float32_weights(frame)).groupby("size", observed=True, sort=True):
        record = {"size": str(size)}
        for label, where in columns.items():
            selected = rows
            for key, value in where.items():
                selected = selected[selected[key] == value]
            for phase in phases:
                header = f"{label} {phase} (ms)" if label else f"{phase} (ms)"
                headers += [header] if header not in headers else []
                cell = selected[(selected["phase"] == phase) | (selected["status"] != "ok")]
                ok = len(cell) and cell["status"].iloc[0] == "ok"
                record[header] = cell["mean_ms"].iloc[0] if ok else float("nan")
                record[f"{header} std"] = cell["std_ms"].iloc[0] if ok else float("nan")
                if len(cell) and not ok:
                    status.setdefault(header, {})[len(out)] = str(cell["status"].iloc[0])
        out.append(record)
    data = pd.DataFrame(out, columns=["size", *(h for header in headers for h in (header, f"{header} std"))])
    return NumericTable(data, (Col("size"), *(Col(h, ".2f", second=f"{h} std") for h in headers)), status)


def e2e_timing(frame: pd.DataFrame) -> NumericTable:
    """1.1.3(b): forward and backward time per size (fp32), our naive attention and SDPA."""
    fp32 = frame[(frame["precision"] == "fp32") & (frame["mode"] == "forward_backward")]
    columns = {name: {"attention": name} for name in sorted(set(fp32["attention"]))}
    return phase_table(fp32, columns, ["forward", "backward"])


def step_samples(text: str) -> list[float]:
    """The measured steps' times (ms) of a row's `samples_ms` (bench/e2e.py writes them space-separated)."""
    return [float(t) for t in text.split()]


def e2e_warmup(frame: pd.DataFrame) -> NumericTable:
    """1.1.3(c): the forward+backward step time for each number of warm-up steps; where the rows carry every
    measured step's time (`samples_ms`), also the first measured step and the slowest of the others."""
    columns = {f"warmup={w}": {"warmup": w} for w in sorted(set(frame["warmup"]))}
    table = phase_table(frame, columns, ["step"])
    if "samples_ms" not in frame or frame["samples_ms"].isna().all():
        return table
    steps = frame[(frame["phase"] == "step") & (frame["status"] == "ok") & frame["samples_ms"].notna()]
    data, extra = table.data.copy(), []
    for w in sorted(set(steps["warmup"])):
        times = steps[steps["warmup"] == w].set_index("size")["samples_ms"].map(step_samples)
        first, later = f"warmup={w} 1st step (ms)", f"warmup={w} slowest later (ms)"
        data[first] = data["size"].map(times.map(lambda t: t[0]))
        data[later] = data["size"].map(times.map(lambda t: max(t[1:]) if len(t) > 1 else float("nan")))
        extra += [Col(first, ".2f"), Col(later, ".2f")]
    return NumericTable(data, (*table.columns, *extra), table.status)


def mixed_precision(frame: pd.DataFrame) -> NumericTable:
    """1.1.5(c): forward and backward time per size, fp32 versus bf16 autocast (naive attention), and the
    speed-up (fp32 mean step over bf16's). Means throughout, as 1.1.3's table and the handout's 'average and
    standard deviation': the speed-up is a ratio of the same statistic its neighbouring cells print."""
    rows = frame[(frame["mode"] == "forward_backward") & (frame["attention"] == "naive")]
    columns = {p: {"precision": p} for p in ["fp32", "bf16"] if p in set(rows["precision"])}
    table = phase_table(rows, columns, ["forward", "backward"])
    speedups = precision_speedup(rows).assign(size=lambda t: t["size"].astype(str))
    data = table.data.merge(speedups, on="size", how="left")
    return NumericTable(data, (*table.columns, Col("bf16 speed-up", ".2f")), table.status)


def precision_speedup(frame: pd.DataFrame) -> pd.DataFrame:
    """fp32 mean step time over bf16 mean step time per size."""
    steps = frame[(frame["phase"] == "step") & (frame["status"] == "ok")]
    wide = steps.pivot_table(index="size", columns="precision", values="mean_ms", observed=True)
    if not {"fp32", "bf16"} <= set(wide.columns):
        return pd.DataFrame({"size": [], "bf16 speed-up": []})
    return (wide["fp32"] / wide["bf16"]).rename("bf16 speed-up").reset_index()


def compile_scope(frame: pd.DataFrame) -> pd.Series:
    """What each row compiled: 'none' for eager rows; runs from before the scope column compiled blocks."""
    scope = frame["compile_scope"] if "compile_scope" in frame else pd.Series("blocks", index=frame.index)
    return scope.fillna("blocks").where(frame["compile"].astype(bool), "none")


def compile_timing(frame: pd.DataFrame) -> NumericTable:
    """1.3.1(b): eager versus compiled (per compile scope), forward-only and full training step, per attention
    backend: the median step time; per scope the speed-up over eager (eager median ÷ that scope's median), and
    the MFU of the fastest compiled scope (by median). Medians throughout, as in its figure: a compiled step's
    mean carries the odd slow step (a recompile, a host stall) that the median leaves out."""
    from cs336_systems.bench.e2e import COMPILE_SCOPES  # here, not above: bench.e2e costs a report process ~1 s

    out, status = [], {}
    frame = float32_weights(frame)
    steps = frame[frame["phase"].eq("step") | frame["status"].ne("ok")].assign(scope=compile_scope)
    scopes = [s for s in COMPILE_SCOPES if s != "none" and s in set(steps["scope"])]  # "none" is the eager column
    times = ["eager (ms)", *(compile_column("compiled", scope, scopes) + " (ms)" for scope in scopes)]
    speedups = [compile_column("speed-up", scope, scopes) for scope in scopes]
    for (size, attention, mode), rows in ordered_by_size(steps).groupby(["size", "attention", "mode"], observed=True):
        record = {"size": str(size), "attention": attention, "mode": mode}
        by_scope = {"none": rows[rows["scope"] == "none"], **{s: rows[rows["scope"] == s] for s in scopes}}
        ran = {s: r for s, r in by_scope.items() if len(r) and r["status"].eq("ok").all()}
        for header, scope in zip(times, ["none", *scopes]):
            record[header], _, state = _first(by_scope[scope], "median_ms")
            if state:
                status.setdefault(header, {})[len(out)] = state
        for header, scope in zip(speedups, scopes):
            record[header] = (ran["none"]["median_ms"].iloc[0] / ran[scope]["median_ms"].iloc[0]
                              if "none" in ran and scope in ran else float("nan"))
        compiled = [r for s, r in ran.items() if s != "none"]
        best = min(compiled, key=lambda r: r["median_ms"].iloc[0]) if compiled else None
        record["compiled MFU"] = best["mfu"].iloc[0] if best is not None else float("nan")
        out.append(record)
    columns = ["size", "attention", "mode", *times, *speedups, "compiled MFU"]
    return NumericTable(pd.DataFrame(out, columns=columns), (
        Col("size"), Col("attention"), Col("mode"), *(Col(h, ".2f") for h in times),
        *(Col(h, ".2f") for h in speedups), Col("compiled MFU", ".3f")), status)


def _pooled_median(rows: pd.DataFrame) -> float:
    """The median over every measured step of `rows` (one point's rows of several rounds, each with its steps in
    `samples_ms`; a row without them counts its median once)."""
    samples = [t for row in rows.itertuples() for t in
               (step_samples(row.samples_ms) if isinstance(row.samples_ms, str) else [row.median_ms])]
    return float(pd.Series(samples).median())


def baseline_timing(frame: pd.DataFrame) -> NumericTable:
    """1.3.1(b): our model against the plain-PyTorch baseline timed in the same run: per size, compile scope,
    model and weights (float32, or bf16 with float32 masters), the median training step over the measured steps of
    every round (`--rounds`), its MFU (from that median), its median over the baseline's, and the rounds pooled. A
    point that failed in some round (out of memory) shows that status."""
    steps = frame[frame["phase"].eq("step") | frame["status"].ne("ok")].assign(scope=compile_scope)
    steps = steps.assign(weights=weights_of(steps), round=steps["round"] if "round" in steps else 0)
    point = ["model", "weights", "attention", "optimizer"]
    out, status = [], {}
    nan = float("nan")
    for (size, scope), rows in ordered_by_size(steps).groupby(["size", "scope"], observed=True, sort=True):
        points = rows.sort_values(["model", "weights"], ascending=[True, False]).groupby(point, sort=False)
        medians = {key: _pooled_median(p) if p["status"].eq("ok").all() else nan for key, p in points}
        plain = next((m for key, m in medians.items() if key[0] == "plain"), nan)
        for key, p in points:
            median = medians[key]
            if p["status"].ne("ok").any():
                status.setdefault("median (ms)", {})[len(out)] = str(p.loc[p["status"].ne("ok"), "status"].iloc[0])
            first = p.iloc[0]  # MFU scales inversely with the step time (same FLOPs and peak in every round)
            out.append({"size": str(size), "compiled": scope, **dict(zip(point, key)), "rounds": p["round"].nunique(),
                        "median (ms)": median, "MFU": first["mfu"] * first["median_ms"] / median,
                        "÷ plain": median / plain})
    columns = ["size", "compiled", "model", "attention", "optimizer", "weights", "rounds", "median (ms)", "MFU",
               "÷ plain"]
    return NumericTable(pd.DataFrame(out, columns=columns), (
        *(Col(c) for c in columns[:6]), Col("rounds", "d"), Col("median (ms)", ".2f"),
        Col("MFU", ".3f"), Col("÷ plain", ".3f")), status)


def compile_column(what: str, scope: str, scopes: list[str]) -> str:
    """'compiled' / 'speed-up' for a run of one compile scope, else named by scope ('speed-up, blocks')."""
    return what if len(scopes) == 1 else f"{what}, {scope}"


# AdamW's least memory traffic per fp32 parameter: read parameter, gradient and both moments, write
# parameter and both moments.
ADAMW_BYTES_PER_PARAM = 7 * 4


def _first(rows: pd.DataFrame, statistic: str = "mean_ms") -> tuple[float, float, str | None]:
    """(the statistic in ms (mean by default), std ms, status) of the first row; the status is set where it did
    not run ('—' if no row)."""
    if rows.empty:
        return float("nan"), float("nan"), None
    row = rows.iloc[0]
    if row["status"] != "ok":
        return float("nan"), float("nan"), str(row["status"])
    return row[statistic], row.get("std_ms", float("nan")), None  # some sweeps record no std


OPTIMIZER_STEP, TRAINING_STEP = "optimizer step (ms, median)", "training step (ms, median)"
VERSUS_TORCH = "÷ torch_fused"


def optimizer_timing(frame: pd.DataFrame) -> NumericTable:
    """The optimizer phase of a training step per size and optimizer, and the whole step: one statistic, the
    median over the measured steps (a step's mean carries the odd slow step, e.g. an allocator stall); from it
    the bandwidth that would move AdamW's least traffic, and the optimizer step over torch's fused AdamW's of
    the same size ('—' where either did not run)."""
    out, status = [], {}
    by_size = ordered_by_size(float32_weights(frame))
    for (size, optimizer), rows in by_size.groupby(["size", "optimizer"], observed=True, sort=True):
        params = parameter_count(get_config(str(size)))
        record = {"size": str(size), "parameters (M)": params / 1e6, "optimizer": optimizer}
        for header, phase in ((OPTIMIZER_STEP, "optimizer"), (TRAINING_STEP, "step")):
            record[header], _, state = _first(rows[rows["phase"].eq(phase) | rows["status"].ne("ok")], "median_ms")
            if state:
                status.setdefault(header, {})[len(out)] = state
        record["GB/s at 28 B/param"] = params * ADAMW_BYTES_PER_PARAM / (record[OPTIMIZER_STEP] / 1e3) / 1e9
        out.append(record)
    columns = ["size", "parameters (M)", "optimizer", OPTIMIZER_STEP, TRAINING_STEP, "GB/s at 28 B/param"]
    data = pd.DataFrame(out, columns=columns)
    torch_fused = data[data["optimizer"] == "torch_fused"].set_index("size")[OPTIMIZER_STEP]
    data[VERSUS_TORCH] = data[OPTIMIZER_STEP] / data["size"].map(torch_fused)
    return NumericTable(data, (
        Col("size"), Col("parameters (M)", "d"), Col("optimizer"), Col(OPTIMIZER_STEP, ".2f"),
        Col(TRAINING_STEP, ".2f"), Col("GB/s at 28 B/param", "d"), Col(VERSUS_TORCH, ".2f")), status)


def attention(frame: pd.DataFrame) -> NumericTable:
    """1.2.1: naive attention (eager), forward and backward mean ms, and its memory by the formulas
    (analysis/attention_math.py) beside the memory measured before backward.

    'Q, K, V' and 'P' are what autograd saves (S is freed once P exists); 'measured − P' is what the
    device held besides P (inputs, output, gradients of earlier passes, workspace); the backward peak
    adds dP and dS, two more (batch, seq, seq) matrices, to the measured memory. Memory is measured on a
    GPU only (the CPU has no allocator statistics: 0 there): elsewhere the measured columns are '—'."""
    rows = frame[frame["impl"] == "eager"]
    out, status, nan = [], {}, float("nan")
    for (d, seq), group in rows.groupby(["head_dim", "seq_len"]):
        fwd, bwd = group[group["phase"] == "forward"], group[group["phase"] == "backward"]
        ok = (group["status"] == "ok").all()
        batch = int(group["batch"].iloc[0])
        square = attention_math.square_mib(batch, seq)
        measured = fwd["memory_before_backward_mib"].iloc[0] if ok else nan
        on_gpu = measured > 0
        record = {"d": d, "seq": seq}
        for header, part in (("forward (ms)", fwd), ("backward (ms)", bwd)):
            record[header], _, state = _first(part)
            if state:
                status.setdefault(header, {})[len(out)] = state
        if not ok:
            status.setdefault("memory before backward (MiB)", {})[len(out)] = "oom"
        record.update({"Q, K, V saved (MiB)": 3 * attention_math.vector_mib(batch, seq, d), "P saved (MiB)": square,
                       "predicted saved (MiB)": group["saved_for_backward_bytes"].iloc[0] / 2**20,
                       "memory before backward (MiB)": measured,
                       "measured − P (MiB)": measured - square if on_gpu else nan,
                       "backward peak, + dP and dS (MiB)": measured + 2 * square if on_gpu else nan,
                       "measured backward peak (MiB)": (bwd["peak_memory_mib"].iloc[0]  # runs from that column on
                                                        if "peak_memory_mib" in group and on_gpu else nan)})
        out.append(record)
    data = pd.DataFrame(out)
    columns = [Col("d", "d"), Col("seq", "d"), Col("forward (ms)", ".3f"), Col("backward (ms)", ".3f"),
               Col("Q, K, V saved (MiB)", ".1f"), Col("P saved (MiB)", ".1f"), Col("predicted saved (MiB)", "d"),
               Col("memory before backward (MiB)", "d"), Col("measured − P (MiB)", ".1f"),
               Col("backward peak, + dP and dS (MiB)", "d"), Col("measured backward peak (MiB)", "d")]
    if data["measured backward peak (MiB)"].isna().all():  # no run measured it: no column
        columns, data = columns[:-1], data.drop(columns="measured backward peak (MiB)")
    return NumericTable(data, tuple(columns), status)



def attention_compile(frame: pd.DataFrame) -> NumericTable:
    """1.3.1(a): eager versus compiled naive attention, side by side (mean ms)."""
    out, status = [], {}
    headers = [f"{phase} {impl} (ms)" for phase in ("forward", "backward") for impl in ("eager", "compiled")]
    for (d, seq), group in frame.groupby(["head_dim", "seq_len"]):
        record = {"d": d, "seq": seq}
        for header in headers:
            phase, impl = header.split()[:2]
            record[header], _, state = _first(group[(group["phase"] == phase) & (group["impl"] == impl)])
            if state:
                status.setdefault(header, {})[len(out)] = state
        out.append(record)
    return NumericTable(pd.DataFrame(out, columns=["d", "seq", *headers]),
                        (Col("d", "d"), Col("seq", "d"), *(Col(h, ".3f") for h in headers)), status)


FLASH_OURS = ("ours ÷ SDPA flash", "ours TFLOP/s, FA2 count", "ours TFLOP/s, executed")


def flash_sweep(frame: pd.DataFrame) -> NumericTable:
    """1.3.2(e): one row per (dtype, d, seq, pass), median ms per provider as columns (a status such as OOM
    where a provider did not run), then ours over SDPA's flash backend and our throughput two ways: by
    FlashAttention-2's FLOP count (forward 2 products, backward 5) and by the products our kernels execute
    (backward 7; analysis/attention_math.py)."""
    frame = frame.assign(executed=attention_math.executed_tflops(frame))
    if "median_ms" not in frame:
        frame = frame.assign(median_ms=float("nan"))
    keys = ["dtype", "head_dim", "seq_len", "pass"]
    wide = frame.pivot_table(index=keys, columns="provider", values="median_ms", aggfunc="first", dropna=False)
    states = frame.pivot_table(index=keys, columns="provider", values="status", aggfunc="first")
    providers = list(states.columns)
    wide = wide.reindex(index=states.index, columns=providers)
    ours = frame[(frame["provider"] == "flash_triton") & (frame["status"] == "ok")].set_index(keys)
    anchor = frame[(frame["provider"] == "sdpa_flash") & (frame["status"] == "ok")].set_index(keys)
    ratio, fa2, executed = FLASH_OURS
    wide[ratio] = ours["median_ms"] / anchor["median_ms"]
    wide[fa2] = ours["tflops"]
    wide[executed] = ours["executed"]
    data = wide.reset_index().rename(columns={"head_dim": "d", "seq_len": "seq"})
    data.columns.name = None
    status = {p: {i: str(s) for i, s in enumerate(states[p]) if isinstance(s, str) and s != "ok"} for p in providers}
    columns = (Col("dtype"), Col("d", "d"), Col("seq", "d"), Col("pass"), *(Col(p, ".3f") for p in providers),
               Col(ratio, ".2f"), Col(fa2, ".1f"), Col(executed, ".1f"))
    return NumericTable(data, columns, status)


def flash_leaderboard(frame: pd.DataFrame) -> NumericTable:
    """1.3.3: the leaderboard case per provider, with the ratio of means to SDPA's flash backend."""
    out = []
    for pass_, group in frame.groupby("pass", sort=False):
        anchor = group.loc[group["provider"] == "sdpa_flash", "mean_ms"]
        for _, row in group.iterrows():
            out.append({"pass": pass_, "provider": row["provider"], "torch.compile": bool(row["compiled"]),
                        "mean (ms)": row["mean_ms"], "TFLOP/s": row["tflops"],
                        "÷ SDPA flash": row["mean_ms"] / anchor.iloc[0] if len(anchor) else float("nan")})
    return NumericTable(pd.DataFrame(out), (Col("pass"), Col("provider"), Col("torch.compile"), Col("mean (ms)", ".3f"),
                                            Col("TFLOP/s", "d"), Col("÷ SDPA flash", ".3f")))


def flash_correctness(frame: pd.DataFrame) -> NumericTable:
    """Per test: how many of its runs passed (each repeat draws fresh inputs; rows without a `repeat`
    column are one run each), how many were skipped, and its median seconds."""
    out = [{"test": test, "passed": int((group["outcome"] == "passed").sum()), "runs": len(group),
            "skipped": int((group["outcome"] == "skipped").sum()), "seconds (median)": group["seconds"].median()}
           for test, group in frame.groupby("test", sort=False)]
    return NumericTable(pd.DataFrame(out), (Col("test"), Col("passed", "d"), Col("runs", "d"), Col("skipped", "d"),
                                            Col("seconds (median)", ".2f")))


def flash_accuracy(frame: pd.DataFrame) -> NumericTable:
    """bfloat16 error against float64 per implementation, case and tensor: ours and SDPA's (mean over
    seeds), and ours over SDPA's."""
    keys = ["impl", "reference", "shape", "causal", "tensor"]
    mean = frame.groupby(keys, sort=False)[["ours_error", "sdpa_error"]].mean().reset_index()
    seeds = frame.groupby(keys, sort=False)["seed"].nunique().to_numpy()
    data = pd.DataFrame({"implementation": mean["impl"], "SDPA backend": mean["reference"].str.removeprefix("sdpa_"),
                         "(batch, heads, seq, d)": mean["shape"], "causal": mean["causal"], "tensor": mean["tensor"],
                         "seeds": seeds, "ours": mean["ours_error"], "SDPA": mean["sdpa_error"],
                         "ours ÷ SDPA": mean["ours_error"] / mean["sdpa_error"]})
    return NumericTable(data, (*(Col(c) for c in data.columns[:5]), Col("seeds", "d"), Col("ours", ".6f"),
                               Col("SDPA", ".6f"), Col("ours ÷ SDPA", ".2f")))


def flash_resources(frame: pd.DataFrame) -> NumericTable:
    """Per kernel and tile config, 'registers / bytes spilled' per thread for each dtype (float32 by its
    dot precision) and head dim; 'error' where the config did not compile, '—' where it was not compiled."""
    dots = frame["dot"] if "dot" in frame else pd.Series("", index=frame.index)
    frame = frame.assign(tile=[f"{o}×{i}, {w} warps, {s} stages" for o, i, w, s in
                               zip(frame["outer"], frame["inner"], frame["warps"], frame["stages"])],
                         case=[f"{t} {dot} d={d}" if t == "fp32" and isinstance(dot, str) and dot else f"{t} d={d}"
                               for t, dot, d in zip(frame["dtype"], dots, frame["head_dim"])])
    cases = list(dict.fromkeys(frame.assign(dot_key=dots.fillna("").astype(str))
                               .sort_values(["dtype", "dot_key", "head_dim"])["case"]))
    rows = list(dict.fromkeys(zip(frame["kernel"], frame["tile"])))  # kernels and tiles in the order compiled
    first = frame.groupby(["kernel", "tile", "case"], sort=False).first()
    data = pd.DataFrame(rows, columns=["kernel", "tile"])
    status = {}
    for case in cases:
        found = [first.loc[(k, t, case)] if (k, t, case) in first.index else None for k, t in rows]
        ok = [row is not None and row["status"] == "ok" for row in found]
        data[case] = [row["registers"] if good else float("nan") for row, good in zip(found, ok)]
        data[f"{case} spilled (B)"] = [row["spill_store_bytes"] if good else float("nan") for row, good in zip(found, ok)]
        # a config that failed shows 'error' (what the section counts); an unknown registers count prints 0
        data[case] = [0 if good and pd.isna(v) else v for v, good in zip(data[case], ok)]
        data[f"{case} spilled (B)"] = [0 if good and pd.isna(v) else v for v, good in zip(data[f"{case} spilled (B)"], ok)]
        failed = {i: "error" for i, row in enumerate(found) if row is not None and row["status"] != "ok"}
        if failed:
            status[case] = failed
    return NumericTable(data, (Col("kernel"), Col("tile"),
                               *(Col(c, "d", second=f"{c} spilled (B)", joiner=" / ") for c in cases)), status)


# The bench's size_mb is MiB: it allocates size_mb · 2**20 bytes of float32 (bench/allreduce.py); its bandwidths
# are 10^9 bytes per second.
ALLREDUCE_SIZE = "size (MiB)"


def allreduce(frame: pd.DataFrame) -> NumericTable:
    """2.1: all-reduce time and bandwidth per backend, process count and size; one statistic, the median
    over the timed iterations (the bandwidths are computed from it)."""
    rows = all_reduce_rows(frame).sort_values(["backend", "world_size", "size_mb"])
    data = pd.DataFrame({"backend": rows["backend"], "processes": rows["world_size"], ALLREDUCE_SIZE: rows["size_mb"],
                         "median (ms)": rows["median_ms"], "algbw (GB/s)": rows["algbw_gbps"],
                         "busbw (GB/s)": rows["busbw_gbps"]})
    return NumericTable(data, (Col("backend"), Col("processes", "d"), Col(ALLREDUCE_SIZE, "g"),
                               Col("median (ms)", ".3f"),
                               Col("algbw (GB/s)", ".2f"), Col("busbw (GB/s)", ".2f")))


# The DDP tables' one statistic: means over every measured step of every round. The step's parts are means
# too, so forward+backward + communication wait + optimizer add up to the step, and the communication share
# is a ratio of two means.
DDP_STEP = "step (ms)"
DDP_PARTS = ("forward+backward (ms)", "communication wait (ms)", "optimizer (ms)")


def ddp(frame: pd.DataFrame) -> NumericTable:
    """2.2–2.3: time per training step (mean ± std) and its parts (means), per wrapper and precision; a
    config that did not run shows its status in the step column."""
    ok = frame["status"] == "ok"

    def where_ok(column: str) -> pd.Series:
        return frame[column].where(ok)

    data = pd.DataFrame({
        "precision": frame["precision"], "config": frame["config"], DDP_STEP: where_ok("step_ms"),
        "step std (ms)": where_ok("step_std_ms"),
        **{part: where_ok(column) for part, column in zip(DDP_PARTS, ("forward_backward_ms", "communication_ms",
                                                                       "optimizer_ms"))},
        "comm share": where_ok("communication_ms") / where_ok("step_ms"), "final loss": where_ok("final_loss")})
    status = {DDP_STEP: {i: str(s) for i, s in enumerate(frame["status"]) if s != "ok"}}
    return NumericTable(data, (Col("precision"), Col("config"), Col(DDP_STEP, ".1f", second="step std (ms)"),
                               *(Col(part, ".1f") for part in DDP_PARTS), Col("comm share", ".1%"),
                               Col("final loss", ".4f")), status)


# the training runs' speed over every step, beside the table's statistic (the second half's median)
TOKENS_ALL_STEPS = "tokens/s, all steps"


def timed_steps(run: pd.DataFrame) -> pd.DataFrame:
    """The steps a training run's speed is the median of: the second half (the first includes warm-up and, for
    flash_triton, autotuning)."""
    return run[run["step"] > run["step"].max() // 2]


def train_matrix(frame: pd.DataFrame) -> NumericTable:
    """Training runs by attention backend and wrapper: speed over the second half of the steps (`timed_steps`;
    medians, the table's one statistic) and, beside it, over every step, memory, and how far each loss curve strays
    from torch DDP's with the same backend."""
    out = []
    for (attention, wrapper), run in frame.groupby(["attention", "wrapper"], sort=False):
        run = run.sort_values("step")
        step_ms = timed_steps(run)["step_ms"].median()
        reference = frame[(frame["attention"] == attention) & (frame["wrapper"] == "torch_ddp")].sort_values("step")
        drift = (abs(run["loss"].to_numpy() - reference["loss"].to_numpy()).max()
                 if len(reference) == len(run) else float("nan"))
        tokens = run["tokens_per_step"].iloc[0]
        out.append({"attention": attention, "wrapper": "single GPU" if wrapper == "none" else wrapper,
                    "ranks": int(run["world_size"].iloc[0]), "step (ms, median)": step_ms,
                    "tokens/s": tokens / step_ms * 1e3, TOKENS_ALL_STEPS: tokens / run["step_ms"].median() * 1e3,
                    "peak memory (MiB)": run["peak_memory_mib"].iloc[0],  # NaN where not CUDA: printed '—'
                    "final loss": run["loss"].iloc[-1], "max |loss − torch DDP|": drift})
    return NumericTable(pd.DataFrame(out), (
        Col("attention"), Col("wrapper"), Col("ranks", "d"), Col("step (ms, median)", ".1f"), Col("tokens/s", ",.0f"),
        Col(TOKENS_ALL_STEPS, ",.0f"), Col("peak memory (MiB)", ".0f"), Col("final loss", ".4f"),
        Col("max |loss − torch DDP|", ".2g")))
