"""FlashAttention-2 benchmarks (handout 1.3.2(e) flash_benchmarking and 1.3.3 leaderboard).

`sweep`: batch 1, causal, every (sequence length, head dim, dtype), forward / backward /
forward+backward latency by `triton.testing.do_bench` (median ms) for each provider: our Triton FA2,
our PyTorch FA2 (up to --pytorch-max-seq), naive PyTorch attention, and PyTorch SDPA's flash and
cuDNN backends as anchors in the same run. A provider that does not support a case, or runs out of
memory, gives a row with that status.

Providers are the model's attention backends, by their registry names (cs336_systems.model.attention:
`sdpa_flash`, `sdpa_cudnn` are SDPA with one fused kernel forced), and each backend's `NAME_compiled`
(the backend under torch.compile): a new backend is a provider here with no edit.

`llm-shapes`: the shapes a Transformer's training step gives attention: batch x heads from 16 to 512,
sequences 512 to 32768, head dim 64 and 128, causal and not, bf16, inputs and dO laid out as a model makes
them ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)); our kernel eager and under
torch.compile (compiled for each point, static shapes: `point_calls`) beside SDPA's flash and cuDNN backends,
forward and forward+backward, the providers of a point taking turns in `--rounds` rounds (a row is the median of its
rounds).

`first-call`: the first forward+backward's time at the leaderboard shape in a fresh process, with an empty and
with a filled Triton cache (compile + autotune, then neither); CUDA only.

`leaderboard`: the handout's timing test exactly — q, k, v of shape (16, 16384, 64) bf16,
`torch.compile(FlashAttention2.apply)`, `o.sum().backward()`, `do_bench(rep=10000, warmup=1000)` —
for our Triton FA2 and, timed the same way in the same run, the SDPA flash and cuDNN backends.

    python -m cs336_systems.bench.flash_bench sweep --dtypes bf16 --head-dims 64 --out flash_sweep.csv
    python -m cs336_systems.bench.flash_bench llm-shapes --out flash_llm_shapes.csv
    python -m cs336_systems.bench.flash_bench first-call --out flash_first_call.csv
    python -m cs336_systems.bench.flash_bench leaderboard --out flash_leaderboard.csv

As a library: `sweep(SweepConfig(...))` yields each point's rows, `leaderboard(LeaderboardConfig())`
returns the leaderboard rows (provenance is added by `main`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton

from cs336_systems.analysis.attention_math import GEMMS, attention_flops
from cs336_systems.bench.checks import check_known, check_not_empty, check_positive
from cs336_systems.bench.cli import config_or_usage_error, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import PartialRows
from cs336_systems.timing import DTYPES, bench_ms, is_oom, oom_message, oom_row, resolve_device
from cs336_systems.model.attention import ATTENTION_BACKENDS, SDPA_KERNELS, AttentionFn, get_attention

COMPILED = "_compiled"  # a provider NAME_compiled is backend NAME under torch.compile


def known_providers() -> tuple[str, ...]:
    """Every provider this benchmark knows: each attention backend registered now, and its compiled form."""
    return (*ATTENTION_BACKENDS, *(name + COMPILED for name in ATTENTION_BACKENDS))


def provider_fn(provider: str, **compile_options) -> AttentionFn:
    """The call a provider times: its backend, compiled with `compile_options` for NAME_compiled (with none, one
    such call at many shapes recompiles dynamic from the second shape)."""
    fn = get_attention(provider.removesuffix(COMPILED))
    return torch.compile(fn, **compile_options) if provider.endswith(COMPILED) else fn


def point_calls(providers: tuple[str, ...]) -> dict[str, AttentionFn]:
    """The calls one point of a grid times: each backend as it is, and each NAME_compiled compiled afresh for the
    point with static shapes, as a model training at one shape compiles its attention (compiled once for all the
    points, the graph turns dynamic from the second). Dynamo's compiled code is reset first, so that no point runs
    a graph made for another."""
    if any(provider.endswith(COMPILED) for provider in providers):
        torch._dynamo.reset()
    return {provider: provider_fn(provider, dynamic=False) for provider in providers}


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


# The `tflops` column counts FlashAttention-2's convention (analysis.attention_math.GEMMS["convention"]) for
# every provider, so TFLOP/s compare as inverse times; `executed_tflops` counts what each one executes.


def executed_flops(provider: str, pass_: str, batch_heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs the provider's kernels execute (analysis.attention_math.GEMMS has each backend's count;
    NaN for one it does not know)."""
    backend = provider.removesuffix(COMPILED)
    if backend not in GEMMS:
        return float("nan")
    return attention_flops(backend, pass_, batch_heads, seq, head_dim, causal)


MIN_CALLS = 10  # the measuring window holds at least this many calls, however long one call is


def time_passes(fn: AttentionFn, q, k, v, causal: bool, warmup_ms: int, rep_ms: int) -> dict[str, float]:
    """Median ms of forward, backward (given a fixed dO) and forward+backward."""
    do = torch.randn_like(q)
    out = fn(q, k, v, causal)

    def backward():
        out.backward(do, retain_graph=True)

    def both():
        fn(q, k, v, causal).backward(do)

    forward = lambda: fn(q, k, v, causal)  # noqa: E731
    results = {}
    for name, call in (("forward", forward), ("backward", backward), ("forward_backward", both)):
        for t in (q, k, v):
            t.grad = None
        results[name] = bench_ms(call, q.device, warmup_ms, rep_ms, grad_to_none=[q, k, v], min_calls=MIN_CALLS)
    return results


def supported(provider: str, dtype: torch.dtype, seq: int, device: torch.device, pytorch_max_seq: int) -> str | None:
    """Why a provider is not run on a case, or None."""
    if provider in SDPA_KERNELS and device.type != "cuda":
        return "unsupported: CUDA only"
    if provider in SDPA_KERNELS and dtype == torch.float32:
        return "unsupported: 16-bit inputs only"
    if provider == "flash_pytorch" and seq > pytorch_max_seq:
        return f"skipped: Python tile loop beyond {pytorch_max_seq} tokens"
    return None


@dataclass(frozen=True)
class SweepConfig:
    """The latency grid: every (dtype, head dim, sequence length, provider), batch 1, causal."""

    seqs: tuple[int, ...] = tuple(2**i for i in range(7, 17))
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    providers: tuple[str, ...] = ("flash_triton", "flash_pytorch", "naive", "sdpa_flash", "sdpa_cudnn")
    pytorch_max_seq: int = 4096  # longest sequence for the PyTorch FA2 (its tile loop is Python)
    warmup_ms: int = 25
    rep_ms: int = 100
    device: str = "cuda"

    def __post_init__(self):
        for name in ("seqs", "head_dims", "dtypes", "providers"):
            check_not_empty(name, getattr(self, name))
        check_known("dtype", self.dtypes, DTYPES)
        check_known("provider", self.providers, known_providers())
        check_positive("sequence length", *self.seqs)
        check_positive("head dim", *self.head_dims)
        check_positive("PyTorch FA2 longest sequence", self.pytorch_max_seq)
        check_positive("warm-up time (ms)", self.warmup_ms)
        check_positive("repetition time (ms)", self.rep_ms)
        resolve_device(self.device)


@dataclass(frozen=True)
class LeaderboardConfig:
    """The handout's leaderboard case (its sizes are the defaults), for each provider; `compile` runs our
    Functions through torch.compile as the handout's test does."""

    providers: tuple[str, ...] = ("flash_triton", "sdpa_flash", "sdpa_cudnn")
    heads: int = 16
    seq_len: int = 16384
    head_dim: int = 64
    dtype: str = "bf16"
    compile: bool = True
    warmup_ms: int = 1000
    rep_ms: int = 10000
    device: str = "cuda"

    def __post_init__(self):
        check_not_empty("providers", self.providers)
        check_known("provider", self.providers, known_providers())
        check_known("dtype", [self.dtype], DTYPES)
        check_positive("heads", self.heads)
        check_positive("sequence length", self.seq_len)
        check_positive("head dim", self.head_dim)
        check_positive("warm-up time (ms)", self.warmup_ms)
        check_positive("repetition time (ms)", self.rep_ms)
        resolve_device(self.device)


def sweep(config: SweepConfig) -> Iterator[list[dict]]:
    """Each grid point's rows in turn: its three passes, or three rows that say why it did not run."""
    device = resolve_device(config.device)
    passes = ("forward", "backward", "forward_backward")
    grid = list(itertools.product(config.dtypes, config.head_dims, config.seqs, config.providers))
    for i, (dtype_name, head_dim, seq, provider) in enumerate(grid, 1):
        dtype = DTYPES[dtype_name]
        base = {"benchmark": "flash_sweep", "provider": provider, "dtype": dtype_name, "head_dim": head_dim,
                "seq_len": seq, "batch": 1, "causal": True}
        reason = supported(provider, dtype, seq, device, config.pytorch_max_seq)
        if reason:
            yield [{**base, "pass": p, "status": reason.split(":")[0], "note": reason} for p in passes]
            continue
        torch.cuda.empty_cache()
        times, failed = None, None
        try:
            q, k, v = (torch.randn(1, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            times = time_passes(provider_fn(provider), q, k, v, True, config.warmup_ms, config.rep_ms)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if is_oom(error):
                failed = [oom_row({**base, "pass": p}, error, message_column="note") for p in passes]
            elif "No available kernel" in str(error):  # an SDPA backend that does not take this case
                failed = [{**base, "pass": p, "status": "unsupported", "note": oom_message(error)} for p in passes]
            else:
                raise
        finally:
            q = k = v = None
        if failed:
            print(f"[{i}/{len(grid)}] {base}: {failed[0]['status']}", file=sys.stderr, flush=True)
            yield failed
            continue
        print(f"[{i}/{len(grid)}] {provider} {dtype_name} d={head_dim} n={seq}: "
              + " ".join(f"{p}={t:.3f}ms" for p, t in times.items()), file=sys.stderr, flush=True)
        yield [{**base, "pass": pass_, "median_ms": ms, "status": "ok",
                "tflops": tflops(attention_flops("convention", pass_, 1, seq, head_dim, True), ms),
                "executed_tflops": tflops(executed_flops(provider, pass_, 1, seq, head_dim, True), ms)}
               for pass_, ms in times.items()]


@dataclass(frozen=True)
class LlmShapesConfig:
    """The Transformer training grid: every (batch·heads, seq, head dim, causal) with batch·heads·seq at
    most `max_tokens`, heads per batch entry `heads_by_dim` (a model's head count at that head dim)."""

    batch_heads: tuple[int, ...] = (16, 64, 256, 512)
    seqs: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768)
    head_dims: tuple[int, ...] = (64, 128)
    causal: tuple[bool, ...] = (True, False)
    max_tokens: int = 2**21
    providers: tuple[str, ...] = ("flash_triton", "flash_triton_compiled", "sdpa_flash", "sdpa_cudnn")
    dtype: str = "bf16"
    warmup_ms: int = 25
    rep_ms: int = 100  # per provider and pass, over all rounds
    rounds: int = 3  # the providers of a point take turns, this many times (llm_shapes)
    device: str = "cuda"

    def __post_init__(self):
        for name in ("batch_heads", "seqs", "head_dims", "causal", "providers"):
            check_not_empty(name, getattr(self, name))
        check_known("provider", self.providers, known_providers())
        check_known("dtype", [self.dtype], DTYPES)
        check_positive("batch x heads", *self.batch_heads)
        check_positive("sequence length", *self.seqs)
        check_positive("head dim", *self.head_dims)
        check_positive("tokens", self.max_tokens)
        check_positive("rounds", self.rounds)
        check_positive("warm-up time (ms)", self.warmup_ms)
        check_positive("repetition time (ms)", self.rep_ms)
        resolve_device(self.device)

    def shapes(self) -> list[tuple[int, int, int, int, bool]]:
        """(batch, heads, seq, head dim, causal) of every point."""
        out = []
        for head_dim, seq, batch_heads, causal in itertools.product(self.head_dims, self.seqs, self.batch_heads,
                                                                    self.causal):
            if batch_heads * seq > self.max_tokens:
                continue
            heads = min(batch_heads, 32 if head_dim >= 128 else 16)
            out.append((batch_heads // heads, heads, seq, head_dim, causal))
        return out



def llm_shapes(config: LlmShapesConfig) -> Iterator[list[dict]]:
    """Each point's rows (forward and forward+backward per provider), or rows that say why it did not run.

    The providers of a point are timed in interleaved rounds (A B C D, A B C D, ...) on the same inputs, each round
    a `do_bench` of `rep_ms / rounds` holding at least `MIN_CALLS / rounds` calls, and a row's `median_ms` is the
    median of its rounds' medians: a slow stretch of the host or of the GPU's clocks then falls on every provider
    of the point alike, not on whichever provider it happened to run beside. `spread` is (largest - smallest round
    median) / median_ms."""
    device = resolve_device(config.device)
    dtype = DTYPES[config.dtype]
    rep_ms = config.rep_ms / config.rounds
    min_calls = -(-MIN_CALLS // config.rounds)
    shapes = config.shapes()
    for i, (batch, heads, seq, head_dim, causal) in enumerate(shapes, 1):
        shape = {"dtype": config.dtype, "batch": batch, "heads": heads, "seq_len": seq, "head_dim": head_dim,
                 "causal": causal, "do_layout": "model"}  # dO in the layout of q, k, v
        calls = point_calls(config.providers)
        failed: dict[str, tuple[str, str]] = {}  # provider -> (status, note): not run, or stopped by its error
        for provider in config.providers:
            reason = supported(provider.removesuffix(COMPILED), dtype, seq, device, seq)
            if reason:
                failed[provider] = (reason.split(":")[0], reason)
        rounds: dict[str, dict[str, list[float]]] = {p: {"forward": [], "forward_backward": []}
                                                     for p in config.providers}
        try:
            q, k, v = (torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
                       .requires_grad_() for _ in range(3))
            do = torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
            for _ in range(config.rounds):
                for provider in config.providers:
                    if provider not in failed:
                        error = _time_round(calls[provider], q, k, v, do, causal, device, config.warmup_ms, rep_ms,
                                            min_calls, rounds[provider])
                        if error:
                            failed[provider] = error
        except (torch.OutOfMemoryError, RuntimeError) as error:  # the inputs themselves
            if not is_oom(error):
                raise
            failed = {p: failed.get(p, ("oom", oom_message(error))) for p in config.providers}
        finally:
            q = k = v = do = None
        for provider in config.providers:
            row = {"benchmark": "flash_llm_shapes", "provider": provider, **shape}
            if provider.endswith(COMPILED):  # compiled for this point alone
                row["compiled_for"] = "point"
            if provider in failed:
                status, note = failed[provider]
                yield [{**row, "pass": p, "status": status, "note": note} for p in ("forward", "forward_backward")]
                continue
            times = {p: statistics.median(ms) for p, ms in rounds[provider].items()}
            print(f"[{i}/{len(shapes)}] {provider} b{batch} h{heads} n{seq} d{head_dim} causal={causal}: "
                  + " ".join(f"{p}={t:.3f}ms" for p, t in times.items()), file=sys.stderr, flush=True)
            yield [{**row, "pass": p, "median_ms": ms, "status": "ok", "rounds": config.rounds,
                    "spread": (max(rounds[provider][p]) - min(rounds[provider][p])) / ms,
                    "min_calls": min_calls * config.rounds,
                    "tflops": tflops(attention_flops("convention", p, batch * heads, seq, head_dim, causal), ms),
                    "executed_tflops": tflops(executed_flops(provider, p, batch * heads, seq, head_dim, causal), ms)}
                   for p, ms in times.items()]
        torch.cuda.empty_cache()


def _time_round(fn: AttentionFn, q, k, v, do, causal: bool, device: torch.device, warmup_ms: float, rep_ms: float,
                min_calls: int, into: dict[str, list[float]]) -> tuple[str, str] | None:
    """One round of a provider at a point: its forward and forward+backward medians appended to `into`; or
    (status, note) where it ran out of memory or its SDPA kernel does not take the case."""
    def forward():
        with torch.no_grad():
            fn(q, k, v, causal)

    def both():
        fn(q, k, v, causal).backward(do)

    try:
        for name, call in (("forward", forward), ("forward_backward", both)):
            into[name].append(bench_ms(call, device, warmup_ms, rep_ms, grad_to_none=[q, k, v], min_calls=min_calls))
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error) and "No available kernel" not in str(error):
            raise
        for t in (q, k, v):
            t.grad = None
        return ("oom" if is_oom(error) else "unsupported"), oom_message(error)
    return None


_FIRST_CALL = """
import sys, time, torch
from cs336_systems.kernels import FlashAttentionTriton
b, h, n, d = (int(x) for x in sys.argv[1:5])
q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
           for _ in range(3))
torch.cuda.synchronize()
start = time.perf_counter()
FlashAttentionTriton.apply(q, k, v, True).sum().backward()
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


FIRST_CALL_SHAPE = (1, 16, 16384, 64)  # (batch, heads, seq, head dim): the leaderboard's case


def first_call_rows(shape: tuple[int, int, int, int]) -> list[dict]:
    """Seconds of the first forward+backward at `shape` (causal, bf16) in a fresh process: with an empty
    Triton cache (every kernel compiled and every tile config timed) and again with the cache that run
    filled (compiled kernels and autotuning results read from disk)."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        for state in ("cold", "warm"):
            done = subprocess.run([sys.executable, "-c", _FIRST_CALL, *map(str, shape)], env=env, check=True,
                                  capture_output=True, text=True)
            seconds = float(done.stdout.strip().splitlines()[-1])
            rows.append({"benchmark": "flash_first_call", "provider": "flash_triton", "batch": shape[0],
                         "heads": shape[1], "seq_len": shape[2], "head_dim": shape[3], "causal": True,
                         "triton_cache": state, "first_call_s": seconds, "status": "ok"})
            print(f"first call, {state} cache: {seconds:.1f} s", file=sys.stderr, flush=True)
    return rows


def leaderboard(config: LeaderboardConfig) -> list[dict]:
    """The handout's leaderboard test, verbatim in substance, per provider (defaults: its sizes)."""
    device = resolve_device(config.device)
    n_heads, d_head, seq = config.heads, config.head_dim, config.seq_len
    rows = []
    for provider in config.providers:
        torch.manual_seed(0)
        q, k, v = torch.randn(3, n_heads, seq, d_head, device=device, dtype=DTYPES[config.dtype], requires_grad=True)
        fn = provider_fn(provider)
        # As the handout's test: our Functions go through torch.compile; SDPA is called as it is.
        flash = torch.compile(fn) if provider.startswith("flash") and config.compile else fn

        def flash_forward_backward():
            o = flash(q, k, v, True)
            loss = o.sum()
            loss.backward()

        def flash_forward():
            with torch.no_grad():
                flash(q, k, v, True)

        note = ""
        try:
            flash_forward_backward()
        except Exception as error:  # noqa: BLE001 — record why, then time the uncompiled Function
            if flash is fn:
                raise
            note = f"torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0][:120]}); eager"
            flash = fn
        for pass_, call in (("forward_backward", flash_forward_backward), ("forward", flash_forward)):
            ms = bench_ms(call, device, config.warmup_ms, config.rep_ms) if device.type != "cuda" else \
                triton.testing.do_bench(call, rep=config.rep_ms, warmup=config.warmup_ms)  # the handout's call: mean
            flops = attention_flops("convention", pass_, n_heads, seq, d_head, True)
            rows.append({"benchmark": "leaderboard", "provider": provider, "dtype": config.dtype, "head_dim": d_head,
                         "seq_len": seq, "batch": 1, "heads": n_heads, "causal": True, "pass": pass_,
                         "compiled": flash is not fn,
                         "mean_ms": ms, "tflops": flops / ms / 1e9, "rep_ms": config.rep_ms,
                         "warmup_ms": config.warmup_ms, "status": "ok", "note": note})
            print(f"leaderboard {provider} {pass_}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)",
                  file=sys.stderr, flush=True)
    return rows


PROVIDERS_HELP = ("attention implementations to time: backends of cs336_systems.model.attention, NAME_compiled "
                  "for one under torch.compile (%(choices)s)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sw = sub.add_parser("sweep", help="latency grid over sequence length, head dim and dtype")
    sw.add_argument("--seqs", nargs="+", type=positive_int, default=[2**i for i in range(7, 17)],
                    help="sequence lengths, one point each")
    sw.add_argument("--head-dims", nargs="+", type=positive_int, default=[16, 32, 64, 128],
                    help="head dimensions, one point each")
    sw.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES), help="input dtypes")
    sw.add_argument("--providers", nargs="+", default=list(SweepConfig.providers), choices=known_providers(),
                    help=PROVIDERS_HELP)
    sw.add_argument("--pytorch-max-seq", type=positive_int, default=4096,
                    help="longest sequence for the PyTorch FA2")
    sw.add_argument("--warmup-ms", type=positive_int, default=25, help="do_bench warm-up time per pass")
    sw.add_argument("--rep-ms", type=positive_int, default=100, help="do_bench measuring time per pass")
    ls = sub.add_parser("llm-shapes", help="Transformer training shapes, ours eager and compiled against SDPA")
    ls.add_argument("--batch-heads", nargs="+", type=positive_int, default=[16, 64, 256, 512],
                    help="batch x heads values")
    ls.add_argument("--seqs", nargs="+", type=positive_int, default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                    help="sequence lengths")
    ls.add_argument("--head-dims", nargs="+", type=positive_int, default=[64, 128], help="head dimensions")
    ls.add_argument("--causal", nargs="+", default=["on", "off"], choices=["on", "off"], help="causal masking")
    ls.add_argument("--max-tokens", type=positive_int, default=2**21,
                    help="largest batch x heads x seq (bounds a point's time and memory)")
    ls.add_argument("--providers", nargs="+", default=list(LlmShapesConfig.providers), choices=known_providers(),
                    help=PROVIDERS_HELP)
    ls.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype")
    ls.add_argument("--warmup-ms", type=positive_int, default=25, help="do_bench warm-up time per pass")
    ls.add_argument("--rep-ms", type=positive_int, default=100,
                    help="do_bench measuring time per pass, over all rounds (grown to hold 10 calls)")
    ls.add_argument("--rounds", type=positive_int, default=LlmShapesConfig.rounds,
                    help="the providers of a point take turns this many times; a row is its rounds' median")
    lb = sub.add_parser("leaderboard", help="the handout's leaderboard timing test")
    lb.add_argument("--providers", nargs="+", default=list(LeaderboardConfig.providers), choices=known_providers(),
                    help=PROVIDERS_HELP)
    lb.add_argument("--heads", type=positive_int, default=16, help="attention heads (the batch of the case)")
    lb.add_argument("--seq-len", type=positive_int, default=16384, help="sequence length")
    lb.add_argument("--head-dim", type=positive_int, default=64, help="head dimension")
    lb.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype")
    lb.add_argument("--compile", default="on", choices=["on", "off"], help="torch.compile our Functions")
    lb.add_argument("--warmup-ms", type=positive_int, default=1000, help="do_bench warm-up time per pass")
    lb.add_argument("--rep-ms", type=positive_int, default=10000, help="do_bench measuring time per pass")
    fc = sub.add_parser("first-call", help="the first call's seconds in a fresh process, cold and warm Triton cache")
    for p in (sw, ls, lb, fc):
        p.add_argument("--device", default="cuda", help="cuda (the benchmark's device) or cpu (a smoke run)")
        p.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    if args.command == "first-call" and args.device != "cuda":
        parser.error(f"first-call times Triton's compile and autotuning on a GPU: it needs --device cuda, "
                     f"not {args.device!r}")
    if args.command == "sweep":
        config = config_or_usage_error(
            parser, SweepConfig, seqs=tuple(args.seqs), head_dims=tuple(args.head_dims), dtypes=tuple(args.dtypes),
            providers=tuple(args.providers), pytorch_max_seq=args.pytorch_max_seq, warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms, device=args.device)
    elif args.command == "llm-shapes":
        config = config_or_usage_error(
            parser, LlmShapesConfig, batch_heads=tuple(args.batch_heads), seqs=tuple(args.seqs),
            head_dims=tuple(args.head_dims), causal=tuple(c == "on" for c in args.causal), max_tokens=args.max_tokens,
            providers=tuple(args.providers), dtype=args.dtype, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
            rounds=args.rounds, device=args.device)
    elif args.command == "leaderboard":
        config = config_or_usage_error(
            parser, LeaderboardConfig, providers=tuple(args.providers), heads=args.heads, seq_len=args.seq_len,
            head_dim=args.head_dim, dtype=args.dtype, compile=args.compile == "on", warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms, device=args.device)
    else:
        resolve_device(args.device)
        config = None
    from cs336_systems.kernels.flash import flash_settings  # after the device check (it imports triton)

    prov = {**provenance(args.device), "float32_dot": flash_settings().float32_dot}  # how our kernels multiplied float32 inputs
    rows = PartialRows(args.out)  # a cut sweep keeps its finished points in OUT.partial
    points = {"sweep": sweep, "llm-shapes": llm_shapes, "leaderboard": lambda c: [leaderboard(c)],
              "first-call": lambda c: [first_call_rows(FIRST_CALL_SHAPE)]}[args.command]
    for point in points(config):
        rows.add({**row, **prov} for row in point)
    rows.finish()


if __name__ == "__main__":
    main()
