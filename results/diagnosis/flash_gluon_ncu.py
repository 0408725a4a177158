"""Where the d=128 Gluon forward's time goes, by the hardware counters: tensor pipe, L2, DRAM (issue #26: d=128
forward at or below 0.9x cuDNN).

    python results/diagnosis/flash_gluon_ncu.py --out FILE.csv [--shapes 1x16x16384x128c ...]

The persistent forward runs a key step (a 128 x 128 tile of S and of P V per 128 query rows) in ~1.5-1.6 us per SM
(flash_gluon_tile_overhead.py), where the tensor cores' datasheet rate would take ~1.1-1.2 us. Each step also reads
64 KB of K and V (d=128, bf16) into shared memory: at that rate 132 SMs pull ~5.5 TB/s through L2, which might
be the ceiling instead of the tensor cores. (It is not: L2 ran at 48-60% of its peak, the tensor pipe at 77-80%;
kernels/NOTES.md, "Where the d=128 forward's time goes".)

For each shape this runs Nsight Compute (`--clock-control none`) on one call of ours' forward kernel and of
cuDNN's (`--providers ours cudnn`, the default), or on every kernel of one backward pass of each (`ours_bwd
cudnn_bwd`), in child processes, and records the counters below that this ncu knows. Beside them, two plain read
kernels give the ceilings on this machine: one re-reads a 16 MB buffer (held in L2) from every SM, the other
streams 2 GB (DRAM); their bytes over their do_bench time and their own counters say what "full" looks like.
Rows go to --out with provenance; ncu's raw CSV of each call goes beside it. (The two read kernels reached 1.8 TB/s
and 27% / 57% of ncu's L2 / DRAM peak at 996f91e: not ceilings. Read the attention kernels' percentages of ncu's own
peaks instead.)

Where a consumer warpgroup's time goes inside the key loop comes from ncu's warp-state sampling, one call per shape:

    ncu --clock-control none --profile-from-start off -k regex:flash_fwd_gluon -c 1 --section WarpStateStats \
        --section SourceCounters --section SchedulerStats -o REPORT \
        python3 flash_gluon_ncu.py --one 1x16x16384x128 ours
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv

and `--summarise-sampling SASS.csv[.gz] ... --out FILE.csv` splits each consumer's loop body (the instructions run
once per key step, found by the execution count of its HGMMAs) into the phases of a key step and gives each phase's
share of the warp's samples, with the shares of the busiest opcodes. The backward's kernel was sampled the same way
(`-k regex:flash_bwd_gluon`, `--one SHAPE ours_bwd`, with `--section MemoryWorkloadAnalysis_Tables` too);
`--summarise-opcodes` gives any kernel's busiest opcodes, `--summarise-wavefronts` its shared-memory wavefronts
and bank conflicts per opcode (from the same source page).
"""

import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flash_short_calls import parse_shape, tensors  # noqa: E402

SHAPES = ["1x16x16384x128c", "1x16x16384x128", "2x32x32768x128c", "2x32x4096x128c", "1x16x16384x64c"]
WISHLIST = [
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.avg.per_second",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "lts__t_bytes.sum.per_second",
    "lts__t_sector_hit_rate.pct",
    "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
]
KERNEL = {"ours": "regex:flash_fwd_gluon", "cudnn": "regex:sdpa|fprop|fmha", "l2_read": "regex:read_kernel",
          "dram_read": "regex:read_kernel", "ours_bwd": "regex:.", "cudnn_bwd": "regex:."}
BACKWARD = {"ours_bwd": "flash_triton", "cudnn_bwd": "sdpa_cudnn"}  # every kernel of one backward pass
L2_BYTES, DRAM_BYTES = 16 << 20, 2 << 30


@triton.jit
def read_kernel(x_ptr, out_ptr, n_elems, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program reads ITERS blocks, striding over x (wrapping), and writes one block of sums."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        start = ((pid + i * tl.num_programs(0)) * BLOCK) % n_elems
        acc += tl.load(x_ptr + start + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def read_call(buffer_bytes: int):
    """A call that reads ~2 GB in all (from a buffer of buffer_bytes), and the bytes it reads."""
    block, sms = 4096, torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.ones(buffer_bytes // 2, device="cuda", dtype=torch.bfloat16)
    grid = 4 * sms
    iters = max(1, (2 << 30) // (grid * block * 2))
    out = torch.empty(grid * block, device="cuda", dtype=torch.float32)

    def call():
        read_kernel[(grid, )](x, out, x.numel(), ITERS=iters, BLOCK=block, num_warps=8, num_stages=4)
    return call, grid * iters * block * 2


def attention_call(shape, provider: str):
    from cs336_systems.kernels import flash_gluon

    batch, heads, seq, dim, causal = shape
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))  # the model's layout
    if provider == "ours":
        return lambda: flash_gluon._forward(q, k, v, causal)
    return lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, causal, False)


def backward_call(shape, provider: str):
    """A call of the backward pass alone: the forward runs outside the profiled range (`prepare`)."""
    from cs336_systems.model.attention import get_attention

    *sizes, causal = shape
    fn = get_attention(BACKWARD[provider])
    q, k, v, grad = tensors(*sizes)  # the model's layout, q, k and v requiring grad
    return lambda: fn(q, k, v, causal), lambda out: torch.autograd.grad(out, (q, k, v), grad)


def one(shape_text: str, provider: str) -> None:
    """Child under ncu: two warm calls outside the profiled range, one inside it."""
    if provider in BACKWARD:
        prepare, backward = backward_call(parse_shape(shape_text), provider)
        backward(prepare()), backward(prepare())
        out = prepare()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        backward(out)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    if provider == "l2_read":
        call, _ = read_call(L2_BYTES)
    elif provider == "dram_read":
        call, _ = read_call(DRAM_BYTES)
    else:
        call = attention_call(parse_shape(shape_text), provider)
    call(), call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def known_metrics(ncu: str, out_dir: Path) -> list[str]:
    listing = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    (out_dir / "query_metrics.txt").write_text(listing)
    bases = {line.split()[0] for line in listing.splitlines() if line.strip() and "__" in line.split()[0]}
    return [m for m in WISHLIST if m.split(".")[0] in bases]


def profile(ncu: str, metrics: list[str], shape_text: str, provider: str, raw_path: Path) -> dict:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "-k", KERNEL[provider],
           "-c", "20" if provider in BACKWARD else "1",
           "--metrics", ",".join(metrics), "--csv", "--page", "raw",
           sys.executable, __file__, "--one", shape_text, provider]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    raw_path.write_text(done.stdout + "\n# stderr\n" + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith('"')]
    if done.returncode != 0 or len(lines) < 3:
        return {"status": f"ncu exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    header, units, *kernels = list(csv.reader(io.StringIO("\n".join(lines))))
    duration = header.index("gpu__time_duration.sum")
    times = [float(k[duration].replace(",", "")) for k in kernels]
    row = {"status": "ok", "kernel": "; ".join(f"{k[header.index('Kernel Name')][:80]} ({t / 1e3:.1f} us)"
                                              for k, t in zip(kernels, times))}
    for metric in metrics:  # several kernels (a backward pass): durations and bytes add, rates weigh by duration
        if metric in header:
            i = header.index(metric)
            values = [float(k[i].replace(",", "")) if k[i] else 0.0 for k in kernels]
            additive = metric.endswith(".sum") and not units[i].endswith("/s")
            row[metric] = sum(values) if additive else sum(v * t for v, t in zip(values, times)) / sum(times)
            row[metric + ".unit"] = units[i]
    return row


def opcodes(source):
    """The opcode of each SASS line of ncu's Source column (a predicate and the modifiers dropped)."""
    return source.str.strip().str.split().map(
        lambda parts: (parts[1] if parts[0].startswith("@") else parts[0]).split(".")[0])


def sampling_phases(path: Path) -> list[dict]:
    """Per consumer loop body in ncu's source page (SASS, with warp-state samples): the share of the body's samples in
    each phase of a key step, from the turn wait to the end of the softmax, and in each busy opcode."""
    import pandas as pd

    sass = pd.read_csv(path, skiprows=1)
    samples, executed = "Warp Stall Sampling (All Samples)", "Instructions Executed"
    text = sass["Source"].str.strip()
    hgmma = sass[text.str.contains("HGMMA", regex=False)]
    per_step = hgmma[executed].max()  # the key loop's HGMMAs run most often: once per key step
    loop = sass.index[sass[executed] == per_step]
    bodies, start = [], loop[0]
    for prev, cur in zip(loop[:-1], loop[1:]):
        if cur != prev + 1:
            bodies.append((start, prev))
            start = cur
    bodies.append((start, loop[-1]))
    rows = []
    for first, last in (b for b in bodies if b[1] - b[0] > 100):
        body = sass.loc[first:last]
        src = text.loc[first:last]
        total = body[samples].sum()
        gemms = body.index[src.str.contains("HGMMA", regex=False)]
        waits = body.index[src.str.contains("WARPGROUP.DEPBAR", regex=False)]
        phases = {"turn and K waits (loop top to the first HGMMA)": (first, gemms[0] - 1),
                  "S and P V issue (first to last HGMMA)": (gemms[0], gemms[-1]),
                  "turn arrive (last HGMMA to the S wait)": (gemms[-1] + 1, waits[0]),
                  "row max (S wait to the P V wait)": (waits[0] + 1, waits[1] - 1),
                  "P V wait": (waits[1], waits[1]),
                  "rest of the softmax (after the P V wait)": (waits[1] + 1, last)}
        row = {"file": Path(path).name, "body_first_address": sass.loc[first, "Address"], "samples": int(total)}
        row.update({name: body.loc[a:b, samples].sum() / total for name, (a, b) in phases.items()})
        row.update({f"opcode {op}": share for op, share in
                    (body.groupby(opcodes(src))[samples].sum() / total).sort_values(ascending=False).head(10).items()})
        rows.append(row)
    return rows


def sampling_opcodes(path: Path, top: int = 16) -> list[dict]:
    """Any kernel's ncu source page (SASS, with warp-state samples): each of the `top` busiest opcodes' share of all
    samples (idle warps' NOPs included: divide by the working warps' share to read it per working warp)."""
    import pandas as pd

    sass = pd.read_csv(path, skiprows=1)
    samples = sass["Warp Stall Sampling (All Samples)"]
    shares = (samples.groupby(opcodes(sass["Source"])).sum() / samples.sum()).sort_values(ascending=False).head(top)
    return [{"file": Path(path).name, "opcode": op, "share": share} for op, share in shares.items()]


def shared_wavefronts(path: Path) -> list[dict]:
    """Any kernel's ncu source page with the shared-memory table (`--section MemoryWorkloadAnalysis_Tables`): per
    opcode that touches shared memory, its instructions, wavefronts, ideal and excess wavefronts, and the excess as
    a share of all the kernel's shared wavefronts (bank conflicts, by instruction kind)."""
    import pandas as pd

    sass = pd.read_csv(path, skiprows=1)
    columns = {"Instructions Executed": "instructions", "L1 Wavefronts Shared": "wavefronts",
               "L1 Wavefronts Shared Ideal": "ideal", "L1 Wavefronts Shared Excessive": "excess"}
    counts = sass[list(columns)].apply(pd.to_numeric, errors="coerce").fillna(0).rename(columns=columns)
    counts["opcode"] = sass["Source"].str.strip().str.split().map(lambda p: p[1] if p[0].startswith("@") else p[0])
    per_op = counts[counts["wavefronts"] > 0].groupby("opcode").sum()
    total = per_op["wavefronts"].sum()
    return [{"file": Path(path).name, "opcode": op, **row.to_dict(),
             "wavefronts_per_instruction": row["wavefronts"] / row["instructions"],
             "excess_share_of_all": row["excess"] / total}
            for op, row in per_op.sort_values("wavefronts", ascending=False).iterrows()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="BxHxNxD[c] each")
    parser.add_argument("--ncu", default="ncu")
    parser.add_argument("--providers", nargs="+", default=["ours", "cudnn"], choices=["ours", "cudnn", *BACKWARD],
                        help="ours / cudnn: the forward kernels; ours_bwd / cudnn_bwd: every kernel of a backward")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the two read kernels")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "PROVIDER"), help=argparse.SUPPRESS)
    parser.add_argument("--summarise-sampling", nargs="+", type=Path, metavar="SASS_CSV",
                        help="ncu source pages (see above) to split into key-step phases; no GPU needed")
    parser.add_argument("--summarise-opcodes", nargs="+", type=Path, metavar="SASS_CSV",
                        help="ncu source pages of any kernel: the busiest opcodes' shares of the samples")
    parser.add_argument("--summarise-wavefronts", nargs="+", type=Path, metavar="SASS_CSV",
                        help="ncu source pages of any kernel: shared-memory wavefronts and bank conflicts per opcode")
    args = parser.parse_args()
    if args.one:
        one(*args.one)
        return
    if args.out is None:
        parser.error("--out is required")
    if args.summarise_sampling:
        write_rows([row for path in args.summarise_sampling for row in sampling_phases(path)], args.out)
        return
    if args.summarise_opcodes:
        write_rows([row for path in args.summarise_opcodes for row in sampling_opcodes(path)], args.out)
        return
    if args.summarise_wavefronts:
        write_rows([row for path in args.summarise_wavefronts for row in shared_wavefronts(path)], args.out)
        return
    for text in args.shapes:
        parse_shape(text)  # bad shapes fail before any profiling
    raw_dir = args.out.with_suffix("")
    raw_dir.mkdir(parents=True, exist_ok=True)
    prov = provenance("cuda")
    metrics = known_metrics(args.ncu, raw_dir)
    print("metrics:", metrics, flush=True)
    rows = []
    for provider, size in () if args.no_ceilings else (("l2_read", L2_BYTES), ("dram_read", DRAM_BYTES)):
        call, nbytes = read_call(size)
        ms = triton.testing.do_bench(call, warmup=50, rep=300)
        row = {"shape": f"{size >> 20} MB buffer", "provider": provider, "do_bench_ms": ms,
               "read_tb_per_s": nbytes / ms / 1e9,
               **profile(args.ncu, metrics, "-", provider, raw_dir / f"{provider}.csv"), **prov}
        print(row, flush=True)
        rows.append(row)
        del call
    for text in args.shapes:
        for provider in args.providers:
            row = {"shape": text, "provider": provider,
                   **profile(args.ncu, metrics, text, provider, raw_dir / f"{text}_{provider}.csv"), **prov}
            print(row, flush=True)
            rows.append(row)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
