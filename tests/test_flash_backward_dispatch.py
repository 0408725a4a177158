"""The Gluon backward wired into the `flash_triton` backend (`kernels/dispatch.choose_backward`).

On CPU: the backward's shape rule (against the H100 timings it was written from, tests/data/), the capability and setting that pick a path (with the device checks answering as an H100 would, the
inputs reach the Gluon entry in its argument order), a forced Gluon backward being a clear error on the CPU in both
the eager path and the custom op, the setting read at each call, and that the CPU interpreter path runs FA2's
backward (spied on), correct against float64, also under torch.compile without a recompile when the setting
changes. On an sm_90 GPU (marked `gpu`): O, dQ, dK, dV through `FlashAttentionTriton` with the backward forced to
Gluon or left to the rule, against float64 and the FA2 backward, causal or not, d 64/128, ragged lengths, a Gluon
backward fed by the FA2 forward; the dispatch by input; and `torch.compile(fullgraph=True)` with the Gluon backward.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cs336_systems.kernels.flash import api, dispatch, fa2
from cs336_systems.kernels.flash import gluon_bwd as bwd
from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash.dispatch import (
    BACKWARD_ENV,
    FORWARD_ENV,
    GLUON_BACKWARD_RULES,
    GLUON_FORWARD_RULES,
    HOPPER,
    GluonRule,
    choose_backward,
    gluon_backward_pays,
    gluon_pays,
)
from cs336_systems.kernels.flash.settings import FlashSettings, use_flash_settings
from cs336_systems.model.attention import naive_attention
from tests.kernel_devices import gluon_call
from tests.test_flash_gluon import reread_env, FA2_TILE, _counting, _fresh, _rel_err, _with_grads, needs_sm90


def _backward_inputs(q_shape, k_shape, dtype=torch.bfloat16, device="cpu"):
    """q, k, v, out, lse, dO as the backward gets them (values unused by the choice)."""
    q, out, grad_out = (torch.empty(q_shape, dtype=dtype, device=device) for _ in range(3))
    k, v = (torch.empty(k_shape, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, out, torch.empty(q_shape[:-1], device=device), grad_out


@pytest.fixture
def no_flash_choice(monkeypatch):
    """Neither pass forced by the caller's shell."""
    reread_env(monkeypatch, FORWARD_ENV)
    reread_env(monkeypatch, BACKWARD_ENV)
    return monkeypatch


# ----------------------------------------------------------------------------------------------
# the rule, on CPU
# ----------------------------------------------------------------------------------------------
# The H100 run the rules were written from (tests/data/README.md), and the rules of the run before it (with the d=64
# tiles shipped before the tile search). DECISIONS.md#dispatch-thresholds.
DATA = Path(__file__).parent / "data"
THRESHOLD = DATA / "flash_gluon_threshold.csv"
PREVIOUS_RULES = {64: GluonRule(min_keys=4096, min_scores=2**29), 128: GluonRule(min_keys=1024, min_scores=2**28)}
# Both passes' shape rules (the forward's and the backward's), each with its own rules per head dim.
SHAPE_RULES = [pytest.param(gluon_pays, GLUON_FORWARD_RULES, "forward", id="forward"),
               pytest.param(gluon_backward_pays, GLUON_BACKWARD_RULES, "backward", id="backward")]


@pytest.mark.parametrize("pays,rules,pass_", SHAPE_RULES)
def test_shape_rules_pick_the_faster_kernel_over_the_measured_grid(pays, rules, pass_):
    """Against the grid the rules were written from: wherever the calls are device-bound (FA2 >= 1 ms) and one
    kernel was clearly faster (by 20%: the run's noise at one point reached 15%), the rule picks it; and over the
    whole grid the rule's choices add up to less time than always FA2, always Gluon, or the previous run's rules."""
    rows = pd.read_csv(THRESHOLD)
    times = rows[(rows["status"] == "ok") & (rows["pass"] == pass_)].pivot_table(
        index=["batch", "heads", "seq_len", "head_dim", "causal"], columns="variant", values="median_ms")
    assert len(times) >= 48 and times[["fa2", "gluon"]].notna().all().all()
    totals = {"rule": 0.0, "fa2": 0.0, "gluon": 0.0, "previous": 0.0}
    for (batch, heads, seq, head_dim, causal), t in times.iterrows():
        shape = (batch, heads, seq, head_dim)
        gluon = pays(HOPPER, shape, shape, bool(causal))
        if t["fa2"] >= 1.0 and max(t["fa2"], t["gluon"]) > 1.2 * min(t["fa2"], t["gluon"]):
            assert gluon == (t["gluon"] < t["fa2"]), f"{shape} causal={causal}: FA2 {t['fa2']:.3f}, Gluon {t['gluon']:.3f}"
        totals["rule"] += t["gluon" if gluon else "fa2"]
        totals["fa2"] += t["fa2"]
        totals["gluon"] += t["gluon"]
        totals["previous"] += t["gluon" if PREVIOUS_RULES[head_dim].holds(shape, shape, bool(causal)) else "fa2"]
    assert totals["rule"] < min(totals["fa2"], totals["gluon"], totals["previous"]), totals


@pytest.mark.parametrize("pays,rules,pass_", SHAPE_RULES)
@pytest.mark.parametrize("capability", [None, (8, 0), (8, 9), (10, 0), (12, 0)])
def test_shape_rule_keeps_fa2_off_hopper(pays, rules, pass_, capability):
    for head_dim, rule in rules.items():
        shape = gluon_call(rule, head_dim, True)
        assert pays(HOPPER, shape, shape, True) and not pays(capability, shape, shape, True)


@pytest.mark.parametrize("pays,rules,pass_", SHAPE_RULES)
def test_shape_rule_counts_the_longest_row_and_the_scores(pays, rules, pass_):
    for head_dim, rule in rules.items():
        batch, heads, n, d = gluon_call(rule, head_dim, True)
        assert pays(HOPPER, (batch, heads, n, d), (batch, heads, n, d), True)
        # one row too short, or half the heads (half the scores): FA2
        assert not pays(HOPPER, (batch, 64 * heads, n - 1, d), (batch, 64 * heads, n - 1, d), False)
        assert not pays(HOPPER, (batch, heads // 2, n, d), (batch, heads // 2, n, d), True)
        assert pays(HOPPER, (2 * batch, heads // 2, n, d), (2 * batch, heads // 2, n, d), True)  # batch counts too
        # causal rows see keys 0..i (aligned at the start): 300 queries see at most 300 keys, however many there are
        wide = (batch, 1024 * heads, 300, d), (batch, 1024 * heads, 8 * n, d)
        assert not pays(HOPPER, *wide, True) and pays(HOPPER, *wide, False)
        assert not pays(HOPPER, wide[1], wide[0], False)  # 300 keys
        assert not pays(HOPPER, (batch, heads, n, 32), (batch, heads, n, 32), True)  # no rule for head dim 32


def test_attention_scores_counts_the_pairs_computed():
    for n_q, n_k in ((5, 5), (3, 7), (7, 3), (1, 1)):
        full = torch.ones(n_q, n_k, dtype=torch.bool)
        causal = torch.ones(n_q, n_k).tril().bool()  # row i sees keys 0..i
        assert dispatch.attention_scores((2, 3, n_q, 8), (2, 3, n_k, 8), False) == 6 * int(full.sum())
        assert dispatch.attention_scores((2, 3, n_q, 8), (2, 3, n_k, 8), True) == 6 * int(causal.sum())
        assert dispatch.attention_scores((3, n_q, 8), (3, n_k, 8), True) == 3 * int(causal.sum())


def test_cpu_and_interpreter_take_fa2(no_flash_choice):
    shape = gluon_call(GLUON_BACKWARD_RULES[64], 64, True)
    inputs = _backward_inputs(shape, shape)  # all the Gluon backward asks for but the device
    assert bwd.layout_problem(*inputs[:3]) is None and gluon_backward_pays(HOPPER, shape, shape, True)
    assert choose_backward(*inputs, True) == "triton"
    assert choose_backward(*inputs, True, backward="triton") == "triton"
    with pytest.raises(ValueError, match="Gluon backward was asked for .* " +
                       ("interpreter" if INTERPRET else "needs CUDA tensors, got device cpu")):
        choose_backward(*inputs, True, backward="gluon")
    reread_env(no_flash_choice, BACKWARD_ENV, "gluon")
    with pytest.raises(ValueError, match="FlashSettings.backward, CS336_FLASH_BACKWARD or backward='gluon'"):
        choose_backward(*inputs, True)


def test_auto_on_a_pretend_hopper_hands_the_inputs_to_the_gluon_backward(no_flash_choice):
    """The "auto" branch that takes Gluon, on CPU: with the device checks answering as an H100 would, long inputs
    reach flash_backward_gluon through dispatch.flash_backward, each tensor in the argument it belongs to
    (the Gluon entry takes o, do, lse in another order than FA2's) with checked=True and the pass's fast_launch
    setting, and what the kernel does not take stays FA2."""
    no_flash_choice.setattr(dispatch, "device_capability", lambda q: HOPPER)
    no_flash_choice.setattr(bwd, "device_problem", lambda q: None)
    calls = []
    no_flash_choice.setattr(bwd, "flash_backward_gluon",
                            lambda *args, **options: calls.append((args, options)) or "gluon ran")
    batch, heads, n, _ = gluon_call(GLUON_BACKWARD_RULES[64], 64, True)
    q, k, v, out, lse, grad_out = _backward_inputs((batch, heads, n, 64), (batch, heads, n, 64))
    assert dispatch.flash_backward(q, k, v, out, lse, grad_out, True) == "gluon ran"
    assert len(calls) == 1
    args, options = calls[0]
    assert all(a is b for a, b in zip(args, (q, k, v, out, grad_out, lse, True), strict=True))
    assert options == {"checked": True, "fast_launch": True}
    for other in (_backward_inputs((batch, heads, n - 1, 64), (batch, heads, n - 1, 64)),  # shorter than the rule
                  _backward_inputs((batch, heads // 2, n, 64), (batch, heads // 2, n, 64)),  # too few scores
                  _backward_inputs((batch, heads, n, 64), (batch, heads, n, 64), dtype=torch.float32),  # a dtype it does not take
                  _backward_inputs((batch, heads, n, 32), (batch, heads, n, 32))):  # a head dim it does not take
        assert choose_backward(*other, True) == "triton"
    assert choose_backward(q, k, v, out, lse.double(), grad_out, True) == "triton"  # an L no forward of ours writes
    assert choose_backward(q, k, v, out, lse, grad_out, True, backward="triton") == "triton"


def test_backward_setting_is_read_at_each_call(no_flash_choice):
    inputs = _backward_inputs((1, 2, 40, 64), (1, 2, 40, 64))
    assert dispatch.backward_setting() == "auto"
    for value in dispatch.BACKWARDS:
        reread_env(no_flash_choice, BACKWARD_ENV, value)
        assert dispatch.backward_setting() == value
    assert dispatch.backward_setting("triton") == "triton"  # the argument wins over the environment
    assert choose_backward(*inputs, False, backward="triton") == "triton"
    with use_flash_settings(backward="triton"):  # set from code: the environment is not read
        assert dispatch.backward_setting() == "triton" and choose_backward(*inputs, False) == "triton"
    # the two passes are set apart
    reread_env(no_flash_choice, FORWARD_ENV, "triton")
    assert dispatch.backward_setting() == "gluon" and dispatch.forward_setting() == "triton"
    reread_env(no_flash_choice, BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="CS336_FLASH_BACKWARD='fast': choose one of auto, triton, gluon"):
        choose_backward(*inputs, False)
    with pytest.raises(ValueError, match="backward='Gluon'"):
        choose_backward(*inputs, False, backward="Gluon")
    with pytest.raises(ValueError, match="backward='cudnn': choose one of auto, triton, gluon"):
        FlashSettings(backward="cudnn")


def test_forced_gluon_reaches_the_eager_path_and_the_custom_op(no_flash_choice, kernel_device):
    """Both run dispatch.flash_backward, so a Gluon backward forced where it cannot run (float32, which the
    Gluon kernel never takes, on any device) is the dispatcher's error in either, not a silent FA2 run; the forward
    (FA2's here) is not affected by the backward's setting."""
    q, k, v = (torch.randn(1, 2, 40, 64, device=kernel_device, requires_grad=True) for _ in range(3))
    reread_env(no_flash_choice, BACKWARD_ENV, "gluon")
    out = api.FlashAttentionTriton.apply(q, k, v, True)
    lse = out.grad_fn.saved_tensors[0]  # (lse, q, k, v, out), as the Function saves them
    with pytest.raises(ValueError, match="Gluon backward was asked for"):
        out.sum().backward()
    with pytest.raises(ValueError, match="Gluon backward was asked for"):
        torch.ops.cs336_systems.flash_triton_backward(q, k, v, out, lse, torch.ones_like(out), True)


class _Spies:
    """Which backward kernels dispatch.flash_backward launches, from now on (each spy runs the real one)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name, module, attribute in (("triton", fa2, "flash_backward_triton"),
                                        ("gluon", bwd, "flash_backward_gluon")):
            monkeypatch.setattr(module, attribute, self._spy(name, getattr(module, attribute)))

    def _spy(self, name, real):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)
        return spy


def test_small_calls_run_fa2s_backward_everywhere(no_flash_choice, kernel_device):
    """Short sequences take FA2's backward in "auto" on any device (the CPU interpreter included), eagerly and
    compiled: correct against float64, and switching the setting between compiled calls recompiles nothing (it is
    read inside the custom op, at run time)."""
    spies = _Spies(no_flash_choice)
    q, k, v, do = (torch.randn(1, 2, 24, 16, device=kernel_device) for _ in range(4))
    ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), True)
    torch.compiler.reset()
    compiles = []
    compiled = torch.compile(api.flash_attention_triton, backend=_counting(compiles, "aot_eager"),
                             fullgraph=True)
    for fn, setting in ((api.flash_attention_triton, "auto"), (compiled, "triton"), (compiled, "auto")):
        reread_env(no_flash_choice, BACKWARD_ENV, setting)
        got = _with_grads(fn, q, k, v, do, True)
        for name, x, want in zip(("O", "dQ", "dK", "dV"), got, ref):
            assert _rel_err(x, want) < 1e-4, f"{setting}: {name}"
    assert spies.calls == ["triton"] * 3 and len(compiles) == 1


# ----------------------------------------------------------------------------------------------
# on an sm_90 GPU
# ----------------------------------------------------------------------------------------------
# (q shape, k shape, causal, model layout, forward): lengths off the 128-key and 64-query tiles, rectangular both
# ways (causal aligned at the start), 3-d inputs, the model's strides; the FA2 forward feeding the Gluon backward;
# the long ones past the tiles' 4096-key boundary. "auto" gives these small calls FA2's backward (GLUON_BACKWARD_RULES);
# test_gpu_dispatch_by_input_on_hopper checks that it gives large ones Gluon's.
WIRE_CASES = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False, "auto"),
    ((1, 2, 777, 128), (1, 2, 777, 128), False, True, "auto"),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, True, "auto"),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False, "auto"),
    ((2, 257, 128), (2, 257, 128), True, False, "triton"),
    ((1, 2, 4100, 64), (1, 2, 4100, 64), True, True, "auto"),
    ((1, 2, 3000, 128), (1, 2, 4133, 128), False, False, "triton"),
    ((1, 2, 4097, 128), (1, 2, 4097, 128), True, False, "auto"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("backward", ["gluon", "auto"])
@pytest.mark.parametrize("q_shape,k_shape,causal,model_layout,forward", WIRE_CASES)
def test_gpu_autograd_function_with_the_gluon_backward(q_shape, k_shape, causal, model_layout, forward, backward,
                                                       no_flash_choice):
    """O, dQ, dK, dV through FlashAttentionTriton (the model's backend) with the backward forced to Gluon or left to
    the rule: within 2x (plus a floor) of PyTorch's own bf16 error against float64, and as close to the FA2
    backward fed the same forward."""
    q, k, v, do = (_fresh(shape, model_layout) for shape in (q_shape, k_shape, k_shape, q_shape))
    spies = _Spies(no_flash_choice)
    takes_gluon = backward == "gluon" or gluon_backward_pays(HOPPER, q_shape, k_shape, causal)
    reread_env(no_flash_choice, FORWARD_ENV, forward)
    with fa2.pinned_tiles(FA2_TILE, FA2_TILE):
        reread_env(no_flash_choice, BACKWARD_ENV, backward)
        got = _with_grads(api.FlashAttentionTriton.apply, q, k, v, do, causal)
        reread_env(no_flash_choice, BACKWARD_ENV, "triton")
        fa2_grads = _with_grads(api.FlashAttentionTriton.apply, q, k, v, do, causal)
    assert spies.calls == ["gluon" if takes_gluon else "triton", "triton"]
    ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), causal)
    own = _with_grads(naive_attention, q, k, v, do, causal)  # PyTorch's own attention in bf16
    what = f"{q_shape} {k_shape} causal={causal} forward={forward} backward={backward}"
    for i, name in enumerate(("O", "dQ", "dK", "dV")):
        assert torch.isfinite(got[i]).all(), f"{what}: {name} not finite"
        limit = 2 * _rel_err(own[i], ref[i]) + 2e-3
        err, err_fa2 = _rel_err(got[i], ref[i]), _rel_err(got[i], fa2_grads[i].double())
        assert err < limit and err_fa2 < limit, f"{what}: {name} error {err:.2e}, vs FA2 {err_fa2:.2e} ({limit:.2e})"


@pytest.mark.gpu
@needs_sm90
def test_gpu_dispatch_by_input_on_hopper(no_flash_choice):
    """On the device: the rule's long shapes take the Gluon backward; what the kernel does not take goes to FA2 in
    "auto" and is a clear error when Gluon is forced."""
    batch, heads, n, _ = gluon_call(GLUON_BACKWARD_RULES[64], 64, True)
    long = _backward_inputs((batch, heads, n, 64), (batch, heads, n, 64), device="cuda")
    short = _backward_inputs((batch, heads, n - 1, 64), (batch, heads, n - 1, 64), device="cuda")
    assert choose_backward(*long, True) == "gluon" and choose_backward(*short, True) == "triton"
    assert choose_backward(*long, True, backward="triton") == "triton"
    assert choose_backward(*short, True, backward="gluon") == "gluon"
    for dtype, head_dim, words in ((torch.float32, 64, "dtype torch.float32"), (torch.bfloat16, 32, "head dim 32")):
        other = _backward_inputs((batch, heads, n, head_dim), (batch, heads, n, head_dim), dtype=dtype, device="cuda")
        assert choose_backward(*other, True) == "triton"
        with pytest.raises(ValueError, match=words):
            choose_backward(*other, True, backward="gluon")
    q, k, v, out, lse, do = long
    with pytest.raises(ValueError, match="lse must be contiguous float32"):  # an L that no forward of ours writes
        choose_backward(q, k, v, out, lse.double(), do, True, backward="gluon")


COMPILE_LENGTHS = (1000, 1337)  # the second one new: Dynamo recompiles once (with dynamic lengths)


@pytest.mark.gpu
@needs_sm90
def test_gpu_compiled_with_the_gluon_backward(no_flash_choice):
    """torch.compile(fullgraph=True) (a graph break would raise) with the backward forced to FA2, then to Gluon:
    the Gluon backward runs inside the compiled graph's one custom op, with as many compiles as with FA2 over two
    calls of different lengths, and the same accuracy."""
    spies = _Spies(no_flash_choice)
    compiles = {}
    for backward in ("triton", "gluon"):
        reread_env(no_flash_choice, BACKWARD_ENV, backward)
        torch.compiler.reset()
        graphs = []
        compiled = torch.compile(api.flash_attention_triton, backend=_counting(graphs, "inductor"),
                                 fullgraph=True)
        for n in COMPILE_LENGTHS:
            q, k, v, do = (_fresh((1, 2, n, 64), False) for _ in range(4))
            with fa2.pinned_tiles(FA2_TILE, FA2_TILE):
                got = _with_grads(compiled, q, k, v, do, True)
            ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), True)
            own = _with_grads(naive_attention, q, k, v, do, True)
            for i, name in enumerate(("O", "dQ", "dK", "dV")):
                limit = 2 * _rel_err(own[i], ref[i]) + 2e-3
                assert _rel_err(got[i], ref[i]) < limit, f"backward={backward} n={n}: {name}"
        compiles[backward] = len(graphs)
    assert spies.calls == ["triton"] * 2 + ["gluon"] * 2
    assert 1 <= compiles["gluon"] <= compiles["triton"], compiles


# the timing rows of the run each pass's TILES[64] was chosen from (tests/data/README.md)
D64_SEARCH = {pass_: DATA / f"flash_gluon_d64_{pass_}.csv" for pass_ in ("forward", "backward")}


def _assert_shipped_is_best(rows: pd.DataFrame, shipped: pd.DataFrame) -> None:
    """Of a tile search's timing rows (`ratio_vs_shipped`: each variant's time over the tile shipped before, per
    shape), the shipped tile's rows have the least geometric mean, and none is over the runs' spread (2%)."""
    geomean = rows.assign(log=np.log(rows["ratio_vs_shipped"])).groupby("provider")["log"].mean()
    assert geomean.idxmin() == shipped["provider"].iloc[0], geomean.sort_values()
    assert (shipped["ratio_vs_shipped"] <= 1.02).all(), shipped[["case", "ratio_vs_shipped"]]


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_shipped_d64_tiles_are_the_searchs_best(pass_):
    """TILES[64] of each kernel against the tile search it was chosen from (one H100 run, every candidate timed in
    the same rounds at five shapes): the shipped tile is a measured candidate, has the least geometric mean of its
    time over the tile shipped before (the run's `shipped`, ratio 1), and is never more than the run's spread (2%)
    slower than that tile at any shape. Changing the tiles needs a new search."""
    from cs336_systems.kernels.flash import gluon_fwd as fwd

    rows = pd.read_csv(D64_SEARCH[pass_])
    rows = rows[(rows["section"] == "timing") & (rows["pass"] == pass_) & (rows["provider"] != "cudnn")]
    tile = (fwd if pass_ == "forward" else bwd).tile_for(64)
    # the search's fields of the shipped tile (the forward is persistent, the backward's dQ split, as shipped)
    fields = ({"num_slots": tile.num_slots, "persistent": True} if pass_ == "forward" else
              {"num_slots": tile.num_slots, "split_dq": True, "defer_dq": tile.pingpong, "block_m": tile.block_m})
    shipped = rows[pd.concat([rows[f"tile_{f}"] == value for f, value in fields.items()], axis=1).all(axis=1)]
    assert shipped["case"].nunique() == 5 == rows["case"].nunique(), shipped
    _assert_shipped_is_best(rows, shipped)


D128_FORWARD_SEARCH = DATA / "flash_gluon_d128_forward.csv"  # its timing rows (its checks all passed)


def test_shipped_d128_forward_tile_is_the_searchs_best():
    """TILES[128] of the forward against the run it was chosen from (one H100 run, the one-tile and the persistent
    forward timed in the same rounds at seven shapes, each variant named by its grid and ring depth): the shipped tile
    is the variant with the least geometric mean of its time over the tile shipped before, and is never slower than
    that tile by more than the run's spread (2%) at any shape. Changing the tile needs a new run."""
    import re

    from cs336_systems.kernels.flash import gluon_fwd as fwd

    rows = pd.read_csv(D128_FORWARD_SEARCH)
    rows = rows[(rows["section"] == "timing") & (rows["provider"] != "cudnn")]
    assert rows["case"].nunique() == 7

    def tile_of(name: str) -> tuple[int, bool]:
        return int(re.search(r"_s(\d+)$", name).group(1)), name.startswith("persistent")

    tile = fwd.tile_for(128)
    shipped = rows[[tile_of(name) == (tile.num_slots, True) for name in rows["provider"]]]  # persistent
    assert shipped["case"].nunique() == 7, shipped
    _assert_shipped_is_best(rows, shipped)
