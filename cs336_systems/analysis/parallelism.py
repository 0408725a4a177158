"""The 2026 handout's section 8 ("Analyzing Parallelism Strategies"), derived in sympy.

One FFN layer, x (B, D), W1 and W2 (D, D_FF), W3 (D_FF, D), FP16 weights and activations (handout
8.2), devices with C FLOP/s and W bytes/s of egress. Every answer is built the way the handout builds
it, so the code mirrors its equations:

- FLOPs per device = the sum of 2·a·b·c over the matmuls (a, b)(b, c) that device runs, with the
  sharded shapes of the strategy (`_forward_matmuls`, `_backward_matmuls`);
- communication time = the ring time of each collective (analysis.collectives) on the bytes it moves;
- the largest device count = the root in N of compute time = communication time. The check that
  communication/compute grows with N (so the bound is N <= root) is done in sympy, not assumed.

`derive(large_n)` returns every answer with its one-sentence justification (text written beside the
expression); large_n=True replaces the ring factor (N-1)/N by 1, the approximation usually quoted.
Numbers for concrete machines and shapes, and the Markdown, are in report/parallelism_render.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import sympy as sp

from cs336_systems.analysis.collectives import alternate_ring_all_reduce_time, ring_time

B, D, F, C, W, S = sp.symbols("B D D_FF C W S", positive=True)
N, N_DP, N_FSDP, N_TP = sp.symbols("N N_DP N_FSDP N_TP", positive=True)
FP16 = 2  # bytes per value: "all weights and activations are in FP16 (i.e. two bytes)" (handout 8.2)


@dataclass(frozen=True)
class Answer:
    key: str  # problem.part, e.g. "tp_calcs.c.backward"
    quantity: str  # what expr is, e.g. "communication time of the backward pass (s)"
    expr: sp.Basic  # an expression, or a relation (N <= ...) for the bounds
    justification: str


def matmul_flops(a, b, c):
    """(a, b)(b, c) -> (a, c) takes 2abc FLOPs (handout 8.2)."""
    return 2 * a * b * c


def _forward_matmuls(batch, d, f):
    """x1 = x W1, x2 = x W2, y = z W3, with this device's batch rows and its (d, f) slice of the weights."""
    return [(batch, d, f), (batch, d, f), (batch, f, d)]


def _backward_matmuls(batch, d, f):
    """dz = dy W3^T; dx = dx1 W1^T + dx2 W2^T; dW3 = z^T dy; dW2 = x^T dx2; dW1 = x^T dx1 (eqs. 24-30)."""
    return [(batch, d, f), (batch, f, d), (batch, f, d), (f, batch, d), (d, batch, f), (d, batch, f)]


def flops(matmuls) -> sp.Expr:
    return sp.simplify(sum(matmul_flops(*shape) for shape in matmuls))


def _ring(op: str, size, n, large_n: bool):
    return size / W * (2 if op == "all_reduce" else 1) if large_n else ring_time(op, size, n, W)


def max_devices(compute: sp.Expr, comm: sp.Expr, n: sp.Symbol) -> sp.Expr:
    """The N at which communication time equals compute time, checked to be the only positive root and
    the start of the communication-bound region (comm/compute increasing in N)."""
    ratio = sp.simplify(comm / compute)
    slope = sp.simplify(sp.diff(ratio, n))
    if not slope.is_positive:
        raise ValueError(f"communication/compute = {ratio} does not grow with {n}; no upper bound on {n}")
    roots = [r for r in sp.solve(sp.Eq(ratio, 1), n) if r.is_positive is not False]
    if len(roots) != 1:
        raise ValueError(f"expected one positive root of {ratio} = 1 in {n}, got {roots}")
    return sp.expand(roots[0])  # 1 + ..., as the handout would write it


def _alternate(large_n: bool) -> Answer:
    alternate = alternate_ring_all_reduce_time(S, N, W)
    standard = S / W * 2 if large_n else ring_time("all_reduce", S, N, W)
    ratio = sp.simplify(alternate / standard)
    return Answer("alternate_ring_all_reduce", "time of the alternate ring all-reduce (s)", alternate,
                  "Each of the N-1 steps forwards a whole size-S input x^(i-t+1) (not an S/N chunk), so every "
                  f"step takes S/W; that is {sp.sstr(ratio)} times the reduce-scatter + all-gather ring.")


def _data_parallel(large_n: bool) -> list[Answer]:
    compute = flops(_backward_matmuls(B / N_DP, D, F))
    grads = 3 * D * F * FP16
    comm = _ring("all_reduce", grads, N_DP, large_n)
    bound = max_devices(compute / C, comm, N_DP)
    return [
        Answer("data_parallel_calcs.a", "backward FLOPs per device", compute,
               "The backward pass is six (B/N_DP, D, D_FF)-sized matmuls (dz, two for dx, dW1, dW2, dW3), each "
               "2·(B/N_DP)·D·D_FF FLOPs on the device's batch shard (12·B·D·D_FF in all over the devices)."),
        Answer("data_parallel_calcs.b", "backward communication time (s)", comm,
               "The three weight gradients (3·D·D_FF FP16 values, 6·D·D_FF bytes) are all-reduced once, and a "
               "ring all-reduce of S bytes takes 2(N-1)/N·S/W."),
        Answer("data_parallel_calcs.c", "largest N_DP before communication-bound", sp.Le(N_DP, bound),
               "Compute 12·B·D·D_FF/(N_DP·C) falls with N_DP while the all-reduce approaches the constant "
               "12·D·D_FF/W, so they meet at this N_DP, which depends only on the global batch B (in tokens) and "
               "the machine's W/C, not on the layer's size."),
    ]


def _fsdp(large_n: bool) -> list[Answer]:
    weights = 3 * D * F * FP16
    compute_fwd = flops(_forward_matmuls(B / N_FSDP, D, F))
    compute_bwd = flops(_backward_matmuls(B / N_FSDP, D, F))
    comm_fwd = _ring("all_gather", weights, N_FSDP, large_n)
    comm_bwd = _ring("all_gather", weights, N_FSDP, large_n) + _ring("reduce_scatter", weights, N_FSDP, large_n)
    return [
        Answer("fsdp_calcs.a.backward", "backward FLOPs per device", compute_bwd,
               "Once the weights are gathered the backward is data parallel's: six matmuls of "
               "2·(B/N_FSDP)·D·D_FF FLOPs on the device's batch shard."),
        Answer("fsdp_calcs.a.forward", "forward FLOPs per device", compute_fwd,
               "The forward runs three matmuls (x W1, x W2, z W3) of 2·(B/N_FSDP)·D·D_FF FLOPs each."),
        Answer("fsdp_calcs.b.backward", "backward communication time (s)", sp.simplify(comm_bwd),
               "The backward all-gathers the three weights again and reduce-scatters their gradients, two ring "
               "collectives of 6·D·D_FF bytes at (N-1)/N·S/W each: the same traffic as DP's all-reduce."),
        Answer("fsdp_calcs.b.forward", "forward communication time (s)", comm_fwd,
               "The forward only all-gathers the three weight matrices (6·D·D_FF bytes), one ring all-gather."),
        Answer("fsdp_calcs.c.backward", "largest N_FSDP, backward", sp.Le(N_FSDP, max_devices(compute_bwd / C, comm_bwd,
                                                                                         N_FSDP)),
               "Backward compute and communication are DP's (twice the forward's each), so the bound is DP's: "
               "per-device compute 12·B·D·D_FF/(N·C) against a traffic that tends to 12·D·D_FF/W."),
        Answer("fsdp_calcs.c.forward", "largest N_FSDP, forward", sp.Le(N_FSDP, max_devices(compute_fwd / C, comm_fwd,
                                                                                       N_FSDP)),
               "The forward has half the backward's FLOPs and half its traffic, so its ratio, and its bound, are "
               "the same."),
    ]


TP_BACKWARD = """\
dz(i)  = dy · W3(i)^T                       (B, D_FF/N_TP)   dy is replicated: y was all-reduced
dx2(i) = dz(i) * f(x1(i))                   (B, D_FF/N_TP)
dx1(i) = dz(i) * f'(x1(i)) * x2(i)          (B, D_FF/N_TP)
dW3(i) = z(i)^T · dy                        (D_FF/N_TP, D)   complete: the whole batch is local
dW2(i) = x^T · dx2(i)                       (D, D_FF/N_TP)
dW1(i) = x^T · dx1(i)                       (D, D_FF/N_TP)
u(i)   = dx1(i) · W1(i)^T + dx2(i) · W2(i)^T  (B, D)         partial sum over this device's D_FF slice
dx     = all-reduce({u(i)} for i = 0 .. N_TP-1)
"""
TP_BACKWARD_WHY = ("dy is replicated after the forward's all-reduce, so each device back-propagates through its "
                   "own D_FF slice with no communication until dx, which is a sum over the slices and needs one "
                   "all-reduce; the weight gradients are already complete on their shards.")


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def silu_prime(v: np.ndarray) -> np.ndarray:
    s = 1 / (1 + np.exp(-v))
    return s * (1 + v * (1 - s))


def tp_backward(x: np.ndarray, dy: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray,
                n_tp: int) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """TP_BACKWARD run on n_tp simulated devices (f = SiLU): W1, W2 split by columns, W3 by rows; the
    all-reduce is a sum over devices. Returns dx and each device's (dW1, dW2, dW3) shard.
    x (B, D), dy (B, D), w1 and w2 (D, D_FF), w3 (D_FF, D); D_FF divisible by n_tp."""
    if n_tp < 1 or w1.shape[1] % n_tp:
        raise ValueError(f"n_tp={n_tp} must be a positive divisor of D_FF={w1.shape[1]}")
    partial_dx, grads = [], []
    for w1_i, w2_i, w3_i in zip(np.split(w1, n_tp, axis=1), np.split(w2, n_tp, axis=1), np.split(w3, n_tp, axis=0)):
        x1, x2 = x @ w1_i, x @ w2_i  # saved from the forward (eqs. 47-49)
        z = silu(x1) * x2
        dz = dy @ w3_i.T
        dx2 = dz * silu(x1)
        dx1 = dz * silu_prime(x1) * x2
        grads.append((x.T @ dx1, x.T @ dx2, z.T @ dy))
        partial_dx.append(dx1 @ w1_i.T + dx2 @ w2_i.T)
    return np.sum(partial_dx, axis=0), grads  # the all-reduce


def _tensor_parallel(large_n: bool) -> list[Answer]:
    compute_fwd = flops(_forward_matmuls(B, D, F / N_TP))
    compute_bwd = flops(_backward_matmuls(B, D, F / N_TP))
    activation = B * D * FP16
    comm = _ring("all_reduce", activation, N_TP, large_n)
    return [
        Answer("tp_calcs.b.forward", "forward FLOPs per device", compute_fwd,
               "Each device runs the three forward matmuls on the whole batch against its D_FF/N_TP slice: "
               "3 · 2·B·D·D_FF/N_TP."),
        Answer("tp_calcs.b.backward", "backward FLOPs per device", compute_bwd,
               "The six backward matmuls likewise each see the full batch and a D_FF/N_TP slice: "
               "6 · 2·B·D·D_FF/N_TP."),
        Answer("tp_calcs.c.forward", "forward communication time (s)", comm,
               "The forward's one collective is the all-reduce of y^(i), B·D FP16 values (2·B·D bytes)."),
        Answer("tp_calcs.c.backward", "backward communication time (s)", comm,
               "The backward's one collective is the all-reduce of dx, again 2·B·D bytes."),
        Answer("tp_calcs.d.backward", "largest N_TP, backward",
               sp.Le(N_TP, max_devices(compute_bwd / C, comm, N_TP)),
               "Both sides scale with B, so the batch drops out: compute 12·B·D·D_FF/(N·C) against about "
               "4·B·D/W of traffic leaves a bound set by D_FF and W/C alone."),
        Answer("tp_calcs.d.forward", "largest N_TP, forward", sp.Le(N_TP, max_devices(compute_fwd / C, comm, N_TP)),
               "The forward does half the backward's FLOPs for the same all-reduce, so its bound is half as large "
               "(in N_TP - 1): the forward becomes communication-bound first."),
    ]


def _two_d(large_n: bool) -> list[Answer]:
    compute = flops(_forward_matmuls(B / N_FSDP, D, F / N_TP))
    comm_fsdp = _ring("all_gather", 3 * D * (F / N_TP) * FP16, N_FSDP, large_n)  # W^(i) pieces along FSDP
    comm_tp = _ring("all_reduce", (B / N_FSDP) * D * FP16, N_TP, large_n)  # y^(i,j) along TP
    # (c) overlapped: max(fsdp, tp) <= compute holds iff each does; each involves one axis only.
    fsdp_max = max_devices(compute / C, comm_fsdp, N_FSDP)
    tp_max = max_devices(compute / C, comm_tp, N_TP)
    # (d) one network: fsdp + tp <= compute. Cleared of its positive denominators the condition is
    # g(N_FSDP, N_TP) <= 0 with g linear in both; maximise N_FSDP·N_TP on g = 0 (Lagrange).
    g = sp.expand(sp.fraction(sp.together(comm_fsdp + comm_tp - compute / C))[0])
    lam = sp.Symbol("lambda")
    product = N_FSDP * N_TP
    system = [sp.diff(product - lam * g, v) for v in (N_FSDP, N_TP)] + [g]
    optima = [s for s in sp.solve(system, [N_FSDP, N_TP, lam], dict=True)
              if s[N_FSDP].is_positive is not False and s[N_TP].is_positive is not False]
    if len(optima) != 1:
        raise ValueError(f"expected one positive optimum of N_FSDP·N_TP, got {optima}")
    best = optima[0]
    return [
        Answer("fsdp_tp_calcs.a", "forward FLOPs per device", compute,
               "Each device runs the three forward matmuls on its B/N_FSDP rows against its gathered "
               "(D, D_FF/N_TP) slice, so the 6·B·D·D_FF FLOPs are split N = N_FSDP·N_TP ways."),
        Answer("fsdp_tp_calcs.b", "forward communication time (s)", sp.Max(comm_fsdp, comm_tp),
               "Along FSDP each device all-gathers its TP slice of the three weights (6·D·D_FF/N_TP bytes), along "
               "TP it all-reduces its output y^(i,j) (2·B·D/N_FSDP bytes); overlapped, the slower one counts."),
        Answer("fsdp_tp_calcs.c.fsdp", "largest N_FSDP (overlapped)", sp.Le(N_FSDP, fsdp_max),
               "The FSDP gather is compute-bound exactly when FSDP alone would be: the N_TP of compute and traffic "
               "cancel."),
        Answer("fsdp_tp_calcs.c.tp", "largest N_TP (overlapped)", sp.Le(N_TP, tp_max),
               "The TP all-reduce is compute-bound exactly when TP alone's forward is: the N_FSDP cancels."),
        Answer("fsdp_tp_calcs.c", "largest N = N_FSDP·N_TP (overlapped)", sp.Le(N, fsdp_max * tp_max),
               "With the axes overlapped the two conditions are independent, each on one axis, so the optimum "
               "takes both axes to their own limit and N is the product of the two bounds."),
        Answer("fsdp_tp_calcs.d.fsdp", "N_FSDP at the optimum (not overlapped)", sp.expand(best[N_FSDP]),
               "Sharing one network, the two traffics add: g(N_FSDP, N_TP) = "
               f"{sp.sstr(sp.factor(g))} <= 0 is linear in each axis, so the product is largest where the "
               "Lagrange condition gives both axes the same share of the budget."),
        Answer("fsdp_tp_calcs.d.tp", "N_TP at the optimum (not overlapped)", sp.expand(best[N_TP]),
               "The same Lagrange point: each axis spends half the compute time on its collective."),
        Answer("fsdp_tp_calcs.d", "largest N = N_FSDP·N_TP (not overlapped)",
               sp.Le(N, sp.factor(sp.simplify(best[N_FSDP] * best[N_TP]))),
               "Each axis gets half the time budget, so each one's own bound (in the large-N limit) halves and "
               "the product falls to a quarter of the overlapped one."),
    ]


@functools.cache  # sympy takes seconds; the answers never change
def derive(large_n: bool = False) -> dict[str, Answer]:
    """Every section-8 answer by key; large_n=True takes (N-1)/N = 1 in the ring times."""
    answers = [_alternate(large_n), *_data_parallel(large_n), *_fsdp(large_n), *_tensor_parallel(large_n),
               *_two_d(large_n)]
    return {a.key: _tidy(a) for a in answers}


def _tidy(answer: Answer) -> Answer:
    """Times with (N-1) factored out, the form the handout writes; relations and the optima as built."""
    expr = answer.expr
    if isinstance(expr, sp.Max):
        expr = sp.Max(*[sp.factor(arg) for arg in expr.args])
    elif not isinstance(expr, sp.core.relational.Relational) and not answer.key.startswith("fsdp_tp_calcs.d."):
        expr = sp.factor(expr)
    return Answer(answer.key, answer.quantity, expr, answer.justification)


def weights_per_device() -> dict[str, sp.Expr]:
    """FP16 bytes of the FFN's three weights each device holds between uses (gathered copies aside)."""
    full = 3 * D * F * FP16
    return {"DP": full, "FSDP": full / N_FSDP, "TP": full / N_TP, "FSDP+TP": full / (N_FSDP * N_TP)}
