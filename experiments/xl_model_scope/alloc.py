# scratch: per-phase cudaMalloc/cudaFree counts at the xl model-scope step (issue 62)
import sys, torch
from cs336_systems.bench import e2e
orig = e2e.timed
log = []
def timed(fn, device):
    a = torch.cuda.memory_stats(); t = orig(fn, device); b = torch.cuda.memory_stats()
    log.append((fn.__name__ if hasattr(fn, "__name__") else "?", round(t, 2), b.get("num_device_alloc", 0) - a.get("num_device_alloc", 0),
                b.get("num_device_free", 0) - a.get("num_device_free", 0), b.get("num_alloc_retries", 0) - a.get("num_alloc_retries", 0)))
    return t
e2e.timed = timed
e2e.main(sys.argv[1:])
for i in range(0, len(log), 3):
    print(log[i:i + 3])
