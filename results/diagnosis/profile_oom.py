"""Why did 2.7B at context 512, fp32, run out of memory in 1.1.4's profile but peak at ~65 GB in 1.1.6 on the
same H100 (same commit, same batch 4, same AdamW)? Hypothesis, from reading both harnesses: the profile
harness re-ran each forward pass for the profiler while the timed pass's loss (and so its whole autograd
graph) was still held, two graphs at once on top of weights and AdamW state; and before the profiled
backward it re-ran the forward with the timed backward's gradients still allocated. The memory harness
runs each phase once.

This runs the point three ways in one process, each after freeing the last, and writes one row per run
with the peak of each phase (or the OOM):
  profile, hold_previous_graph   the first 1.1.4 harness (`--hold-previous-graph`)
  profile, fixed                 the harness now: the previous loss dropped, gradients freed before the re-forward
  memory harness                 1.1.6's training step (bench.e2e, one measured step after 2 warm-up)

    PYTHONPATH=$PWD python results/diagnosis/profile_oom.py --out results/diagnosis/profile_oom.csv

(about a minute on an H100; `--size tiny --context-length 32 --device cpu` checks it on a CPU.) The 1.1.4
section of the writeup reads the CSV and says which run ran out of memory.
"""

import argparse
import sys

import pandas as pd

from cs336_systems.bench import e2e
from cs336_systems.bench.profile import ProfileConfig, profile_rows
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import reset_memory, resolve_device

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--size", default="2.7B")
parser.add_argument("--context-length", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--device", default="cuda")
parser.add_argument("--out", required=True)
args = parser.parse_args()
device = resolve_device(args.device)
point = {"size": args.size, "context_length": args.context_length, "batch_size": args.batch_size,
         "precision": "fp32"}
rows = []
for hold in (True, False):
    reset_memory(device)
    config = ProfileConfig(sizes=(args.size,), context_lengths=(args.context_length,), batch_size=args.batch_size,
                           warmup=2, steps=1, device=args.device, tool="torch", hold_previous_graph=hold)
    found = pd.DataFrame(profile_rows(config))
    harness = found[found["kind"] == "harness"].set_index("phase")["peak_memory_mib"] if "kind" in found and "phase" in found else {}
    rows.append({"run": "profile, hold_previous_graph" if hold else "profile, fixed", **point,
                 "status": found["status"].iloc[0], "error": found.get("error", pd.Series([""])).iloc[0],
                 **{f"{phase} peak (MiB)": harness.get(phase) for phase in ("forward", "backward", "optimizer")}})
    print(rows[-1], file=sys.stderr, flush=True)
reset_memory(device)
spec = e2e.RunSpec(size=args.size, mode="train_step", precision="fp32", attention="naive",
                   batch_size=args.batch_size, context_length=args.context_length, warmup=2, steps=1,
                   device=args.device)
step = [r for r in e2e.run(spec) if r["phase"] == "step"][0]
rows.append({"run": "memory harness", **point, "status": step["status"], "error": step.get("error", ""),
             "step peak (MiB)": step.get("peak_memory_mib")})
print(rows[-1], file=sys.stderr, flush=True)
write_rows([{**row, **provenance(args.device)} for row in rows], args.out)
