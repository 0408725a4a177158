"""Section 8 and fsdp_accounting of the 2026 handout: the derived formulas against independent counts
(simulated rings, torch's FLOP counter, autograd, brute-force optima, a real model's tensors)."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import sympy as sp
import torch
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.model import TransformerLM, get_config
from cs336_systems.optim import AdamW
from cs336_systems.model.transformer import Embedding, Linear, RMSNorm
from cs336_systems.analysis import parallelism as par
from cs336_systems.analysis.collectives import (all_reduce_rows, alternate_ring_all_reduce_time, fit_ring_model,
                                                measured_bandwidth, ring_model_table, ring_time)
from cs336_systems.analysis.fsdp_accounting import accounting_table, predicted_peaks, state_bytes, units
from cs336_systems.report.parallelism_render import (B200, Layer, Machine, evaluate, render_fsdp_accounting,
                                                     render_parallelism)

# --- the ring primitives, simulated step by step as 8.1 describes them ---------------------------


def simulate_ring_reduce_scatter(xs):
    """8.1's ring reduce-scatter: at step t device i sends its partial sum of chunk (i-t) mod n to device
    i+1, which adds it to its own. Returns the chunk each device ends with, which chunk that is, and the
    bytes each device sends per step."""
    n = len(xs)
    y = [[c.copy() for c in np.array_split(x, n)] for x in xs]
    sent = []
    for t in range(1, n):
        messages = [(i, (i - t) % n, y[i][(i - t) % n].copy()) for i in range(n)]  # all send at once
        sent.append([m[2].nbytes for m in messages])
        for i, c, chunk in messages:
            y[(i + 1) % n][c] += chunk
    owner = list(range(n))  # after n-1 steps device i's last update was chunk (i - n) mod n = i
    return [y[i][owner[i]] for i in range(n)], owner, sent


def simulate_ring_all_gather(chunks, owner):
    """Each device starts with its chunk and passes the chunk it last received to the right."""
    n = len(chunks)
    have = [{owner[i]: chunks[i]} for i in range(n)]
    last = list(owner)
    sent = []
    for _ in range(1, n):
        messages = [(i, last[i], have[i][last[i]]) for i in range(n)]
        sent.append([m[2].nbytes for m in messages])
        for i, c, chunk in messages:
            have[(i + 1) % n][c] = chunk
            last[(i + 1) % n] = c
    return [np.concatenate([h[c] for c in range(n)]) for h in have], sent


def simulate_alternate_all_reduce(xs):
    """The handout's alternate algorithm: at step t device i sends x^((i-t+1) mod n) whole and adds x^((i-t) mod n)."""
    n = len(xs)
    y = [x.copy() for x in xs]
    holding = list(xs)  # the input each device forwards next
    sent = []
    for _ in range(1, n):
        sent.append([h.nbytes for h in holding])
        received = [holding[(i - 1) % n] for i in range(n)]
        y = [y[i] + received[i] for i in range(n)]
        holding = received
    return y, sent


def _time(sent, bandwidth):
    return sum(max(step) for step in sent) / bandwidth  # a step lasts as long as its largest send


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_times_match_a_step_by_step_ring(n):
    rng = np.random.default_rng(n)
    numel, bandwidth = 24 * n, 3.5e9
    xs = [rng.standard_normal(numel) for _ in range(n)]
    total = np.sum(xs, axis=0)
    size = xs[0].nbytes
    chunks, owner, sent_rs = simulate_ring_reduce_scatter(xs)
    for i, chunk in enumerate(chunks):
        np.testing.assert_allclose(chunk, np.array_split(total, n)[owner[i]])
    gathered, sent_ag = simulate_ring_all_gather(chunks, owner)
    for g in gathered:
        np.testing.assert_allclose(g, total)
    assert len(sent_rs) == len(sent_ag) == n - 1
    assert _time(sent_rs, bandwidth) == pytest.approx(ring_time("reduce_scatter", size, n, bandwidth))
    assert _time(sent_ag, bandwidth) == pytest.approx(ring_time("all_gather", size, n, bandwidth))
    assert _time(sent_rs + sent_ag, bandwidth) == pytest.approx(ring_time("all_reduce", size, n, bandwidth))
    reduced, sent_alt = simulate_alternate_all_reduce(xs)
    for y in reduced:
        np.testing.assert_allclose(y, total)
    alternate = par.derive()["alternate_ring_all_reduce"].expr
    expected = _time(sent_alt, bandwidth)
    assert expected == pytest.approx(alternate_ring_all_reduce_time(size, n, bandwidth))
    assert float(alternate.subs({par.S: size, par.N: n, par.W: bandwidth})) == pytest.approx(expected)


# --- FLOPs against torch's counter, communication against the simulated ring -----------------------


def ffn_flops(batch, d, f):
    """Forward and backward matmul FLOPs torch counts for the FFN on (batch, d) x (d, f) weights."""
    x = torch.randn(batch, d, requires_grad=True)
    w1, w2 = torch.randn(d, f, requires_grad=True), torch.randn(d, f, requires_grad=True)
    w3 = torch.randn(f, d, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        x1 = x @ w1
        y = (torch.nn.functional.silu(x1) * (x @ w2)) @ w3
    with FlopCounterMode(display=False) as backward:
        y.backward(torch.randn_like(y))
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("b,d,f,n", [(12, 6, 10, 2), (24, 8, 12, 3), (40, 5, 16, 4)])
def test_flops_match_torch_flop_counter(b, d, f, n):
    answers = par.derive()
    values = {par.B: b, par.D: d, par.F: f, par.N_DP: n, par.N_FSDP: n, par.N_TP: n}
    fwd, bwd = ffn_flops(b // n, d, f)  # DP and FSDP: batch shard, full weights
    assert float(answers["data_parallel_calcs.a"].expr.subs(values)) == bwd
    assert float(answers["fsdp_calcs.a.backward"].expr.subs(values)) == bwd
    assert float(answers["fsdp_calcs.a.forward"].expr.subs(values)) == fwd
    fwd, bwd = ffn_flops(b, d, f // n)  # TP: whole batch, D_FF slice
    assert float(answers["tp_calcs.b.forward"].expr.subs(values)) == fwd
    assert float(answers["tp_calcs.b.backward"].expr.subs(values)) == bwd
    m, t = n, 2  # 2D: batch over FSDP, D_FF over TP
    fwd, _ = ffn_flops(b // m, d, f // t)
    assert float(answers["fsdp_tp_calcs.a"].expr.subs({**values, par.N_FSDP: m, par.N_TP: t})) == fwd


@pytest.mark.parametrize("n", [2, 3, 5])
def test_communication_matches_the_bytes_a_simulated_ring_sends(n):
    d, f, b, bandwidth = 4, 6 * n, 10 * n, 1e9
    rng = np.random.default_rng(0)
    fp16 = lambda numel: [rng.standard_normal(numel).astype(np.float16) for _ in range(n)]  # noqa: E731
    values = {par.B: b, par.D: d, par.F: f, par.W: bandwidth, par.N_DP: n, par.N_FSDP: n, par.N_TP: n}
    answers = par.derive()
    grads = fp16(3 * d * f)  # DP: all-reduce of dW1, dW2, dW3
    chunks, owner, rs = simulate_ring_reduce_scatter(grads)
    _, ag = simulate_ring_all_gather(chunks, owner)
    assert float(answers["data_parallel_calcs.b"].expr.subs(values)) == pytest.approx(_time(rs + ag, bandwidth))
    assert float(answers["fsdp_calcs.b.backward"].expr.subs(values)) == pytest.approx(_time(rs + ag, bandwidth))
    shards = [w[: 3 * d * f // n] for w in fp16(3 * d * f)]  # FSDP forward: gather the weight shards
    _, ag = simulate_ring_all_gather(shards, list(range(n)))
    assert float(answers["fsdp_calcs.b.forward"].expr.subs(values)) == pytest.approx(_time(ag, bandwidth))
    chunks, owner, rs = simulate_ring_reduce_scatter(fp16(b * d))  # TP: all-reduce of y (or dx)
    _, ag = simulate_ring_all_gather(chunks, owner)
    for key in ("tp_calcs.c.forward", "tp_calcs.c.backward"):
        assert float(answers[key].expr.subs(values)) == pytest.approx(_time(rs + ag, bandwidth))


# --- the bounds: balance at the root, and brute-force optima for 2D ---------------------------------


def _random_setting(seed):
    """Shapes and machines where every optimum has more than one device per axis (the formulas are for
    real N; below 1 they say nothing physical)."""
    rng = np.random.default_rng(seed)
    return {par.B: float(rng.uniform(1e4, 1e5)), par.D: float(rng.uniform(500, 8000)),
            par.F: float(rng.uniform(8e3, 3e4)), par.C: float(rng.uniform(1e14, 1e15)),
            par.W: float(rng.uniform(2e11, 1e12))}


@pytest.mark.parametrize("seed", range(3))
def test_single_axis_bounds_are_where_compute_meets_communication(seed):
    values = _random_setting(seed)
    answers = par.derive()
    cases = [("data_parallel_calcs.c", "data_parallel_calcs.a", "data_parallel_calcs.b", par.N_DP),
             ("fsdp_calcs.c.forward", "fsdp_calcs.a.forward", "fsdp_calcs.b.forward", par.N_FSDP),
             ("fsdp_calcs.c.backward", "fsdp_calcs.a.backward", "fsdp_calcs.b.backward", par.N_FSDP),
             ("tp_calcs.d.forward", "tp_calcs.b.forward", "tp_calcs.c.forward", par.N_TP),
             ("tp_calcs.d.backward", "tp_calcs.b.backward", "tp_calcs.c.backward", par.N_TP)]
    for bound_key, flops_key, comm_key, axis in cases:
        bound = float(answers[bound_key].expr.rhs.subs(values))

        def slack(n):  # compute time - communication time at n devices
            at = {**values, axis: n}
            return float((answers[flops_key].expr / par.C - answers[comm_key].expr).subs(at))

        assert slack(bound) == pytest.approx(0, abs=1e-12 * abs(slack(bound / 2)) + 1e-15), bound_key
        assert slack(bound * 0.9) > 0 > slack(bound * 1.1), bound_key


@pytest.mark.parametrize("seed", range(3))
def test_2d_bounds_match_a_brute_force_search(seed):
    values = _random_setting(seed)
    answers = par.derive()
    compute = float((answers["fsdp_tp_calcs.a"].expr / par.C * par.N_FSDP * par.N_TP).subs(values))  # x N
    comm = answers["fsdp_tp_calcs.b"].expr
    fsdp_term, = [a for a in comm.args if par.F in a.free_symbols]  # the weight gather scales with D_FF
    tp_term, = [a for a in comm.args if par.F not in a.free_symbols]
    fsdp_time = sp.lambdify((par.N_FSDP, par.N_TP), fsdp_term.subs(values))
    tp_time = sp.lambdify((par.N_FSDP, par.N_TP), tp_term.subs(values))
    grid = np.geomspace(1, 1e5, 1500)
    m, t = np.meshgrid(grid, grid)
    budget = compute / (m * t)
    for key, comm_total in (("fsdp_tp_calcs.c", np.maximum(fsdp_time(m, t), tp_time(m, t))),
                            ("fsdp_tp_calcs.d", fsdp_time(m, t) + tp_time(m, t))):
        best = np.max(np.where(comm_total <= budget, m * t, 0))
        formula = float(answers[key].expr.rhs.subs(values))
        assert best == pytest.approx(formula, rel=0.02), key  # the grid's spacing is 0.8%
        assert best <= formula * (1 + 1e-9), key


# --- TP backward equations against autograd ----------------------------------------------------------


def _assert_equal_but_for_rounding(got: np.ndarray, want: np.ndarray, terms: int) -> None:
    """Equal up to float64 rounding in another summation order. Each element is a chain of dot
    products whose lengths add up to `terms`; summed in another order (per device, then the
    all-reduce), it moves by at most about terms·eps times the magnitudes summed, which the largest
    element bounds for these Gaussian inputs. Elementwise relative tolerances do not hold: an element
    that nearly cancels can be 1e-12 off relative to itself on one BLAS and not another. Measured
    (300 seeds, every n_tp): at most 5 eps of the largest element; a wrong shard or a missing term is
    off by O(1) of it."""
    np.testing.assert_allclose(got, want, rtol=0, atol=terms * np.finfo(np.float64).eps * np.abs(want).max())


@pytest.mark.parametrize("n_tp", [1, 2, 3, 6])
def test_tp_backward_equations_match_autograd(n_tp):
    gen = torch.Generator().manual_seed(n_tp)
    b, d, f = 5, 7, 12
    x, dy = torch.randn(b, d, generator=gen, dtype=torch.float64), torch.randn(b, d, generator=gen, dtype=torch.float64)
    w1, w2, w3 = (torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)
                  for s in ((d, f), (d, f), (f, d)))
    x.requires_grad_(True)
    y = (torch.nn.functional.silu(x @ w1) * (x @ w2)) @ w3
    y.backward(dy)
    dx, grads = par.tp_backward(x.detach().numpy(), dy.numpy(), w1.detach().numpy(), w2.detach().numpy(),
                                w3.detach().numpy(), n_tp)
    terms = b + d + f  # the reductions along the chain: over the batch, the model dim, the hidden dim
    _assert_equal_but_for_rounding(dx, x.grad.numpy(), terms)
    _assert_equal_but_for_rounding(np.concatenate([g[0] for g in grads], axis=1), w1.grad.numpy(), terms)
    _assert_equal_but_for_rounding(np.concatenate([g[1] for g in grads], axis=1), w2.grad.numpy(), terms)
    _assert_equal_but_for_rounding(np.concatenate([g[2] for g in grads], axis=0), w3.grad.numpy(), terms)
    with pytest.raises(ValueError, match="n_tp=5"):
        par.tp_backward(x.detach().numpy(), dy.numpy(), w1.detach().numpy(), w2.detach().numpy(),
                        w3.detach().numpy(), 5)


# --- memory against a real model's tensors ---------------------------------------------------------


def test_memory_accounting_matches_a_real_model_and_optimizer():
    config = get_config("tiny")
    model = TransformerLM(config)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, config.vocab_size, (1, 8))).sum().backward()
    optimizer.step()
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    params = list(model.parameters())
    moments = [state[k] for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    ddp = state_bytes(config, "DDP", 1)
    assert ddp["params"] == nbytes(params) and ddp["grads"] == nbytes(p.grad for p in params)
    assert ddp["optimizer"] == nbytes(moments)
    sharded = [m.weight for m in model.modules() if isinstance(m, Linear | Embedding)]
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert sorted(units(config).sharded) == sorted(p.numel() for p in sharded)
    assert units(config).replicated == sum(p.numel() for p in norms)
    for world in (2, 4):
        fsdp, zero = state_bytes(config, "FSDP", world), state_bytes(config, "ZeRO-1", world)
        local = sum(p.numel() * 4 / world for p in sharded) + sum(p.numel() * 4 for p in norms)
        assert fsdp["params"] == pytest.approx(local) and fsdp["optimizer"] == pytest.approx(2 * local)
        assert zero["optimizer"] == pytest.approx(ddp["optimizer"] / world)
        largest = sorted((p.numel() for p in sharded), reverse=True)
        assert fsdp["gather_buffers"] == 2 * (largest[0] + largest[1] + largest[0])


def test_fsdp_accounting_table_and_measured_comparison():
    table = accounting_table(("xl",), 2).set_index("strategy")
    p = table.loc["DDP", "parameters"]
    assert table.loc["DDP", "state_mib"] * 2**20 == 16 * p
    assert table.loc["ZeRO-1", "saving_vs_ddp_mib"] * 2**20 == pytest.approx(4 * p)
    measured = pd.DataFrame([
        {"config": "individual", "size": "xl", "world_size": 2, "precision": "fp32", "peak_after_step_mib": 36000.0},
        {"config": "individual+sharded", "size": "xl", "world_size": 2, "precision": "fp32",
         "peak_after_step_mib": 28000.0}])
    peaks = predicted_peaks(measured).iloc[0]
    assert peaks["measured_ddp_minus_zero1_mib"] == 8000
    assert peaks["predicted_fsdp_peak_mib"] == pytest.approx(
        28000 - (table.loc["ZeRO-1", "state_mib"] - table.loc["FSDP", "state_mib"]))
    # (a) quotes the forward+backward peaks (peak_before_step), which the same accounting applies to
    text = render_fsdp_accounting(measured.rename(columns={"peak_after_step_mib": "peak_before_step_mib"}),
                                  sizes=("xl",))
    assert "### fsdp_accounting (a)" in text and "2026 handout" in text and "28,000" in text
    with pytest.raises(ValueError, match="peak_after_step_mib"):
        predicted_peaks(measured.drop(columns="peak_after_step_mib"))


@pytest.mark.parametrize("kwargs,match", [({"strategy": "ZeRO-3"}, "ZeRO-3"), ({"world_size": 0}, "world_size"),
                                          ({"in_flight": 0}, "in_flight")])
def test_memory_accounting_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        state_bytes(get_config("tiny"), **({"strategy": "DDP", "world_size": 2} | kwargs))


# --- the ring model against (synthetic) measurements; rendering; bad input --------------------------


def _synthetic_collectives(bandwidth=200e9, latency=30e-6, world=4, ops=("all_reduce", "all_gather", "reduce_scatter")):
    rows = []
    for op, size_mb in itertools.product(ops, (1, 10, 100)):
        size = size_mb * 2**20
        rows.append({"op": op, "backend": "nccl", "device_type": "cuda", "world_size": world, "size_mb": size_mb,
                     "median_ms": (latency + ring_time(op, size, world, bandwidth)) * 1e3, "status": "ok"})
    rows.append({"op": "reduce_scatter", "backend": "gloo", "device_type": "cpu", "world_size": world,
                 "size_mb": 1, "status": "unsupported"})
    return pd.DataFrame(rows)


def test_ring_fit_recovers_bandwidth_and_latency():
    frame = _synthetic_collectives()
    fits = fit_ring_model(frame)
    assert set(fits["op"]) == {"all_reduce", "all_gather", "reduce_scatter"}  # the unsupported row is skipped
    np.testing.assert_allclose(fits["bandwidth_gbps"], 200, rtol=1e-6)
    np.testing.assert_allclose(fits["latency_us"], 30, rtol=1e-6)
    table = ring_model_table(frame)
    np.testing.assert_allclose(table["measured_over_predicted"], 1, rtol=1e-9)
    assert measured_bandwidth(frame, "nccl", 4) == pytest.approx(200e9)
    assert measured_bandwidth(frame, "nccl", 2) is None and measured_bandwidth(None) is None
    # Rows from before the `op` column are all-reduces; without an all-reduce there is no prediction.
    old = _synthetic_collectives(ops=("all_reduce",)).drop(columns="op")
    assert list(fit_ring_model(old)["op"]) == ["all_reduce"]
    assert len(all_reduce_rows(old)) == len(old) and set(all_reduce_rows(frame)["op"]) == {"all_reduce"}
    assert math.isnan(ring_model_table(_synthetic_collectives(ops=("all_gather",)))["predicted_ms"].iloc[0])


def test_ring_model_rejects_bad_tables():
    with pytest.raises(ValueError, match="median_ms"):
        fit_ring_model(pd.DataFrame({"backend": ["nccl"]}))
    frame = _synthetic_collectives()
    frame.loc[0, "op"] = "broadcast"
    with pytest.raises(ValueError, match="broadcast"):
        fit_ring_model(frame)
    with pytest.raises(ValueError, match="gather_all"):
        ring_time("gather_all", 1, 2, 1)


def test_render_parallelism_answers_every_problem():
    text = render_parallelism(_synthetic_collectives(world=2))
    assert "2026 handout" in text
    for problem in ("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs"):
        assert f"### {problem}" in text
    assert "2 × H200 (measured W)" in text and "Ring model against measured collectives" in text
    without = render_parallelism(None)
    assert "measured W)" not in without and "left out" in without


def test_parallelism_cli_writes_both_sections(tmp_path):
    from cs336_systems.report.parallelism_render import main

    out = tmp_path / "parallelism.md"
    main(["--out", str(out)])
    text = out.read_text()
    assert "### fsdp_accounting (a)" in text and "### fsdp_tp_calcs" in text


def test_bounds_reject_a_ratio_that_does_not_grow_and_evaluate_names_free_symbols():
    with pytest.raises(ValueError, match="does not grow"):
        par.max_devices(par.B / par.N_DP, par.D / par.N_DP, par.N_DP)
    layer = Layer("toy", 1024, 64, 256, "test")
    with pytest.raises(ValueError, match="N_TP"):
        evaluate(par.derive()["tp_calcs.c.forward"].expr, B200, layer)
    assert evaluate(par.derive()["data_parallel_calcs.c"].expr, Machine("m", 1e12, 1e9, "t"), layer) == 1 + 1024 * 1e-3


def test_ring_model_check_predicts_a_size_held_out_of_its_fit():
    """The validation table once predicted the very points it was fitted on (ratio 1.000 by construction): the
    predicted size must be left out of the fit, so a measured time off the model at that size shows in the ratio."""
    from cs336_systems.report.parallelism_render import held_out_ring_table

    frame = _synthetic_collectives()
    table = held_out_ring_table(frame)
    assert list(table["held out (MiB)"]) == [100] * 3 and set(table["fitted on (MiB)"]) == {"1, 10"}
    np.testing.assert_allclose(table["measured_over_predicted"], 1, rtol=1e-6)  # the ideal ring is predicted
    slow = frame["size_mb"].eq(100) & frame["op"].eq("all_reduce")
    frame.loc[slow, "median_ms"] *= 1.5
    ratio = held_out_ring_table(frame).set_index("op")["measured_over_predicted"]
    assert ratio["all_reduce"] == pytest.approx(1.5, rel=1e-6) and ratio["all_gather"] == pytest.approx(1, rel=1e-6)
    only = held_out_ring_table(frame[frame["size_mb"].eq(100)])
    assert only["predicted_ms"].isna().all() and set(only["fitted on (MiB)"]) == {"—"}
