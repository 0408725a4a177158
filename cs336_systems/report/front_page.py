"""The writeup's front page: what the report is, headline results (each a cell of a table further down, read from
the same numeric frame that table prints), contents, the model sizes of both handout editions with the names our
results use, where each problem sits in either edition, and the commands that rebuild the report.

The problem map and the handouts' size lists are facts of the two handouts (the 2025 one numbers its parts 1-3,
the 2026 one 2-9); everything else on the page is computed from the registry, the model configs and the results.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from cs336_systems.model.accounting import parameter_count
from cs336_systems.model.config import SIZE_TABLES, ModelConfig
from cs336_systems.report.section import Context, Deliverable
from cs336_systems.report.sections.leaderboard_steps import quoted_ours_at_leaderboard_batch
from cs336_systems.report.sections.leaderboard_verdict import verdict_median_at_leaderboard_batch

TITLES = ("Headline results", "Contents", "Model sizes of the two editions", "Problems in the two editions",
          "Rebuilding this report")


@dataclass(frozen=True)
class Headline:
    """One headline: the cell `header` of table `table` in the row whose key columns equal `keys` (or, with
    `row`, the row that function picks, for a table whose rows differ by scale, e.g. its largest model). Where
    `row` picks none (None) the headline is `instead`'s, if given."""
    what: str
    table: str
    header: str
    keys: dict = field(default_factory=dict)
    row: Callable[[pd.DataFrame], int | None] | None = None
    instead: Headline | None = None


def last_row(frame: pd.DataFrame) -> int:
    return len(frame) - 1


def _verdict_or_quoted_run(what: str, header: str, quoted_header: str | None = None) -> Headline:
    """An 8B-step headline: the verdict's median over its runs, or, before there is a verdict, the quoted run's."""
    quoted = Headline(what.format(of="in the quoted run", anchor="that run"), "leaderboard_8b",
                      quoted_header or header, row=quoted_ours_at_leaderboard_batch)
    return Headline(what.format(of="median over the verdict's runs", anchor="each run"), "leaderboard_8b_verdict",
                    header, row=verdict_median_at_leaderboard_batch, instead=quoted)


HEADLINES = (
    _verdict_or_quoted_run("the 2026 leaderboard's 8B step (batch 2 x 32,768 tokens), ours {of}: mean step (ms)",
                           "ours (ms)", "step (ms, mean ± std)"),
    _verdict_or_quoted_run("the same ({of}): ours ÷ the plain-PyTorch selective-checkpointing anchor of {anchor}",
                           "÷ SAC anchor"),
    _verdict_or_quoted_run("the same ({of}): model FLOPs utilization", "MFU"),
    Headline("the 2025 xl training step (median): ours ÷ the plain-PyTorch baseline of the same run",
             "baseline_timing", "÷ plain",
             {"size": "xl", "compiled": "model", "model": "ours", "weights": "bf16-master"}),
    Headline("the same, whole model compiled with CUDA graphs", "baseline_timing", "÷ plain",
             {"size": "xl", "compiled": "model-cudagraphs", "model": "ours", "weights": "bf16-master"}),
    Headline("bf16 autocast speed-up of a forward+backward step over fp32, largest size measured",
             "mixed_precision", "bf16 speed-up", row=last_row),
    Headline("our Triton FlashAttention-2 at the leaderboard shape: time ÷ SDPA's flash backend", "flash_leaderboard",
             "÷ SDPA flash", {"pass": "forward_backward", "provider": "flash_triton"}),
    Headline("training step of the 2026 xl (our 2.7B) without activation checkpointing", "checkpointing", "status",
             {"policy": "none"}),
    Headline("the same, every block checkpointed: peak memory (GiB)", "checkpointing", "peak memory (GiB)",
             {"policy": "every:1"}),
    Headline("LM head + cross-entropy, peak memory of forward+backward (MiB)", "linear_ce", "peak (MiB)",
             {"tokens": 32768, "provider": "fused"}),
    Headline("the same, compiled plain PyTorch", "linear_ce", "peak (MiB)",
             {"tokens": 32768, "provider": "plain_compiled"}),
    Headline("memory allocated per rank after init (MiB)", "fsdp", "allocated after init (MiB)",
             {"size": "2.7B", "precision": "bf16", "config": "fsdp"}),
    Headline("the same, our bucketed DDP", "fsdp", "allocated after init (MiB)",
             {"size": "2.7B", "precision": "bf16", "config": "bucketed:1000"}),
    Headline("all-reduce bus bandwidth (GB/s)", "allreduce", "busbw (GB/s)",
             {"backend": "nccl", "processes": 2, "size (MiB)": 1000}),
)


@dataclass(frozen=True)
class Problem:
    """A handout problem and its section in each edition (None where that edition lacks it); `match` finds the
    writeup sections that answer it (default: its name as a whole word of the section label)."""
    name: str
    in_2025: str | None
    in_2026: str | None
    match: str | None = None


CORRECTNESS = r"correctness of the DDP wrappers"
PROBLEMS = (
    Problem("benchmarking_script", "1.1.3", "2.1.3"),
    Problem("nsys_profile", "1.1.4", "2.1.4"),
    Problem("mixed_precision_accumulation", "1.1.5", "2.1.5"),
    Problem("benchmarking_mixed_precision", "1.1.5", "2.1.5", r"^1\.1\.5 \(|benchmarking_mixed_precision"),
    Problem("memory_profiling", "1.1.6", "2.1.6"),
    Problem("autograd residuals (saved tensors)", None, "3.1", r"^2026 §3\.1 "),
    Problem("gradient_checkpointing", None, "3.2"),
    Problem("pytorch_attention", "1.2.1", "4.1.1"),
    Problem("torch_compile", "1.3.1", "4.2", r"^1\.3\.1 "),
    Problem("flash_forward", "1.3.2", "4.2.2"),
    Problem("flash_backward", "1.3.2", "4.2.2"),
    Problem("flash_benchmarking", "1.3.2", "4.2.2", r"^1\.3\.2 \(e\)"),
    Problem("leaderboard (FlashAttention-2)", "1.3.3", None, r"^1\.3\.3"),
    Problem("distributed_communication_single_node", "2.1", "5.1"),
    Problem("naive_ddp", "2.2", "5.2", CORRECTNESS),
    Problem("naive_ddp_benchmarking", "2.2", "5.2"),
    Problem("minimal_ddp_flat_benchmarking", "2.3", "5.3.1"),
    Problem("ddp_overlap_individual_parameters", "2.3", "5.3.2", CORRECTNESS),
    Problem("ddp_overlap_individual_parameters_benchmarking", "2.3", "5.3.2"),
    Problem("ddp_overlap_bucketed", "2.3", None, CORRECTNESS),
    Problem("ddp_bucketed_benchmarking", "2.3", None),
    Problem("communication_accounting", "2.4", None),
    Problem("optimizer_state_sharding", "3", "6", CORRECTNESS),
    Problem("optimizer_state_sharding_accounting", "3", "6"),
    Problem("fsdp", None, "7", r"^2026 §7 fsdp:"),
    Problem("fsdp_accounting", None, "7"),
    Problem("alternate_ring_all_reduce", None, "8.1", r"^2026 §8 "),
    Problem("data_parallel_calcs", None, "8.2", r"^2026 §8 "),
    Problem("fsdp_calcs", None, "8.3", r"^2026 §8 "),
    Problem("tp_calcs", None, "8.4", r"^2026 §8 "),
    Problem("fsdp_tp_calcs", None, "8.4", r"^2026 §8 "),
    Problem("leaderboard (fastest training step)", None, "9", r"^2026 §9 "),
)

# The sizes each handout's table lists (the 2026 8B is its §9 leaderboard model); our tiny and mini are for CPU runs.
HANDOUT_SIZES = {"2025": ("small", "medium", "large", "xl", "2.7B"),
                 "2026": ("small", "medium", "large", "xl", "10B", "8B")}


def answering(problem: Problem, items: list[Deliverable]) -> list[Deliverable]:
    """The sections that answer `problem`, in writeup order."""
    pattern = problem.match or rf"(?<![\w-]){re.escape(problem.name)}(?![\w-])"
    return [item for item in items if re.search(pattern, item.section)]


def described(line: Headline) -> str:
    """The headline's words and the row it quotes (its key columns, as the table prints them)."""
    keys = "; ".join(f"{name}: {value}" for name, value in line.keys.items())
    return f"{line.what} ({keys})" if keys else line.what


def measured_rows(data: pd.DataFrame, keys: dict) -> pd.DataFrame:
    """The results rows a headline's table row comes from, as far as its keys are columns of the results file too
    (e.g. 'backend', 'provider'): their devices are the headline's."""
    for name, value in keys.items():
        if name in data:
            column = pd.to_numeric(data[name], errors="coerce") if isinstance(value, (int, float)) else data[name]
            data = data[column == value]
    return data


def _link(text: str, anchor: str) -> str:
    return f"[{text}](#{anchor})"


def _has_row(ctx: Context, line: Headline) -> bool:
    """Whether the headline's table is built and its `row` picks a row there."""
    built = (ctx.results / "tables" / f"{line.table}.json").exists()
    return built and (line.row is None or line.row(ctx.numeric(line.table).data) is not None)


def headline_table(ctx: Context, anchors: dict[str, str], owners: dict[str, Deliverable], device: str = "cuda") -> str:
    """The headlines as a Markdown table. A scale that measures on another device than the GPU (the CPU smoke scale)
    runs smaller grids: a headline whose row it lacks says so; on the GPU a missing row is an error."""
    rows = []
    for line in HEADLINES:
        if line.instead and not _has_row(ctx, line):
            line = line.instead
        owner = owners[line.table]
        where = _link(owner.section.split(":")[0], anchors[owner.section])
        data = ctx.frame(owner.tables[[t.name for t in owner.tables].index(line.table)].data)
        if data is None or not (ctx.results / "tables" / f"{line.table}.json").exists():
            rows.append((described(line), "pending", "—", where))
            continue
        table = ctx.numeric(line.table)
        if device != "cuda" and not line.row and not table.has(**line.keys):
            rows.append((described(line), f"not measured on the {device}", "—", where))
            continue
        row = line.row(table.data) if line.row else table.row(**line.keys)
        devices = sorted({str(d) for d in measured_rows(data, line.keys).get("device_name", pd.Series()).dropna()})
        rows.append((described(line), table.quote(line.header, row), ", ".join(devices) or "?", where))
    frame = pd.DataFrame(rows, columns=["result", "value", "device", "table in"])
    return frame.to_markdown(index=False, colalign=("left", "right", "left", "left"))


def contents(items: list[Deliverable], anchors: dict[str, str], heading: Callable[[Deliverable], str]) -> str:
    groups: dict[str, list[str]] = {}
    for item in items:
        edition = heading(item).split(" §")[0] if " §" in heading(item) else "beyond the handouts"
        groups.setdefault(edition, []).append(f"  - {_link(heading(item), anchors[item.section])}")
    lines = [f"- {_link(title, anchor)}" for title, anchor in anchors.items() if title in TITLES[:1] + TITLES[2:]]
    for edition, entries in groups.items():
        label = f"{edition} edition" if edition.isdigit() else edition
        lines += [f"- {label}", *entries]
    return "\n".join(lines)


def _size_row(name: str, config: ModelConfig, other: dict[str, ModelConfig]) -> dict:
    same = [n for n, c in other.items() if c == config]
    return {"size": name, "d_model": config.d_model, "d_ff": config.d_ff, "num_layers": config.num_layers,
            "num_heads": config.num_heads, "vocab": f"{config.vocab_size:,}",
            "parameters (M)": f"{parameter_count(config) / 1e6:,.0f}",
            "same model in the other edition": same[0] if same else "—"}


def size_tables() -> str:
    parts = []
    for edition, names in HANDOUT_SIZES.items():
        table, (other_edition, other) = SIZE_TABLES[edition], next(
            (e, t) for e, t in SIZE_TABLES.items() if e != edition)
        rows = [_size_row(name, table[name], {n: other[n] for n in HANDOUT_SIZES[other_edition]}) for name in names]
        parts.append(f"{edition} handout (our `get_config(size, edition=\"{edition}\")`):\n\n"
                     + pd.DataFrame(rows).to_markdown(index=False))
    ours = [n for n in SIZE_TABLES["2025"] if n not in HANDOUT_SIZES["2025"]]
    return ("Our results name a model by its 2025 size where the two editions share it, so the 2026 `xl` appears as "
            "`2.7B`; the 2026 `10B` and `8B` keep their names. " + "\n\n".join(parts)
            + f"\n\nOurs only, for the CPU smoke scale: {', '.join(f'`{n}`' for n in ours)}.")


def problem_map(items: list[Deliverable], anchors: dict[str, str]) -> str:
    rows = []
    for problem in PROBLEMS:
        found = answering(problem, items)
        links = ", ".join(_link(item.section.split(":")[0], anchors[item.section]) for item in found)
        rows.append({"problem": problem.name, "2025 §": problem.in_2025 or "—", "2026 §": problem.in_2026 or "—",
                     "answered in": links or "—"})
    return pd.DataFrame(rows).to_markdown(index=False)


def rebuild_commands(scale: str) -> str:
    config = f"scale={scale}"
    return "\n".join([
        "```bash",
        f"snakemake writeup --cores 2 --config {config} measure=false  # tables, figures, this report and its PDF",
        f"snakemake writeup --cores 2 --config {config} measure=false --forcerun table figure writeup_md"
        "  # after a change to the report code",
        f"snakemake submission --cores 2 --config {config} measure=false  # writeup.pdf and code.zip to hand in",
        f"snakemake writeup --cores all --resources gpu=1 --config {config}  # measure what is missing (one GPU)",
        "```",
    ])

