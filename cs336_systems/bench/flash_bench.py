"""FlashAttention-2 benchmarks (handout 1.3.2(e) flash_benchmarking and 1.3.3 leaderboard).

`sweep`: batch 1, causal, every (sequence length, head dim, dtype), forward / backward /
forward+backward latency by `triton.testing.do_bench` (median ms) for each provider: our Triton FA2,
our PyTorch FA2 (up to --pytorch-max-seq), naive PyTorch attention, and PyTorch SDPA's flash and
cuDNN backends as anchors in the same run. A provider that does not support a case, or runs out of
memory, gives a row with that status.

`leaderboard`: the handout's timing test exactly — q, k, v of shape (16, 16384, 64) bf16,
`torch.compile(FlashAttention2.apply)`, `o.sum().backward()`, `do_bench(rep=10000, warmup=1000)` —
for our Triton FA2 and, timed the same way in the same run, the SDPA flash and cuDNN backends.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterator

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import PartialRows
from cs336_systems.bench.timing import DTYPES, bench_ms, is_oom, resolve_device
from cs336_systems.kernels import FlashAttentionPytorch, FlashAttentionTriton
from cs336_systems.model.attention import naive_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _sdpa(backend: SDPBackend) -> Attention:
    def attention(q, k, v, is_causal):
        # The fused backends need (batch, heads, n, d): a 3-d input is viewed as one batch of heads.
        view = q.dim() == 3
        if view:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return out.squeeze(0) if view else out

    return attention


PROVIDERS: dict[str, Attention] = {
    "flash_triton": FlashAttentionTriton.apply,
    "flash_pytorch": FlashAttentionPytorch.apply,
    "naive": naive_attention,
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
}


def attention_flops(batch_heads: int, seq: int, head_dim: int, causal: bool, pass_: str) -> float:
    """Matmul FLOPs: forward 2 products (QKᵀ, PV), backward 5 (with S recomputed), halved if causal."""
    forward = 4 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return {"forward": forward, "backward": 2.5 * forward, "forward_backward": 3.5 * forward}[pass_]


def time_passes(fn: Attention, q, k, v, causal: bool, warmup_ms: int, rep_ms: int) -> dict[str, float]:
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
        results[name] = bench_ms(call, q.device, warmup_ms, rep_ms, grad_to_none=[q, k, v])
    return results


def supported(provider: str, dtype: torch.dtype, seq: int, device: torch.device, pytorch_max_seq: int) -> str | None:
    """Why a provider is not run on a case, or None."""
    if provider in ("sdpa_flash", "sdpa_cudnn") and device.type != "cuda":
        return "unsupported: CUDA only"
    if provider in ("sdpa_flash", "sdpa_cudnn") and dtype == torch.float32:
        return "unsupported: 16-bit inputs only"
    if provider == "flash_pytorch" and seq > pytorch_max_seq:
        return f"skipped: Python tile loop beyond {pytorch_max_seq} tokens"
    return None


def sweep(args: argparse.Namespace) -> Iterator[list[dict]]:
    """Each grid point's rows in turn: its three passes, or three rows that say why it did not run."""
    device = resolve_device(args.device)
    grid = list(itertools.product(args.dtypes, args.head_dims, args.seqs, args.providers))
    for i, (dtype_name, head_dim, seq, provider) in enumerate(grid, 1):
        dtype = DTYPES[dtype_name]
        base = {"benchmark": "flash_sweep", "provider": provider, "dtype": dtype_name, "head_dim": head_dim,
                "seq_len": seq, "batch": 1, "causal": True}
        reason = supported(provider, dtype, seq, device, args.pytorch_max_seq)
        if reason:
            yield [{**base, "pass": p, "status": reason.split(":")[0], "note": reason}
                   for p in ("forward", "backward", "forward_backward")]
            continue
        torch.cuda.empty_cache()
        times, failure = None, None
        try:
            q, k, v = (torch.randn(1, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            times = time_passes(PROVIDERS[provider], q, k, v, True, args.warmup_ms, args.rep_ms)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_oom(error) and "No available kernel" not in str(error):
                raise
            failure = ("oom" if is_oom(error) else "unsupported", str(error).splitlines()[0][:160])
        finally:
            q = k = v = None
        if failure:
            print(f"[{i}/{len(grid)}] {base}: {failure[0]}", file=sys.stderr, flush=True)
            yield [{**base, "pass": p, "status": failure[0], "note": failure[1]}
                   for p in ("forward", "backward", "forward_backward")]
            continue
        print(f"[{i}/{len(grid)}] {provider} {dtype_name} d={head_dim} n={seq}: "
              + " ".join(f"{p}={t:.3f}ms" for p, t in times.items()), file=sys.stderr, flush=True)
        yield [{**base, "pass": pass_, "median_ms": ms, "status": "ok",
                "tflops": attention_flops(1, seq, head_dim, True, pass_) / ms / 1e9} for pass_, ms in times.items()]


def leaderboard(args: argparse.Namespace) -> list[dict]:
    """The handout's leaderboard test, verbatim in substance, per provider (defaults: its sizes)."""
    device = resolve_device(args.device)
    n_heads, d_head, seq = args.heads, args.head_dim, args.seq_len
    rows = []
    for provider in args.providers:
        torch.manual_seed(0)
        q, k, v = torch.randn(3, n_heads, seq, d_head, device=device, dtype=DTYPES[args.dtype], requires_grad=True)
        fn = PROVIDERS[provider]
        # As the handout's test: our Functions go through torch.compile; SDPA is called as it is.
        flash = torch.compile(fn) if provider.startswith("flash") and args.compile == "on" else fn

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
            ms = bench_ms(call, device, args.warmup_ms, args.rep_ms) if device.type != "cuda" else \
                triton.testing.do_bench(call, rep=args.rep_ms, warmup=args.warmup_ms)  # the handout's call: mean
            flops = attention_flops(n_heads, seq, d_head, True, pass_)
            rows.append({"benchmark": "leaderboard", "provider": provider, "dtype": args.dtype, "head_dim": d_head,
                         "seq_len": seq, "batch": 1, "heads": n_heads, "causal": True, "pass": pass_,
                         "compiled": flash is not fn,
                         "mean_ms": ms, "tflops": flops / ms / 1e9, "rep_ms": args.rep_ms,
                         "warmup_ms": args.warmup_ms, "status": "ok", "note": note})
            print(f"leaderboard {provider} {pass_}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)",
                  file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sw = sub.add_parser("sweep", help="latency grid over sequence length, head dim and dtype")
    sw.add_argument("--seqs", nargs="+", type=int, default=[2**i for i in range(7, 17)])
    sw.add_argument("--head-dims", nargs="+", type=int, default=[16, 32, 64, 128])
    sw.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    sw.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    sw.add_argument("--pytorch-max-seq", type=int, default=4096, help="longest sequence for the PyTorch FA2")
    sw.add_argument("--warmup-ms", type=int, default=25)
    sw.add_argument("--rep-ms", type=int, default=100)
    lb = sub.add_parser("leaderboard", help="the handout's leaderboard timing test")
    lb.add_argument("--providers", nargs="+", default=["flash_triton", "sdpa_flash", "sdpa_cudnn"],
                    choices=list(PROVIDERS))
    lb.add_argument("--heads", type=int, default=16)
    lb.add_argument("--seq-len", type=int, default=16384)
    lb.add_argument("--head-dim", type=int, default=64)
    lb.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    lb.add_argument("--compile", default="on", choices=["on", "off"], help="torch.compile our Functions")
    lb.add_argument("--warmup-ms", type=int, default=1000)
    lb.add_argument("--rep-ms", type=int, default=10000)
    for p in (sw, lb):
        p.add_argument("--device", default="cuda")
        p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        resolve_device(args.device)
    except RuntimeError as error:
        parser.error(str(error))
    from cs336_systems.kernels.flash_triton import FLOAT32_DOT  # after the device check (it imports triton)

    prov = {**provenance(args.device), "float32_dot": FLOAT32_DOT}  # how our kernels multiplied float32 inputs
    rows = PartialRows(args.out)  # a cut sweep keeps its finished points in OUT.partial
    for point in sweep(args) if args.command == "sweep" else [leaderboard(args)]:
        rows.add({**row, **prov} for row in point)
    rows.finish()


if __name__ == "__main__":
    main()
