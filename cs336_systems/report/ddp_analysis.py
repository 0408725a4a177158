"""The methods behind the DDP sections' text (handout 2.2–3): how the benchmark timed its phases, why
the rules run the rounds they do, the bucket-size model in words, and our model's gradient and bucket
counts. The cost models themselves are in analysis/ddp.py. Kept apart from report/sections/distributed.py,
which writes the sections from them."""

from __future__ import annotations

import pandas as pd

from cs336_systems.analysis.ddp import allreduce_burst_cost, allreduce_cost, optimal_bucket_bytes, rounds_needed
from cs336_systems.model import get_config
from cs336_systems.report.section import Context

# The command that reruns every two-GPU DDP table (the lead's rerun; one node with 2 GPUs).
# Targets come before --forcerun and --resources, which would take every word after them; the committed
# results exist, so their rules are forced; ddp_overlap reads the traces, which a run makes only with max_gpus=2.
RERUN = ("snakemake results/ddp_naive.csv results/ddp_individual.csv results/ddp_bucketed.csv results/sharding.csv "
         "results/ddp_overlap.csv --forcerun ddp_benchmark ddp_traces --cores 1 --resources gpu=2 --config max_gpus=2")

# How the other DDP paragraphs name that rerun: the command itself is given once, in naive DDP's timing note (the
# appendix block that `timing_note` fills).
RERUN_NAMED = "the two-GPU DDP rerun whose command naive DDP's timing note (appendix) gives"
TIMING_NOTE = "naive_ddp_benchmarking: how these rows were timed and compared"


def timing_method(frame: pd.DataFrame) -> str:
    """How the rows' phases were timed (the bench's `timer` column), for the setup paragraph; rows without the column
    predate it, and the setup then says so in a line (`timing_note` has the rest, for the appendix)."""
    timer = frame["timer"].dropna().iloc[0] if "timer" in frame and frame["timer"].notna().any() else None
    if timer == "cuda_events":
        return ("Phases are CUDA events on the compute stream with no synchronization between them: "
                "forward+backward ends when the compute stream has finished backward, and the communication wait "
                "is the compute stream's wait in finish_gradient_synchronization for the all-reduces still "
                "running, i.e. the communication left exposed.")
    if timer == "host_clock":
        return ("Phases are host clock readings (no GPU: CPU kernels are synchronous, gloo communicates on its "
                "own threads, so the time in finish_gradient_synchronization is the exposed wait).")
    return ("These rows predate the compute-stream events: their step times stand, their split into computation "
            "and exposed communication does not (why, and the rerun: the timing note in the appendix).")


def timing_note(frame: pd.DataFrame) -> str:
    """For the appendix: how rows without the `timer` column timed their phases and what the rerun will settle (for
    rows with it, the setup's `timing_method` says how), then why the text compares configs only within one table."""
    within = ("The text compares configs only within one table because the same config measured in another run "
              "(another table) can differ by more than the differences within a run.")
    if "timer" in frame and frame["timer"].notna().any():
        return within
    return ("Rows without compute-stream events ended forward+backward with a device-wide synchronize, which also "
            "waits for the NCCL stream, so all-reduces still running when backward ended were charged to "
            "forward+backward, and the overlapping wrappers' communication wait is near zero by construction. "
            "Their step times stand; how each step splits into computation and exposed communication waits for "
            f"the two-GPU rerun (pending: `{RERUN}`). " + within)


# The run that sets config.yaml's `ddp.rounds`: two configs close in speed in more interleaved rounds than the
# tables run (rule ddp_spread).
SPREAD = "ddp_spread"


def rounds_paragraph(ctx: Context, frame: pd.DataFrame) -> str:
    """Why the DDP rules run the rounds they do, computed from the round-to-round spread of rule ddp_spread's run."""
    spread = ctx.frame(SPREAD)
    if spread is None:
        return f"(The number of rounds is justified from `results/{SPREAD}.csv` (rule `ddp_spread`), absent here.)"
    need = rounds_needed(spread)
    (a, b), (sa, sb) = need["configs"], need["sigma_ms"]
    here = int(frame["rounds"].max()) if "rounds" in frame and frame["rounds"].notna().any() else 1
    short = "" if here >= need["rounds"] else ", so it separates only larger differences"
    return (f"How many rounds: in `results/{SPREAD}.csv` ({need['measured_rounds']} interleaved rounds "
            f"of {a} and {b}, {spread['precision'].iloc[0]}) the per-round medians vary with a standard deviation "
            f"of about {sa:.1f} and {sb:.1f} ms (range / d2). Two configs 5% apart ({need['difference_ms']:.1f} ms at their "
            f"{need['level_ms']:.1f} ms) are {need['z']:g} standard errors apart when "
            f"R ≥ ({need['z']:g}·√({sa:.1f}² + {sb:.1f}²) / {need['difference_ms']:.1f})², i.e. "
            f"{need['rounds']} rounds; config.yaml's `ddp.rounds` is at least that (a test checks it). This table's "
            f"run has {here}{short}.")


def _trainable_parameters(size: str) -> list:
    """The model's trainable parameters, built on the meta device (no memory, no initialisation)."""
    import torch  # here, not above: the report's table and figure jobs run without torch

    from cs336_systems.model import TransformerLM

    with torch.device("meta"):
        return [p for p in TransformerLM(get_config(size)).parameters() if p.requires_grad]


def gradient_tensors(size: str) -> int:
    """How many gradient tensors (all-reduces for naive DDP) the model has."""
    return len(_trainable_parameters(size))

def bucket_model(allreduce: pd.DataFrame | None, model_bytes: float, best_mb: dict[str, float] | None = None) -> str:
    """2.3(b): the overhead model, with o and w fitted to the measured all-reduce times (bursts of
    back-to-back calls where measured, else single calls), next to the best bucket size the sweep
    measured (`best_mb`: MB by precision)."""
    text = ("Model: n_b buckets of s/n_b bytes; computing a bucket's gradients takes as long as sending it, "
            "s/(n_b·w), and every all-reduce also costs o. Communication falls behind by o per bucket and the "
            "last bucket can only start when backward ends, so the time after backward is "
            "**overhead(n_b) = n_b·o + s/(n_b·w)**. Setting the derivative to zero gives "
            "**n_b\\* = √(s/(w·o))**, i.e. an optimal bucket size **b\\* = s/n_b\\* = √(s·w·o)**.")
    single, burst = allreduce_cost(allreduce), allreduce_burst_cost(allreduce)
    if single is None:
        return text
    o, w = single
    text += (f" Fitted to our NCCL all-reduce times, each call timed alone (2 ranks): o = {o * 1e6:.1f} µs, "
             f"w = {w / 1e9:.1f} GB/s; for the {model_bytes / 2**30:.2f} GiB of gradients this gives "
             f"b\\* = {optimal_bucket_bytes(model_bytes, o, w) / 2**20:.0f} MiB. A call timed alone pays its whole launch and "
             f"completion latency, which back-to-back calls overlap, so this o overstates the per-call cost (it "
             f"predicts naive DDP's wait too long, 2.2).")
    if burst is None:
        text += (" The per-call cost of back-to-back all-reduces, and the b\\* it gives, are pending "
                 "(`snakemake results/allreduce.csv --forcerun allreduce --cores 1 --resources gpu=2`, burst rows); the "
                 "sweep measures "
                 "250 and 500 MiB buckets around the optimum either fit gives.")
    else:
        ob, wb = burst
        text += (f" Fitted to bursts of back-to-back calls (time per call): o = {ob * 1e6:.1f} µs, "
                 f"w = {wb / 1e9:.1f} GB/s, b\\* = {optimal_bucket_bytes(model_bytes, ob, wb) / 2**20:.0f} MiB.")
    if best_mb:
        text += " Measured best of the sweep: " + ", ".join(f"{mb:g} MiB in {p}" for p, mb in best_mb.items()) + "."
    return text


def bucket_counts(size: str, sizes_mb: list[float]) -> dict[float, int]:
    """How many buckets bucketed DDP makes of the model's gradients at each bucket size (meta device)."""
    from cs336_systems.distributed.ddp_bucketed import plan_buckets  # torch, as in _trainable_parameters

    params = _trainable_parameters(size)
    return {mb: len(plan_buckets(params, mb)) for mb in sizes_mb}


def setup_as_in_naive(ctx: Context, frame: pd.DataFrame) -> str | None:
    """The DDP topic's setup is stated once, in 2.2 (naive): another table whose runs share every setting it names
    says so in a line (None where a setting differs, or this is the naive table)."""
    naive = ctx.frame("ddp_naive")
    settings = ["world_size", "backend", "size", "compile", "adamw", "batch_per_rank", "context_length", "warmup",
                "steps", "rounds", "timer"]
    if naive is None or frame is naive:
        return None
    values = lambda f, c: set(f[c].dropna().astype(str)) if c in f else None  # noqa: E731
    if any(values(frame, c) != values(naive, c) for c in settings):
        return None
    return ("Setup: as in 2025 §2.2 (the same ranks, model, compilation, optimizer, batch, context, rounds, steps and "
            "timing; the baselines ran in this table's run, and the text compares configs only within it).")


def fp32_overlap_causes() -> str:
    """The candidate causes of fp32_overlap_question and the measurement that tells them apart (for the appendix)."""
    return (
        "Candidate explanations, and the measurement that tells them apart (rule ddp_overlap on fp32 traces of "
        "none, naive, individual, bucketed and torch DDP, "
        "cs336_systems.report.traces, and the bench's compute-stream events): (a) the NCCL kernels share SMs and "
        "memory bandwidth with the backward's kernels and slow them down: the summed compute-kernel time in "
        "backward (`compute_kernel_ms_in_backward`) grows by about the communication time against `none`, while "
        "little communication is exposed (`exposed_in_backward_ms`); (b) they do not run beside the compute "
        "kernels at all (fp32's GEMMs occupy every SM, so a communication kernel waits for SMs): the communication "
        "falls into the gaps between compute kernels, exposed time ≈ communication time, compute-kernel time "
        "unchanged; (c) the host: each collective call costs CPU time on autograd's thread "
        "(`host_ms_per_collective`), which lengthens the step only if the GPU waits for the host "
        "(`gpu_busy_in_backward` well below one; the fp32 backward is expected to keep the GPU busy); (d) a tail: "
        "communication that can only start at the end of backward (`comm_after_backward_ms`, and the bench's "
        "communication wait). A second check of (a) against (b): rerun with NCCL limited to fewer SMs "
        "(`NCCL_MAX_CTAS`) and see whether torch DDP's forward+backward moves toward none's. The fp32 traces "
        f"and event timings are pending: {RERUN_NAMED}.")
