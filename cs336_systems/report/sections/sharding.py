"""Handout 3 (workflow/rules/distributed.smk, rule ddp_benchmark): optimizer-state sharding's memory and
step time against unsharded DDP and torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

from cs336_systems.distributed.sharded_optimizer import GATHER_BUCKET_MB
from cs336_systems.report import tables
from cs336_systems.report.section import Context, Deliverable, Table
from cs336_systems.report.sections.distributed import ddp_specs


def render_sharding(ctx: Context) -> str:
    frame = ctx.frame("sharding")
    ok = frame[frame["status"] == "ok"].set_index(["precision", "config"])
    specs = ddp_specs(frame)
    parts = []
    for precision in sorted(set(frame["precision"])):
        if not {(precision, "individual"), (precision, "individual+sharded")} <= set(ok.index):
            continue
        plain, sharded = ok.loc[(precision, "individual")], ok.loc[(precision, "individual+sharded")]
        text = (f"{precision}: peak memory {plain['peak_after_step_mib']:.0f} MiB without sharding and "
                f"{sharded['peak_after_step_mib']:.0f} MiB with ours "
                f"({sharded['peak_after_step_mib'] - plain['peak_after_step_mib']:+.0f} MiB). By the formula parameters "
                f"take {plain['param_mib']:.0f} MiB, gradients {plain['grad_mib']:.0f} MiB and AdamW's moments "
                f"{plain['optimizer_state_mib']:.0f} MiB, of which each rank keeps {sharded['optimizer_state_mib']:.0f} "
                f"MiB when sharded; the rest of the peak is activations and temporaries.")
        compared = [plain, sharded]
        if (precision, "torch_ddp+zero") in ok.index:
            zero = ok.loc[(precision, "torch_ddp+zero")]
            compared.append(zero)
            text += (f" torch's ZeroRedundancyOptimizer over torch DDP peaks at {zero['peak_after_step_mib']:.0f} MiB "
                     f"(torch DDP keeps its own gradient buckets besides the gradients; our bucketed wrapper "
                     f"makes the gradients views of its buckets). Step time (median): "
                     f"{sharded['step_median_ms']:.1f} ms for ours, {zero['step_median_ms']:.1f} ms for torch's "
                     f"({sharded['step_median_ms'] / zero['step_median_ms']:.2f}×), "
                     f"{plain['step_median_ms']:.1f} ms without sharding. The optimizer phase, where sharding acts "
                     f"(each rank updates its shard; ours then all-gathers the updated shards in chunks, torch's "
                     f"broadcasts each parameter from its owner), takes "
                     f"{sharded['optimizer_ms']:.1f} ms for ours, {zero['optimizer_ms']:.1f} ms for torch's and "
                     f"{plain['optimizer_ms']:.1f} ms unsharded.")
        else:
            text += (f" Step time (median) {plain['step_median_ms']:.1f} ms without and "
                     f"{sharded['step_median_ms']:.1f} ms with sharding.")
        for config in sorted(c for p, c in ok.index if p == precision and specs[c].optimizer_sharding == "sharded"
                             and c != "individual+sharded"):
            other = ok.loc[(precision, config)]
            compared.append(other)
            versus = ok.loc[(precision, "torch_ddp+zero")] if (precision, "torch_ddp+zero") in ok.index else None
            text += (f" With {specs[config].wrapper} DDP under our sharded optimizer: {other['step_median_ms']:.1f} ms"
                     + (f" ({other['step_median_ms'] / versus['step_median_ms']:.2f}× torch's)" if versus is not None
                        else "") + f", peak {other['peak_after_step_mib']:.0f} MiB.")
        if "step_round_median_min_ms" in ok:
            # ours against torch's (or against no sharding): apart only if their per-round medians are
            zero_key = (precision, "torch_ddp+zero")
            reference = ok.loc[zero_key] if zero_key in ok.index else plain
            apart = [row.name[1] for row in compared if specs[row.name[1]].optimizer_sharding == "sharded" and (
                row["step_round_median_min_ms"] > reference["step_round_median_max_ms"]
                or row["step_round_median_max_ms"] < reference["step_round_median_min_ms"])]
            text += (f" Against {reference.name[1]}, the per-round medians of "
                     + (f"{', '.join(apart)} do not overlap its own" if apart else "every sharded config overlap its own")
                     + " (ranges in the table).")
        else:
            spread = max(row["step_std_ms"] for row in compared)
            gap = max(row["step_median_ms"] for row in compared) - min(row["step_median_ms"] for row in compared)
            if gap < spread:
                text += (f" These step times differ by less than their step-to-step standard deviation (up to "
                         f"{spread:.1f} ms), so this run does not separate them.")
        parts.append(text)
    parts.append(
        "3(c): ours shards only the optimizer state (ZeRO stage 1): every rank still holds all parameters and "
        "all gradients, all-reduces full gradients (DDP) instead of reduce-scattering them, updates its shard "
        f"and then all-gathers the updated shards (in chunks of at most {GATHER_BUCKET_MB:.0f} MiB through two "
        "staging buffers), "
        "where ZeRO-1 as described by Rajbhandari et al. (2020) reduce-scatters gradients before the update, so "
        "that its communication volume equals plain data parallelism's; ours moves the gradients' volume twice "
        "(all-reduce) and the parameters' once. Shards here are whole parameters assigned greedily by size, not "
        "equal slices of a flat buffer, so they balance only approximately and the shorter shard is padded "
        "in the all-gather.")
    return "\n\n".join([*parts, ctx.table("sharding")])


DELIVERABLES = [
    Deliverable("3 optimizer_state_sharding_accounting (a–c)", "ddp_benchmark", render_sharding, ("sharding",),
                tables=(Table("sharding", "sharding", tables.sharding,
                              "Memory and step time with and without optimizer-state sharding"),)),
]
