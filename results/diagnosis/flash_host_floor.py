"""Where the per-call floor of our attention goes at short sequences (issue #26's grid target).

    python results/diagnosis/flash_host_floor.py --out-dir DIR

`flash_llm_shapes` (0037fdf, H100) shows forward+backward of `flash_triton` at 1.0-1.1 ms eager and 1.8 ms
compiled wherever the problem is small (1 x 16 x 512-4096, d=128, causal), against cuDNN's 0.4-0.6 ms, and
the compiled call slower than the eager one. For a few such shapes this times, per variant (eager; compiled
with static shapes; compiled after it saw three shapes, as the bench's provider is, i.e. dynamic):
- the median device time of forward+backward (bench_ms, as the bench);
- host time per call: 200 calls issued with no synchronisation, then one; if host-bound, wall/200;
- a cProfile of 100 calls (top functions by own time) into DIR/profile_*.txt;
- on sm_90, at the shapes the Gluon backward runs at, the backward alone with its launches through FastLauncher
  and through Triton's public path (`gluon_backward_rows`);
- at the shapes FA2 runs at, eager forward and forward+backward with the per-call plans and the lean runner
  (`eager_plans`), with plans off (`eager_no_plans`: every call derives its launches, as before branch h-host2) and
  with Triton's own runner (`eager_triton_runner`): the A/B of kernels/NOTES.md, "Plan cache (branch h-host2)".
Rows go to DIR/host_floor.csv with provenance.
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time
from pathlib import Path
from unittest import mock

import torch

from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

SHAPES = [(1, 16, 1024, 128), (1, 16, 4096, 128), (2, 32, 4096, 128), (1, 16, 512, 64)]


def tensors(batch, heads, seq, dim):
    # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    return q, k, v, torch.randn_like(q)


def variants():
    eager = get_attention("flash_triton")
    static = torch.compile(get_attention("flash_triton"), dynamic=False)
    dynamic = torch.compile(lambda q, k, v, c: get_attention("flash_triton")(q, k, v, c))
    for shape in ((1, 4, 256, 64), (1, 4, 384, 64), (1, 4, 640, 64)):  # as the bench's provider: dynamic after 2
        q, k, v, do = tensors(*shape)
        dynamic(q, k, v, True).backward(do)
    return {"eager": eager, "compiled_static": static, "compiled_dynamic": dynamic}


def host_us(call, n=200):
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (issued - start) / n * 1e6, (end - start) / n * 1e6


def gluon_backward_rows(shape, prov) -> list[dict]:
    """The Gluon backward alone (sm_90, a shape it runs at), entered as the dispatch enters it (inputs checked
    already), with its two launches through FastLauncher (fast_launch on) and through Triton's public path (off):
    the A/B of the backward's launch path in one run (kernels/NOTES.md, "Host floor")."""
    from cs336_systems.kernels import flash_gluon, flash_gluon_bwd

    q, k, v, do = (t.detach() for t in tensors(*shape))
    o, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, True)
    rows = []
    for fast_launch in (True, False):
        def call(fast_launch=fast_launch):
            flash_gluon_bwd.flash_backward_gluon(q, k, v, o, do, lse, True, checked=True, fast_launch=fast_launch)

        device_ms = bench_ms(call, q.device, 200, 1000, min_calls=10)
        issue_us, wall_us = host_us(call)
        rows.append({"batch": shape[0], "heads": shape[1], "seq_len": shape[2], "head_dim": shape[3],
                     "variant": f"gluon_backward_{'fast' if fast_launch else 'public'}_launch", "pass": "backward",
                     "median_ms": device_ms, "issue_us_per_call": issue_us, "wall_us_per_call": wall_us, **prov})
        print({key: rows[-1][key] for key in ("seq_len", "variant", "median_ms", "issue_us_per_call")}, flush=True)
    return rows


@contextlib.contextmanager
def plan_variant(name: str):
    """The FA2 eager path as variant `name` runs it: "eager_plans" as shipped; "eager_no_plans" with no plan ever
    found or kept (each call derives its launches and goes through the FastLaunchers' keys); "eager_triton_runner"
    with the launchers' binaries called through Triton's `CompiledKernel[grid]` runner instead of launch.lean_runner."""
    from cs336_systems.kernels import flash_triton, launch

    patches = {"eager_plans": [],
               "eager_no_plans": [mock.patch.object(flash_triton, "_plan_for", lambda *args: None),
                                  mock.patch.object(flash_triton._Plan, "bind", lambda *args: None)],
               "eager_triton_runner": [mock.patch.object(launch, "lean_runner", lambda compiled, grid: compiled[grid])]}
    with contextlib.ExitStack() as stack:
        for patch in patches[name]:
            stack.enter_context(patch)
        for launcher in flash_triton.LAUNCH.values():  # (their plans too) remembered again at the next call
            launcher.clear()
        try:
            yield
        finally:
            for launcher in flash_triton.LAUNCH.values():
                launcher.clear()


def plan_rows(shape, prov) -> list[dict]:
    """Eager forward and forward+backward of FA2 (forced: CS336_FLASH_FORWARD/BACKWARD=triton) at `shape`, per
    plan_variant, in one run."""
    from cs336_systems.kernels.flash_triton import FlashAttentionTriton
    from cs336_systems.kernels.settings import use_flash_settings

    q, k, v, do = tensors(*shape)
    rows = []
    for name in ("eager_plans", "eager_no_plans", "eager_triton_runner"):
        with use_flash_settings(forward="triton", backward="triton"), plan_variant(name):
            def both():
                FlashAttentionTriton.apply(q, k, v, True).backward(do)
                q.grad = k.grad = v.grad = None

            def forward():
                with torch.no_grad():
                    FlashAttentionTriton.apply(q, k, v, True)

            for pass_, call in (("forward", forward), ("forward_backward", both)):
                device_ms = bench_ms(call, q.device, 200, 1000, min_calls=10)
                issue_us, wall_us = host_us(call)
                rows.append({"batch": shape[0], "heads": shape[1], "seq_len": shape[2], "head_dim": shape[3],
                             "variant": name, "pass": pass_, "median_ms": device_ms, "issue_us_per_call": issue_us,
                             "wall_us_per_call": wall_us, **prov})
                print({key: rows[-1][key] for key in ("seq_len", "variant", "pass", "median_ms", "issue_us_per_call")},
                      flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    out = Path(parser.parse_args().out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance("cuda")
    rows = []
    fns = variants()
    for shape in SHAPES:
        q, k, v, do = tensors(*shape)
        for name, fn in fns.items():
            def both():
                fn(q, k, v, True).backward(do)
                q.grad = k.grad = v.grad = None

            def forward():
                with torch.no_grad():
                    fn(q, k, v, True)

            for pass_, call in (("forward", forward), ("forward_backward", both)):
                device_ms = bench_ms(call, q.device, 200, 1000, min_calls=10)
                issue_us, wall_us = host_us(call)
                row = {"batch": shape[0], "heads": shape[1], "seq_len": shape[2], "head_dim": shape[3],
                       "variant": name, "pass": pass_, "median_ms": device_ms, "issue_us_per_call": issue_us,
                       "wall_us_per_call": wall_us, **prov}
                rows.append(row)
                print({k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items() if k in
                       ("seq_len", "heads", "batch", "head_dim", "variant", "pass", "median_ms",
                        "issue_us_per_call", "wall_us_per_call")}, flush=True)
                write_rows(rows, out / "host_floor.csv")
            if shape in (SHAPES[0], SHAPES[1]):
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(100):
                    both()
                torch.cuda.synchronize()
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
                text.write("\n\n--- by cumulative time ---\n")
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
                (out / f"profile_{name}_{shape[2]}x{shape[3]}.txt").write_text(text.getvalue())
    for shape in SHAPES:
        if shape[2] < 4096:  # where "auto" runs FA2 (flash_dispatch.GLUON_MIN_KEYS)
            rows += plan_rows(shape, prov)
            write_rows(rows, out / "host_floor.csv")
    if torch.cuda.get_device_capability() == (9, 0):  # where the Gluon backward runs
        for shape in SHAPES:
            if shape[2] >= 4096:  # the shapes "auto" gave it before the per-head-dim rules (GLUON_BACKWARD_RULES)
                rows += gluon_backward_rows(shape, prov)
                write_rows(rows, out / "host_floor.csv")


if __name__ == "__main__":
    main()
