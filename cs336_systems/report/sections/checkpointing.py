"""The 2026 handout's sections 3.1 and 3.2 (workflow/rules/checkpointing.smk): what autograd saves for the
backward pass (saved tensors), the activation-checkpointing cost model and the checkpoint-policy sweep."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from cs336_systems.model import get_config, parameter_count
from cs336_systems.report.appendix import appendix, appendix_parts
from cs336_systems.report.figures import pyplot, save_figure
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.section import (Context, Deliverable, Figure, Quotes, Section, Table, column_values,
                                          shared_cell)
from cs336_systems.report.sections.leaderboard import NUMBER

GIB = 1024.0


# ---- 3.1: what autograd saves ---------------------------------------------------------------------
# the bench's settings, one column each in the saved-tensors table (every row states what it ran at)
SAVED_SETTINGS = {"batch_size": "batch", "context_length": "context", "d_model": "d_model", "d_ff": "d_ff",
                  "num_heads": "heads", "precision": "precision"}


def saved_tensors_table(frame: pd.DataFrame) -> NumericTable:
    """Per case and mode, the MiB saved for backward by kind: counted per saved tensor (as the handout's
    hook does) and with every storage once (views of one tensor once); then the settings the case ran at."""
    index = ["case", "mode", *SAVED_SETTINGS]
    wide = frame.pivot_table(index=index, columns="kind", values=["tensor_mib", "storage_mib"],
                             aggfunc="sum", sort=False)
    out = pd.DataFrame(index=wide.index)
    for kind in ("activation", "input", "parameter"):
        if ("tensor_mib", kind) in wide:
            out[f"{kind} (MiB, per tensor)"] = wide[("tensor_mib", kind)]
            out[f"{kind} (MiB, per storage)"] = wide[("storage_mib", kind)]
    mib = list(out.columns)
    out = out.reset_index()[["case", "mode", *mib, *SAVED_SETTINGS]].rename(columns=SAVED_SETTINGS)
    text = ("case", "mode", "precision")
    return NumericTable(out, tuple(Col(c) if c in text else Col(c, "d") if c in SAVED_SETTINGS.values() else
                                   Col(c, ",.2f") for c in out.columns))


ACTIVATIONS = "activation (MiB, per storage)"
PER_TENSOR = ("activation (MiB, per tensor)", "input (MiB, per tensor)", "parameter (MiB, per tensor)")


def saved_mib(t: pd.DataFrame, case: str, mode: str, columns: tuple[str, ...] | str) -> float:
    """The sum of `columns` of the saved-tensors table's row (case, mode) (a kind no row saved has no column: 0)."""
    row = t[(t["case"] == case) & (t["mode"] == mode)]
    names = (columns,) if isinstance(columns, str) else columns
    return float(sum(row[c].iloc[0] for c in names if c in row))


def _saved_tensors_intro(table: NumericTable, device: str) -> str:
    """The bench's settings, each a cell of the table, stated once where every row prints the same one (the
    context: the blocks' rows and RMSNorm's, which runs alone at its own)."""
    t = table.data
    stated = {}
    for header in ("batch", "d_model", "d_ff", "heads", "precision"):
        stated[header] = shared_cell(table, header) or f"each row's {header} (the table's column)"
    contexts = {case: table.quote("context", int(t.index[t["case"] == case][0]))
                for case in ("block", "rmsnorm") if (t["case"] == case).any()}
    context = (f"context {contexts['block']} (RMSNorm alone: {contexts['rmsnorm']})" if len(contexts) == 2 else
               "each row's context (the table's column)")
    return (f"Answers the 2026 handout, section 3.1. Bytes autograd saves for the backward pass, recorded with "
            f"`torch.autograd.graph.saved_tensors_hooks` (`cs336_systems.bench.saved_tensors`) at the handout's "
            f"setting: batch {stated['batch']}, {context}, d_model {stated['d_model']}, d_ff {stated['d_ff']}, "
            f"{stated['heads']} heads, {stated['precision']}, naive attention, on {device}.")


def render_saved_tensors(ctx: Context) -> Section:
    frame = ctx.frame("saved_tensors")
    table = ctx.numeric("saved_tensors")
    q = Quotes(table)
    device = str(frame["device_name"].iloc[0])
    intro = _saved_tensors_intro(table, device)
    checked = [intro]
    if table.has(case="block", mode="eager") and table.has(case="block", mode="compiled"):
        ratio = q.derive(lambda t: saved_mib(t, "block", "eager", ACTIVATIONS) / saved_mib(t, "block", "compiled",
                                                                                           ACTIVATIONS),
                         ".2f", "eager block's activations over the compiled block's")
        checked.append(f"One eager block keeps {q.cell(ACTIVATIONS, case='block', mode='eager')} MiB of activations "
                       f"(each storage once); compiled, {q.cell(ACTIVATIONS, case='block', mode='compiled')} MiB "
                       f"({ratio}× less): the compiler fuses the elementwise chains (RMSNorm, SwiGLU's gate, the "
                       "softmax) and recomputes their cheap intermediates instead of saving them.")
    listed = ctx.frame("saved_tensors_list")
    if table.has(case="four_blocks_checkpointed", mode="eager") and table.has(case="four_blocks", mode="eager"):
        checked.append(checkpointed_sentence(q))
        if listed is not None:
            checked.append(checkpoint_calls_sentence(q, listed))
    # the handout's numbering and the device's name (a CPU's names its cores) are words of the sentence
    return Section([*checked, appendix("saved tensors: every case and mode", ctx.table("saved_tensors"))], table, checked, q.derived,
                   wording=("2026", "3.1", "3.2", *NUMBER.findall(device)))


def checkpointed_sentence(q: Quotes, mode: str = "eager") -> str:
    """What the handout's four_blocks_checkpoint keeps against four blocks without checkpointing, both counted
    per saved tensor, as the handout's hook counts (its 160.00 MiB): formulas over the saved-tensors table."""
    def kept(t: pd.DataFrame) -> float:
        return saved_mib(t, "four_blocks_checkpointed", mode, PER_TENSOR)

    def unchecked(t: pd.DataFrame) -> float:  # inputs and activations: the parameters are kept either way
        return saved_mib(t, "four_blocks", mode, PER_TENSOR[:2])

    return (f"Four blocks checkpointed as the handout's §3.2.1 does keep "
            f"{q.derive(kept, ',.2f', 'checkpointed four blocks, every saved tensor')} MiB for the backward, against "
            f"{q.derive(unchecked, ',.2f', 'four blocks, inputs and activations per tensor')} MiB of inputs and "
            f"activations for four blocks without checkpointing "
            f"({q.derive(lambda t: unchecked(t) / kept(t), ',.0f', 'unchecked over checkpointed')}× less; both "
            f"counted per tensor, as the handout's hook counts, {mode}).")


FOUR = 4  # the handout's four blocks (case four_blocks_checkpointed: two checkpoint calls of two blocks each)
FLOAT32, INT64 = 4, 8  # bytes of the hidden state's and the positions' elements (the fp32 run)


def _per_call(t: pd.DataFrame, mode: str) -> tuple[float, float]:
    """(hidden state MiB, positions tensor B) a checkpoint call saves: its inputs, a (batch, context, d_model)
    float32 tensor and the context's int64 positions, from the block row's settings cells."""
    row = t[(t["case"] == "four_blocks_checkpointed") & (t["mode"] == mode)].iloc[0]
    return (float(row["batch"] * row["context"] * row["d_model"] * FLOAT32 / 2**20),
            float(row["context"] * INT64))


def _calls(t: pd.DataFrame, mode: str) -> float:
    """How many checkpoint calls the checkpointed blocks' saved bytes hold: all they keep over one call's inputs."""
    hidden, positions = _per_call(t, mode)
    return saved_mib(t, "four_blocks_checkpointed", mode, PER_TENSOR) / (hidden + positions / 2**20)


def checkpoint_calls_sentence(q: Quotes, listed: pd.DataFrame, mode: str = "eager") -> str:
    """Why the checkpointed blocks keep what they keep: each checkpoint call saves its inputs (the hidden state
    and the positions tensor), so what they keep is a whole number of calls' inputs. The numbers are formulas
    over the table's cells; the saved-tensor list (one hidden state per call) must agree, or no number is said."""
    calls = _calls(q.frame, mode)
    rows = listed[(listed["case"] == "four_blocks_checkpointed") & (listed["mode"] == mode)]
    hidden, _ = _per_call(q.frame, mode)
    states = rows[rows["tensor_bytes"] == round(hidden * 2**20)]
    if not (abs(calls - round(calls)) < 1e-9 and len(states) == round(calls) and FOUR % round(calls) == 0):
        return ("The saved-tensor list does not account for that as whole checkpoint calls of the blocks' settings "
                f"(results/saved_tensors_list.csv, {mode}).")
    n = q.derive(lambda t: _calls(t, mode), ".0f", "checkpoint calls: kept over one call's inputs")
    return (f"The saved-tensor list shows what that is: {n} checkpoint calls of "
            f"{q.derive(lambda t: FOUR / _calls(t, mode), '.0f', 'blocks per checkpoint call')} blocks each, and "
            f"each call saves only its inputs, the hidden state ({n} × "
            f"{q.derive(lambda t: _per_call(t, mode)[0], ',.2f', 'hidden state MiB: batch × context × d_model')} "
            "MiB: batch × context × d_model float32 values, the blocks' input and the first call's output) and the "
            f"positions tensor ({n} × {q.derive(lambda t: _per_call(t, mode)[1], ',.0f', 'positions B')} B: the "
            "context's int64 positions).")


# ---- 3.2: activation checkpointing --------------------------------------------------------------------
def _sweep_points(frame: pd.DataFrame) -> pd.DataFrame:
    """The sweep's rows in policy order (none, every k ascending, nested), with segment_blocks as the
    block size (0 for none)."""
    order = {"none": 0, "every": 1, "nested": 2}
    return frame.assign(_o=frame["policy_kind"].map(order)).sort_values(["_o", "segment_blocks", "policy"]) \
        .drop(columns="_o")


SWEEP_SETTINGS = {"num_layers": "blocks", "batch_size": "batch", "context_length": "context"}


def checkpointing_table(frame: pd.DataFrame) -> NumericTable:
    """The sweep, one row per policy: median step, peaks and what a step starts with (a policy that did not
    run prints its status, '—' in the measured columns), beside the float32 weights and AdamW moments that
    the start must hold (model_state)."""
    rows = _sweep_points(frame)
    ok = rows["status"].eq("ok")
    data = pd.DataFrame({
        "policy": rows["policy"], "status": rows["status"], "block forwards per step": rows["block_forwards"],
        "step (ms, median)": rows["median_ms"].where(ok),
        "peak memory (GiB)": (rows["peak_memory_mib"] / GIB).where(ok),
        "peak by end of backward (GiB)": (rows["peak_fwd_bwd_mib"] / GIB).where(ok),
        "allocated at step start (GiB)": (rows["baseline_mib"] / GIB).where(ok),
        # not measured: what the step start must hold (every row, the sweep's one model)
        "weights + moments (GiB)": [model_state(row)[1] / GIB for _, row in rows.iterrows()],
        # the run's setting, which the prose states from these cells
        **{label: rows[column] for column, label in SWEEP_SETTINGS.items()}})
    gib = [c for c in data.columns if c.endswith("(GiB)")]
    return NumericTable(data, (Col("policy"), Col("status"), Col("block forwards per step", "d"),
                               Col("step (ms, median)", ".1f"), *(Col(c, ".2f") for c in gib),
                               *(Col(c, "d") for c in SWEEP_SETTINGS.values())))


def checkpointing_figure(frame: pd.DataFrame, path: str | Path) -> None:
    """Peak memory and step time (median, whisker ± std over the measured steps) against k for the
    'every k blocks' policies; out-of-memory points as red lines, no checkpointing as a grey level."""
    rows = _sweep_points(frame)
    every = rows[rows["policy_kind"] == "every"]
    none = rows[(rows["policy_kind"] == "none") & (rows["status"] == "ok")]
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.8))
    ok = every[every["status"] == "ok"]
    axes[0].plot(ok["segment_blocks"], ok["peak_memory_mib"] / GIB, marker="o", label="every k blocks")
    axes[1].errorbar(ok["segment_blocks"], ok["median_ms"], yerr=ok["std_ms"], marker="o", capsize=2,
                     label="every k blocks")
    for _, row in none.iterrows():
        axes[0].axhline(row["peak_memory_mib"] / GIB, color="grey", linestyle="--", label="no checkpointing")
        axes[1].axhline(row["median_ms"], color="grey", linestyle="--", label="no checkpointing")
    for k in every.loc[every["status"] == "oom", "segment_blocks"]:
        axes[0].axvline(k, color="tab:red", linestyle=":", label=f"every {k}: out of memory")
    measured = ok["peak_memory_mib"].notna().any()  # the CPU has no allocator statistics
    if not measured:
        axes[0].text(0.5, 0.5, "peak memory not measured on this device", transform=axes[0].transAxes,
                     ha="center", va="center", color="grey")
    axes[0].set(xscale="log" if measured else "linear", xlabel="blocks per checkpointed segment (k)",
                ylabel="peak memory (GiB)")
    axes[1].set(xscale="log", xlabel="blocks per checkpointed segment (k)",
                ylabel="step time (ms, median ± std)")
    axes[1].set_ylim(0, 1.15 * (ok["median_ms"] + ok["std_ms"]).max() if len(ok) else 1)
    for ax in axes if measured else axes[1:]:
        ax.set_xticks(list(every["segment_blocks"]), [str(k) for k in every["segment_blocks"]])
    handles = dict(zip(*reversed(axes[0].get_legend_handles_labels())))
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    first = frame.iloc[0]
    save_figure(fig, path, f"Checkpoint every k blocks: {first['size_table']} {first['size']}, batch "
                           f"{first['batch_size']}, context {first['context_length']}, {first['precision']}", frame)


def block_sizes(saved: NumericTable) -> tuple[float, float] | None:
    """(one block's residuals, one boundary) in MiB: the eager block's activations and input, each storage
    once, from the saved-tensors table (None where it has no eager block)."""
    if not saved.has(case="block", mode="eager"):
        return None
    return (saved.value(ACTIVATIONS, case="block", mode="eager"),
            saved.value("input (MiB, per storage)", case="block", mode="eager"))


COST_NS = (8, 32, 128, 512)  # the stack depths the cost model is evaluated at (powers of two: log2 N levels)
BLOCK, BOUNDARY, COST_PEAK, FORWARDS = ("block residuals (MiB)", "boundary (MiB)", "peak activations (GiB)",
                                        "block forwards / N")
NEGLIGIBLE = 0.05  # a share of the peak below which the prose calls stored boundaries nearly negligible
CHAIN_BOUNDARIES = 2  # what the chain stores besides one block's residuals: the stack's input and one hidden state


def cost_model_table(frame: pd.DataFrame) -> NumericTable:
    """(a): the cost model of model/checkpointing.py at the measured block and boundary sizes (results of
    3.1, the eager block), for several N: the modelled peak of activations and the block forwards per step,
    beside the two sizes it was evaluated at (printed as 3.1's table prints them)."""
    from cs336_systems.model.checkpointing import CheckpointPolicy, checkpoint_cost  # torch: this table's job only

    policies = {"none": lambda n: CheckpointPolicy(), "every block": lambda n: CheckpointPolicy.every(1),
                "sqrt (two levels)": CheckpointPolicy.sqrt, "recursive halving": CheckpointPolicy.binary}
    rows = []
    sizes = block_sizes(saved_tensors_table(frame))
    for n in COST_NS if sizes else ():
        for name, policy in policies.items():
            cost = checkpoint_cost(policy(n), n, *sizes)
            rows.append({"N": n, "policy": name, COST_PEAK: cost.peak_bytes / GIB, FORWARDS: cost.block_forwards / n,
                         BLOCK: sizes[0], BOUNDARY: sizes[1]})
    data = pd.DataFrame(rows, columns=["N", "policy", COST_PEAK, FORWARDS, BLOCK, BOUNDARY])
    return NumericTable(data, (Col("N", "d"), Col("policy"), Col(COST_PEAK, ".1f"), Col(FORWARDS, ".2f"),
                               Col(BLOCK, ",.2f"), Col(BOUNDARY, ",.2f")))


def _cost(t: pd.DataFrame, policy: str, n: int, column: str) -> float:
    """One cell of the cost-model table (its formula frame) by policy and N."""
    return float(t.loc[(t["policy"] == policy) & (t["N"] == n), column].iloc[0])


def _sizes(t: pd.DataFrame) -> tuple[float, float]:
    """(one block's residuals, one boundary) in MiB: the table's input columns (every row holds the same)."""
    return float(t[BLOCK].iloc[0]), float(t[BOUNDARY].iloc[0])


def modelled_boundaries(t: pd.DataFrame, n: int) -> float:
    """The boundaries recursive halving's modelled peak holds at N = n besides one block's residuals (the model
    counts two per level: the inner segment's first input again, though it is its parent's own)."""
    block, boundary = _sizes(t)
    return (_cost(t, "recursive halving", n, COST_PEAK) * GIB - block) / boundary


def distinct_boundaries(n: float) -> float:
    """Distinct boundaries recursive halving stores at its deepest point, N a power of two: the stack's input and
    one more per level (the start of each second half on the way down to the last block)."""
    return math.log2(n) + 1


def chain_saving(t: pd.DataFrame, n: int) -> float:
    """MiB fewer the chain stores than recursive halving at N = n: their distinct boundaries' difference."""
    return (distinct_boundaries(n) - CHAIN_BOUNDARIES) * _sizes(t)[1]


def halving_peak(t: pd.DataFrame, n: int) -> float:
    """Recursive halving's peak in MiB counting each stored boundary once: one block and the distinct boundaries."""
    block, boundary = _sizes(t)
    return block + distinct_boundaries(n) * boundary


COST_ANSWER = (
    "(a) Ignoring compute, the least peak is one block's residuals plus a constant number of boundaries (a "
    "boundary is the hidden state between two blocks, what a checkpoint call stores). A chain of nested "
    "checkpoints reaches it: checkpoint all blocks but the last, recursively, and the last on its own; the "
    "backward then stores only the stack's input and the input of the block being backpropagated, and replays "
    "the blocks before each block from the stack's input: O(1) peak memory for O(N^2) block forwards. Recursive "
    "halving gives back a little of that memory for much less compute: checkpoint the stack as two halves, each "
    "half as two quarters, and so on down to single blocks. Its backward stores at most two segment inputs per "
    "level (the segment being backpropagated and its earlier sibling, whose input is their parent's own, so "
    "log2 N + 1 distinct boundaries in all) plus the residuals of the one block being recomputed: O(1) blocks and "
    "O(log N) boundaries. Each level replays about half of each segment (torch's non-reentrant checkpoint stops "
    "recomputing once the backward has the tensors it needs, so a segment's second half, whose input is stored, "
    "is not rerun) and the innermost level every block once: N·(log2 N + 3)/2 block forwards for N a power of "
    "two, O(N log N).")


def _cost_model_numbers(q: Quotes) -> str:
    """(a) at 3.1's sizes: what the cost-model table shows of the two strategies (its cells and formulas)."""
    n, small = max(COST_NS), min(COST_NS)
    halving = {"policy": "recursive halving"}
    at_n = q.cell("N", N=n, **halving)
    modelled = q.derive(lambda t: modelled_boundaries(t, n), ".0f", f"modelled boundaries, recursive halving, N = {n}")
    distinct = q.derive(lambda t: distinct_boundaries(_cost(t, "recursive halving", n, "N")), ".0f",
                        f"distinct boundaries, recursive halving, N = {n}: log2 N + 1")
    peak = q.derive(lambda t: halving_peak(t, n) / GIB, ".2f", f"recursive halving's peak, each boundary once, N = {n}")
    fewer = q.derive(lambda t: chain_saving(t, n) / _sizes(t)[1], ".0f", f"boundaries the chain stores fewer, N = {n}")
    saving = q.derive(lambda t: chain_saving(t, n), ",.0f", f"MiB the chain stores fewer, N = {n}")
    share = q.derive(lambda t: 100 * chain_saving(t, n) / halving_peak(t, n), ".0f",
                     f"that saving over recursive halving's peak (each boundary once), N = {n}, %")
    verdict = ("here they are not quite" if chain_saving(q.frame, n) / halving_peak(q.frame, n) >= NEGLIGIBLE
               else "here they nearly are")
    return (f"At 3.1's sizes (eager, the handout's setting: one block's residuals {q.cell(BLOCK, 0)} MiB, one "
            f"boundary {q.cell(BOUNDARY, 0)} MiB, the table's last columns), the cost model of "
            "`cs336_systems.model.checkpointing` below gives recursive halving a peak of "
            f"{q.cell(COST_PEAK, N=n, **halving)} GiB at N = {at_n} against "
            f"{q.cell(COST_PEAK, N=n, policy='none')} GiB without checkpointing and "
            f"{q.cell(COST_PEAK, N=n, policy='every block')} GiB checkpointing every block, and block forwards per N "
            f"that rise by one per fourfold N ({q.cell(FORWARDS, N=small, **halving)} at "
            f"N = {q.cell('N', N=small, **halving)}, {q.cell(FORWARDS, N=n, **halving)} at N = {at_n}). Its peak is "
            f"one block and {modelled} boundaries, two per level: an upper bound, for the model counts each "
            f"parent's input again in its first half; counted once, the boundaries are {distinct} and the peak "
            f"{peak} GiB. The handout's assumption makes the boundaries negligible; {verdict}: the chain stores "
            f"{fewer} fewer at N = {at_n}, {saving} MiB ({share}% of recursive halving's peak). So the "
            "answer to the question as asked, compute ignored, is the chain; recursive halving, within O(log N) "
            "boundaries of it for O(N log N) block forwards, is the one we would run, and the one "
            "`CheckpointPolicy.binary(N)` builds and the table models.")


COST_SKETCH = (
    "Sketches of both (non-reentrant `torch.utils.checkpoint`; `run_blocks` applies a policy such as "
    "`CheckpointPolicy.binary(N)`):\n\n"
    "```python\n"
    "from torch.utils.checkpoint import checkpoint\n\n"
    "def chain(blocks, x):  # least memory: replays the prefix before each block's backward\n"
    "    if len(blocks) > 1:\n"
    "        x = checkpoint(chain, blocks[:-1], x, use_reentrant=False)\n"
    "    return checkpoint(blocks[-1], x, use_reentrant=False)\n\n"
    "def halving(blocks, x):  # O(log N) boundaries, O(N log N) block forwards\n"
    "    if len(blocks) == 1:\n"
    "        return blocks[0](x)\n"
    "    half = len(blocks) // 2\n"
    "    x = checkpoint(halving, blocks[:half], x, use_reentrant=False)\n"
    "    return checkpoint(halving, blocks[half:], x, use_reentrant=False)\n"
    "```")


def render_checkpoint_cost(ctx: Context) -> Section:
    """(a): the strategies in words (their constants are maths: O(1), N^2, the halving's forward count) and their
    numbers at 3.1's sizes from the cost-model table."""
    table = ctx.numeric("checkpoint_cost_model")
    q = Quotes(table)
    intro = ("Answers the 2026 handout, section 3.2 (gradient_checkpointing) (a), in the handout's model: N identical "
             "blocks, each saving its residuals for the backward unless a checkpoint call recomputes them.")
    checked = [intro, COST_ANSWER] + ([_cost_model_numbers(q)] if len(table) else [])
    # the handout's numbering and 3.1's, and the maths of the asymptotics and of the halving's forward count
    sketch = appendix_parts("gradient_checkpointing (a): the two policies in code", [COST_SKETCH])
    return Section([*checked, appendix("gradient_checkpointing (a): the cost model at every N", ctx.table("checkpoint_cost_model")), *sketch], table, [*checked, COST_SKETCH],
                   q.derived, wording=("2026", "3.2", "3.1", "1", "2", "3"))


def model_state(row: pd.Series) -> tuple[float, float]:
    """(parameters, MiB) of what a step of the sweep starts with besides activations: the float32 weights and
    AdamW's two moments (3 × 4 bytes per parameter). The gradients are not there: the sweep sets them to None
    before each step (bench/checkpointing.py), so they are part of the peak above the step's start."""
    params = parameter_count(get_config(row["size"], str(row["size_table"])))
    return params, 3 * 4 * params / 2**20


STEP_MS, PEAK, START, STATE = ("step (ms, median)", "peak memory (GiB)", "allocated at step start (GiB)",
                               "weights + moments (GiB)")


MOMENTS_AND_WEIGHTS = 3  # float32 copies a step starts with per parameter: the weights and AdamW's two moments


def swept_parameters(t: pd.DataFrame) -> float:
    """The swept model's parameter count, from its 'weights + moments' cell (3 float32 copies per parameter)."""
    return float(column_values(t, STATE).iloc[0]) * GIB * 2**20 / (MOMENTS_AND_WEIGHTS * FLOAT32)


def model_state_sentence(q: Quotes, ran: list[str]) -> str:
    """What every step starts with (the table's last columns), against the model state it must hold."""
    starts = {policy: q.table.value(START, policy=policy) for policy in ran}
    low, high = min(starts, key=starts.get), max(starts, key=starts.get)

    def others(t: pd.DataFrame) -> pd.Series:  # MiB allocated at the start besides weights and moments
        return (column_values(t, START) - column_values(t, STATE)) * GIB

    params = q.derive(swept_parameters, ",.0f", "parameters: weights + moments over 3 × 4 B")
    return (f"Every step starts with {q.cell(START, policy=low)}–{q.cell(START, policy=high)} GiB allocated (the "
            f"table's '{START}'): the float32 weights and AdamW's two moments of the model's {params} parameters, "
            f"{MOMENTS_AND_WEIGHTS} × {FLOAT32} B each = {q.cell(STATE, policy=low)} GiB, and "
            f"{q.derive(lambda t: others(t).min(), ',.0f', 'least MiB at step start besides the model state')}–"
            f"{q.derive(lambda t: others(t).max(), ',.0f', 'most MiB at step start besides the model state')} MiB "
            "of other buffers; the gradients are freed between steps. No activation policy touches that part of "
            "the peak.")


def _sweep_setting(table: NumericTable) -> str:
    """The sweep's blocks, batch and context, each a cell of the table where every row prints the same one."""
    said = {h: shared_cell(table, h) for h in SWEEP_SETTINGS.values()}
    if None in said.values():
        return "at each row's blocks, batch and context (the table's columns)"
    return f"({said['blocks']} blocks), batch {said['batch']}, context {said['context']}"


def _sweep_answer(q: Quotes, points: pd.DataFrame, first: pd.Series) -> str:
    """(b): which 'every k' checkpoints least, from the table's cells (`points`: the sweep's rows in the
    table's order, for each policy's kind and k)."""
    ran = points["status"].eq("ok")
    every = points[(points["policy_kind"] == "every") & ran]
    if not len(every) or all(pd.isna(q.table.value(PEAK, policy=p)) for p in every["policy"]):
        return ""
    names = list(every["policy"])
    best = min(names, key=lambda p: q.table.value(PEAK, policy=p))
    k = dict(zip(every["policy"], every["segment_blocks"]))
    below, above = [p for p in names if k[p] < k[best]], [p for p in names if k[p] > k[best]]
    neighbours = ([max(below, key=k.get)] if below else []) + ([min(above, key=k.get)] if above else [])
    around = ", ".join(f"{p}: {q.cell(PEAK, policy=p)} GiB" for p in neighbours)
    none = points[points["policy_kind"] == "none"]
    none_text = ("was not run" if not len(none) else "runs out of memory" if none["status"].iloc[0] == "oom"
                 else f"peaks at {q.cell(PEAK, policy=none['policy'].iloc[0])} GiB")

    def spread(t: pd.DataFrame) -> float:  # how far apart the 'every k' step times are, %
        steps = column_values(t, STEP_MS, lambda f: f["policy"].isin(names))
        return 100 * (steps.max() / steps.min() - 1)

    return (f"(b) {first['size_table']} {first['size']} {_sweep_setting(q.table)}, {first['precision']}, measured "
            f"on {first['device_name']}. With one "
            "level of recomputation every policy replays each block's forward once, so the block size changes "
            f"memory, not compute (the step times of every k differ by at most "
            f"{q.derive(spread, '.1f', 'spread of the every-k step times, %')}%). "
            "What a block stores for the backward (its attention scores and probabilities, the SwiGLU "
            "intermediates) dwarfs a checkpoint (one (batch, context, d_model) tensor), so the peak is set by the "
            "residuals of the one segment being recomputed, and the smallest segment wins: checkpoint every "
            f"block. Measured: {best} peaks at {q.cell(PEAK, policy=best)} GiB"
            + (f" ({around})" if around else "") + "; the peak grows with k because the recomputed segment's "
            f"residuals grow with it. Without checkpointing the step {none_text} on this GPU. "
            + model_state_sentence(q, list(points.loc[ran, "policy"])))


def render_checkpointing(ctx: Context) -> Section:
    frame = ctx.frame("checkpointing")
    table = ctx.numeric("checkpointing")
    q = Quotes(table)
    first = frame.iloc[0]
    intro = ("Answers the 2026 handout, section 3.2 (gradient_checkpointing) (b). Policies are applied to our "
             "`TransformerLM` from outside (`apply_activation_checkpointing`, non-reentrant "
             "`torch.utils.checkpoint`); tests check that gradients equal the unchecked model's bitwise in fp32.")
    points = _sweep_points(frame)
    checked = [p for p in [_sweep_answer(q, points, first)] if p]
    nested = points[(points["policy_kind"] == "nested") & points["status"].eq("ok")]
    if len(nested) and checked and table.has(policy="every:1") and pd.notna(table.value(PEAK, policy="every:1")):
        checked.append(nesting_sentence(q, list(nested["policy"])))
    # the handout's numbering, the size table's name, the device's name (a CPU's names its cores) and the
    # model state's 3 × 4 B per parameter are words of the sentence
    given = ("2026", "3.2", str(first["size_table"]), *NUMBER.findall(str(first["device_name"])),
             str(MOMENTS_AND_WEIGHTS), str(FLOAT32))
    return Section([intro, *checked, ctx.table("checkpointing"),
                    ctx.figure("checkpointing", "checkpoint block size")], table, [intro, *checked], q.derived,
                   wording=given)


def nesting_sentence(q: Quotes, nested: list[str]) -> str:
    """The nested policies against every:1: their cells, and how much less the best of them peaks (a formula)."""
    per = ", ".join(f"{p}: {q.cell(STEP_MS, policy=p)} ms, {q.cell(PEAK, policy=p)} GiB" for p in nested)

    def below_every_block(t: pd.DataFrame) -> float:  # GiB the lowest nested peak is under every:1's
        return float(column_values(t, PEAK, lambda f: f["policy"] == "every:1").iloc[0]
                     - column_values(t, PEAK, lambda f: f["policy"].isin(nested)).min())

    below = below_every_block(q.frame)
    bought = (f"buys at most {q.derive(below_every_block, '.2f', 'every:1 peak less the lowest nested peak, GiB')} "
              "GiB against every:1" if round(below, 2) > 0 else "buys no memory against every:1")
    return (f"Nesting costs compute ({per}) and {bought}. (a)'s cost model, which counts activations alone, "
            "predicts a larger saving, from the boundaries nesting does not store. The measured peak also holds the "
            "gradients, which "
            "the backward allocates block by block while it frees the stored boundaries; a peak late in the "
            "backward, where every policy holds few boundaries, would leave nesting little to save (the sweep "
            "records no timeline that shows where its peak falls).")


DELIVERABLES = [
    Deliverable("2026 §3.1 autograd residuals: saved tensors", "saved_tensors", render_saved_tensors,
                ("saved_tensors",),
                tables=(Table("saved_tensors", "saved_tensors", saved_tensors_table,
                              "MiB saved for backward, per saved tensor and per storage (2026 handout, 3.1)"),)),
    Deliverable("2026 §3.2 gradient_checkpointing (a)", "saved_tensors", render_checkpoint_cost, ("saved_tensors",),
                tables=(Table("checkpoint_cost_model", "saved_tensors", cost_model_table,
                              "The checkpointing cost model (cs336_systems.model.checkpointing) at the eager block's "
                              "measured residuals and boundary (2026 handout, 3.2 (a))"),)),
    Deliverable("2026 §3.2 gradient_checkpointing (b)", "checkpoint_sweep", render_checkpointing,
                ("checkpointing",),
                tables=(Table("checkpointing", "checkpointing", checkpointing_table,
                              "Step time and peak memory per checkpoint policy (2026 handout, 3.2 (b)); weights + "
                              "moments = 3 × 4 B per parameter, not measured"),),
                figures=(Figure("checkpointing", "checkpointing", checkpointing_figure),)),
]
