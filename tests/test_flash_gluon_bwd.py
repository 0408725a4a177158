"""The Gluon FlashAttention backward for Hopper (`kernels/flash/gluon_bwd.py`).

On CPU: its plain-Python parts (tiles, the program order, which query tiles a key tile visits and masks, the padded
row length, the support checks and their errors, the TMA reduce-add's version check), the preprocessing kernel
(plain Triton: under the interpreter on CPU, compiled on a GPU) against torch, the host side of a call with the
launches recorded (both through FastLaunchers, the inputs checked once when dispatched and by the public entry
otherwise, dQ's scaling), and, in a process of its own, a compile for sm_90 with 0 spills. On an sm_90 GPU (marked `gpu`): dQ, dK, dV against a float64 autograd reference and
against our Triton FA2 backward on awkward shapes (lengths not tile multiples, causal or not, rectangular both ways,
3-d inputs, the model's strides, a stride-0 dO), with the shipped tiles (lockstep at d=64, ping-pong at d=128); and
the fast launch path against Triton's public one.
"""

import subprocess
import sys

import pandas as pd
import pytest
import torch

from cs336_systems.kernels.flash import dispatch
from cs336_systems.kernels.flash.host import launch
from cs336_systems.kernels.flash import gluon_bwd as bwd
from cs336_systems.kernels.flash.dispatch import GLUON_BACKWARD_RULES, HOPPER
from cs336_systems.kernels.flash.gluon_common import as_4d, descriptor_launch_key, exact_inputs, exact_reference, tma_reduce_problem
from cs336_systems.kernels.flash.gluon_bwd import (
    TILES,
    BwdTile,
    backward_problem,
    gluon_backward_supported,
    padded_queries,
    program_order,
    query_steps,
)
from cs336_systems.kernels.flash.host.launch import cdiv
from cs336_systems.kernels.flash.settings import use_flash_settings
from cs336_systems.model.attention import naive_attention
from tests.kernel_devices import gluon_call
from tests.test_flash_gluon import needs_sm90
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# plain Python, on CPU
# ----------------------------------------------------------------------------------------------
def test_tiles_fit_shared_memory_and_keep_the_masking_assumption():
    for d, tile in TILES.items():
        assert tile.head_dim == d and tile.keys_per_consumer == 64
        assert tile.shared_bytes() <= 227 * 1024
        assert tile.masked_steps * tile.block_m == tile.block_n
        assert tile.dq_columns * 2 == d
    with pytest.raises(ValueError, match="block_n must be 2 x 64"):
        BwdTile(64, block_n=256)
    with pytest.raises(ValueError, match="block_m must divide block_n"):
        BwdTile(64, block_m=96)
    with pytest.raises(ValueError, match="head dim 32"):
        bwd.tile_for(32)


def test_the_pingpong_schedule_ships_at_d128_and_flags_are_checked():
    """TILES ships ping-pong at d=128 only, as measured; a flag given as a string or int (which Triton would take as a
    truthy constexpr) is refused, naming the field and the value; ping-pong adds two (128, 64) dS^T buffers."""
    assert not TILES[64].pingpong and TILES[128].pingpong
    assert BwdTile(128, pingpong=True).shared_bytes() - BwdTile(128).shared_bytes() == 2 * 128 * 64 * 2
    for value in ("yes", 1):
        with pytest.raises(ValueError, match=f"pingpong must be a bool, got {value!r}"):
            BwdTile(128, pingpong=value)
    with pytest.raises(ValueError, match=r"need \d+ B of shared memory"):
        BwdTile(128, num_slots=4)


def test_dq_swizzle_is_checked_and_reaches_the_dq_descriptor():
    with pytest.raises(ValueError, match="dq_swizzle must be 32 or 128 \\(bytes\\), got 64"):
        BwdTile(64, dq_swizzle=64)
    for head_dim, swizzle in ((64, 32), (128, 128)):
        assert TILES[head_dim].dq_swizzle == swizzle
        q, k, v, do, dk, dv = (torch.zeros(1, 2, 256, head_dim, dtype=torch.bfloat16) for _ in range(6))
        dq_acc = torch.zeros(1, 2, 256, head_dim)
        rows = torch.zeros(2, 256)
        args, _, _ = bwd.kernel_launch(q, k, v, do, dk, dv, dq_acc, rows, rows, True, 0.125)
        dq_desc = args[6]
        assert dq_desc.block_shape == [1, 1, TILES[head_dim].block_m, head_dim // 2]
        assert dq_desc.layout.swizzle_byte_width == swizzle


@pytest.mark.parametrize("n_kv_tiles,batch_heads", [(5, 3), (1, 4), (7, 1)])
def test_program_order_covers_every_tile_once_one_head_at_a_time(n_kv_tiles, batch_heads):
    order = program_order(n_kv_tiles, batch_heads)
    assert sorted(order) == [(t, bh) for t in range(n_kv_tiles) for bh in range(batch_heads)]
    assert [bh for _, bh in order] == sorted(bh for _, bh in order)  # one head after another
    tile = TILES[64]
    n = n_kv_tiles * tile.block_n - 5
    work = [query_steps(t, n, tile, True)[1] for t, bh in order if bh == 0]
    assert work == sorted(work, reverse=True)  # causal: heaviest key tile first


@pytest.mark.parametrize("n_q,n_k", [(1000, 1000), (1, 1), (300, 1000), (1000, 300), (128, 129), (129, 64), (65, 700)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_query_steps_visit_every_visible_pair_and_mask_only_the_first(n_q, n_k, head_dim):
    """Brute force over (query, key) pairs: a key tile visits every query tile holding a query that sees one of its
    keys; causal, every query tile where some valid query does not see some valid key of it is among the first
    `masked_steps` visited (the kernel masks only those)."""
    tile = TILES[head_dim]
    queries = torch.arange(n_q)
    for causal in (True, False):
        for kv_tile in range(-(-n_k // tile.block_n)):
            keys = torch.arange(kv_tile * tile.block_n, min((kv_tile + 1) * tile.block_n, n_k))
            first, steps = query_steps(kv_tile, n_q, tile, causal)
            visited = set(range(first, first + steps))
            sees = (keys[None, :] <= queries[:, None]) if causal else torch.ones(n_q, len(keys), dtype=torch.bool)
            needed = set((queries[sees.any(1)] // tile.block_m).tolist())
            assert needed <= visited, (causal, kv_tile)
            if causal:
                partly_hidden = set((queries[~sees.all(1)] // tile.block_m).tolist()) & visited
                assert partly_hidden <= set(range(first, first + tile.masked_steps)), kv_tile


def test_padded_queries_are_whole_tiles():
    tile = TILES[128]
    assert [padded_queries(n, tile) for n in (1, 63, 64, 65, 1000)] == [64, 64, 64, 128, 1024]


def test_support_checks_name_the_problem():
    bf16 = torch.bfloat16
    q = torch.empty(2, 4, 100, 64, dtype=bf16)
    lse = torch.empty(2, 4, 100)
    problems = {
        "dtype torch.float32": (torch.empty(2, 4, 100, 64), None, None),
        "head dim 32": (torch.empty(2, 4, 100, 32, dtype=bf16), None, None),
        "must match q": (q, torch.empty(2, 4, 100, 64, dtype=torch.float16), None),
        "lse must be contiguous float32": (q, q, torch.empty(2, 4, 99)),
    }
    for words, (qq, o, ll) in problems.items():
        o = qq if o is None else o
        ll = torch.empty(qq.shape[:-1]) if ll is None else ll
        assert words in backward_problem(qq, qq, qq, o, o, ll), words
    assert "needs CUDA tensors" in backward_problem(q, q, q, q, q, lse)  # the device last: everything else fits
    assert not gluon_backward_supported(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        bwd.flash_backward_gluon(q, q, q, q, q, lse, True)


def test_tma_reduce_add_is_available_and_its_absence_is_named(monkeypatch):
    assert tma_reduce_problem() is None  # Triton 3.6, which the project pins
    from triton._C.libtriton import gluon_ir

    monkeypatch.delattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    assert "create_async_tma_reduce" in tma_reduce_problem()


def test_preprocess_kernel_matches_torch(kernel_device):
    """L2 = L log2(e) and D = rowsum(dO O) per padded row, +inf and 0 past the last query; O in the model's strides,
    dO once with stride 0 (what o.sum().backward() gives); the dQ accumulator (NaN before; the model's strides, then
    contiguous) zeroed, every element."""
    tile = TILES[64]
    batch, heads, n, d = 2, 3, 70, 64
    o = torch.randn(batch, n, heads, d, device=kernel_device).to(torch.bfloat16).transpose(1, 2)
    lse = torch.randn(batch, heads, n, device=kernel_device)
    n_pad = padded_queries(n, tile)
    model_layout_nan = torch.full((batch, n, heads, d), float("nan"), device=kernel_device).transpose(1, 2)
    for do, acc in ((torch.randn(batch, heads, n, d, device=kernel_device).to(torch.bfloat16), model_layout_nan),
                    (torch.ones((), device=kernel_device, dtype=torch.bfloat16).expand(batch, heads, n, d),
                     torch.full((batch, heads, n, d), float("nan"), device=kernel_device))):
        l2 = torch.empty(batch * heads, n_pad, device=kernel_device)
        delta = torch.empty_like(l2)
        bwd._bwd_preprocess_kernel[(n_pad // tile.block_m, batch * heads)](
            o, do, lse, l2, delta, acc, *o.stride(), *do.stride(), *acc.stride(), heads, n, n_pad, HEAD_DIM=d,
            BLOCK=tile.block_m)
        assert (acc == 0).all()
        expected = (o.float() * do.float()).sum(-1).reshape(batch * heads, n)
        torch.testing.assert_close(delta[:, :n], expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(l2[:, :n], lse.reshape(batch * heads, n) * LOG2E)
        assert (delta[:, n:] == 0).all() and torch.isposinf(l2[:, n:]).all()


# ----------------------------------------------------------------------------------------------
# the host side of a call, on CPU: launches through FastLaunchers, inputs checked once
# ----------------------------------------------------------------------------------------------
class _Indexable:
    """Stands for a Triton object launched as `obj[grid](*args)`: `obj[grid]` is `at(grid)`."""

    def __init__(self, at):
        self.at = at

    def __getitem__(self, grid):
        return self.at(grid)


def _recording_launchers(monkeypatch, on_launch=lambda name, args: None) -> list:
    """Swap the backward's two FastLaunchers for fresh ones around the same kernels (and key), built as on a GPU
    (the fast path on), whose Triton side records: the public path `kernel[grid](...)` appends ("public", name) and
    returns a compiled kernel whose runner, the fast path, appends ("run", name, grid, args); both call
    `on_launch(name, args)`. The kernels themselves fail the test if launched, so a launch around the launchers
    shows. Returns the list of records."""
    assert bwd.PREPROCESS.kernel is bwd._bwd_preprocess_kernel and bwd.LAUNCHER.kernel is bwd._flash_bwd_gluon_kernel
    assert bwd.LAUNCHER.key is descriptor_launch_key  # the main kernel's arguments include TMA descriptors
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(bwd, "_PLANS", {})  # plans hold the launchers' binaries: none from another test's
    records = []
    for attribute, name in (("PREPROCESS", "_bwd_preprocess_kernel"), ("LAUNCHER", "_flash_bwd_gluon_kernel")):
        launcher = launch.FastLauncher(getattr(bwd, name), key=getattr(bwd, attribute).key)
        assert launcher.problem is None, launcher.problem

        def run(grid, name=name):
            return lambda *args: records.append(("run", name, grid, args)) or on_launch(name, args)

        def public(grid, name=name, compiled=_Indexable(run)):
            return lambda *args, **kwargs: records.append(("public", name)) or on_launch(name, args) or compiled

        launcher.kernel = _Indexable(public)
        monkeypatch.setattr(bwd, attribute, launcher)
        monkeypatch.setattr(bwd, name, _Indexable(lambda grid, name=name: pytest.fail(f"{name} launched directly")))
    return records


def _counted_checks(monkeypatch) -> list:
    """Count the backward's input checks (the dispatch's and the entry's alike call backward_problem)."""
    checks, real = [], bwd.backward_problem
    monkeypatch.setattr(bwd, "backward_problem", lambda *args: checks.append(args) or real(*args))
    return checks


def _pretend_hopper(monkeypatch):
    """The device checks answer as an H100 would, so that CPU tensors reach the Gluon backward's host code."""
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    monkeypatch.setattr(dispatch, "device_capability", lambda q: HOPPER)
    monkeypatch.setattr(bwd, "device_problem", lambda q: None)


def _model_layout_inputs(batch, heads, n, d, dtype=torch.bfloat16):
    """q, k, v, o, dO in the model's (batch, seq, heads, dim) memory viewed as (batch, heads, seq, dim), and L."""
    q, k, v, o, do = (torch.randn(batch, n, heads, d).to(dtype).transpose(1, 2) for _ in range(5))
    return q, k, v, o, do, torch.randn(batch, heads, n)


# (setting, heads, n) at batch 1 and d=64: forced Gluon at a short call, and the smallest call "auto" gives Gluon
_DISPATCHED = [("gluon", 2, 100), ("auto", *gluon_call(GLUON_BACKWARD_RULES[64], 64, True)[1:3])]


@pytest.mark.parametrize("setting,heads,n", _DISPATCHED)
@pytest.mark.parametrize("fast_launch", [True, False])
def test_dispatched_backward_checks_once_and_launches_through_fast_launchers(monkeypatch, setting, heads, n,
                                                                             fast_launch):
    """dispatch.flash_backward, choosing Gluon (forced, or "auto" at a long shape): its inputs are checked once
    per call (in the choice, not again in the entry); both kernels launch through their FastLaunchers with the
    setting the pass read (no launcher reads the settings again): the first call of a layout through Triton's
    public path, the next one (fresh tensors) through the layout's plan: the cached runners with that call's own
    arguments, the descriptors' bases included; with fast_launch off, every call takes the public path."""
    _pretend_hopper(monkeypatch)
    checks, records = _counted_checks(monkeypatch), _recording_launchers(monkeypatch)
    unread = lambda: pytest.fail("the settings were read again below flash_backward")  # noqa: E731
    monkeypatch.setattr(launch, "flash_settings", unread)
    monkeypatch.setattr(bwd, "flash_settings", unread)
    for call in range(2):
        q, k, v, o, do, lse = _model_layout_inputs(1, heads, n, 64)
        with use_flash_settings(backward=setting, fast_launch=fast_launch):
            dq, dk, dv = dispatch.flash_backward(q, k, v, o, lse, do, True)
        assert len(checks) == call + 1
        assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()
    first, second = records[:2], records[2:]
    assert first == [("public", "_bwd_preprocess_kernel"), ("public", "_flash_bwd_gluon_kernel")]
    if not fast_launch:
        assert second == first
        return
    assert [r[:2] for r in second] == [("run", "_bwd_preprocess_kernel"), ("run", "_flash_bwd_gluon_kernel")]
    (_, _, pre_grid, pre_args), (_, _, grid, args) = second
    tile = bwd.tile_for(64)  # the preprocessing runs one program per block_m rows, the main kernel per block_n keys
    assert pre_grid == (cdiv(n, tile.block_m), heads, 1) and grid == (cdiv(n, tile.block_n) * heads, 1, 1)  # (x, y, z)
    assert pre_args[0].data_ptr() == o.data_ptr() and pre_args[1].data_ptr() == do.data_ptr()  # this call's O, dO
    assert len(args) == len(bwd.LAUNCHER.names)  # the whole signature
    for descriptor, t in zip(args, (q, k, v, do, dk, dv)):  # this call's tensors, not the first call's, in the
        assert descriptor.base.data_ptr() == t.data_ptr()  # geometry the launcher encodes (the plan's HostDescriptor)
        assert list(descriptor.shape) == list(as_4d(t).shape) and list(descriptor.strides) == list(as_4d(t).stride())


def test_public_entry_checks_its_inputs_unless_told_they_are_checked(monkeypatch):
    """flash_backward_gluon without `checked` looks for problems itself (a ValueError naming the problem, before
    any launch), once per call; with checked=True (what the dispatch passes) it does not look."""
    _pretend_hopper(monkeypatch)
    checks, records = _counted_checks(monkeypatch), _recording_launchers(monkeypatch)
    q, k, v, o, do, lse = _model_layout_inputs(1, 2, 100, 64)
    d32 = torch.randn(1, 2, 100, 32, dtype=torch.bfloat16)  # a head dim the kernel does not take
    bad = {"lse must be contiguous float32": (q, k, v, o, do, lse.double()),
           "o .* and do .* must match q": (q, k, v, o.half(), do, lse),
           "head dim 32 is not supported": (d32, d32, d32, d32, d32, lse)}
    for words, inputs in bad.items():
        with pytest.raises(ValueError, match=f"flash_gluon_bwd: .*{words}"):
            bwd.flash_backward_gluon(*inputs, True)
    assert len(checks) == 3 and records == []
    bwd.flash_backward_gluon(q, k, v, o, do, lse, True)
    assert len(checks) == 4 and len(records) == 2
    bwd.flash_backward_gluon(q, k, v, o, do, lse, True, checked=True)
    dispatch.gluon_backward(q, k, v, o, lse, do, True, chosen=True)
    assert len(checks) == 4 and len(records) == 6


@pytest.mark.parametrize("shape", [(2, 3, 77, 64), (3, 50, 128)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_dq_is_the_accumulator_scaled_into_qs_dtype_and_layout(monkeypatch, shape, scale):
    """After the main kernel, dQ = its float32 accumulator x scale (default 1/sqrt(d)), rounded once to q's dtype,
    in q's layout (the model's strides; 3-d inputs): the accumulator is the one the preprocessing zeroes (its
    sixth argument, with its strides), the dQ descriptor's base, with q's strides (so that the scale-and-cast pass
    runs over matching strides); the main kernel's stand-in writes random values into it, and dQ must equal the
    float32 product rounded, bit for bit."""
    _pretend_hopper(monkeypatch)
    written, zeroed = [], []

    def fill_accumulator(name, args):
        if name == "_bwd_preprocess_kernel":
            zeroed.append(args[5])
            assert args[14:18] == args[5].stride()  # the accumulator's own strides, after O's and dO's
        if name == "_flash_bwd_gluon_kernel":
            accumulator = args[6].base  # desc_dq: (batch, head, row, col) float32
            assert accumulator.dtype == torch.float32 and accumulator.stride() == as_4d(q).stride()
            assert accumulator is zeroed[0] and list(args[6].strides) == list(accumulator.stride())
            written.append(accumulator.copy_(torch.randn(accumulator.shape) * 100).clone())

    _recording_launchers(monkeypatch, fill_accumulator)
    if len(shape) == 4:  # the model's layout
        batch, heads, n, d = shape
        q = torch.randn(batch, n, heads, d).to(torch.bfloat16).transpose(1, 2)
    else:
        q = torch.randn(shape).to(torch.bfloat16)
    lse = torch.randn(q.shape[:-1])
    dq, _, _ = bwd.flash_backward_gluon(q, q, q, q, q, lse, True, scale)
    expected = (written[0] * (shape[-1] ** -0.5 if scale is None else scale)).to(q.dtype)
    assert dq.dtype == q.dtype and dq.stride() == q.stride()
    assert torch.equal(dq if dq.dim() == 4 else dq.unsqueeze(1), expected)


@pytest.mark.parametrize("causal", [True, False])
def test_exact_reference_is_exact_in_the_kernels_precisions(causal):
    """The EXACT check's premise: with exact_inputs, the kernel's arithmetic (16-bit P^T and dS^T, float32 products
    and sums) gives the float64 reference's integers exactly, so the GPU test may compare bit for bit."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = exact_inputs((2, 3, 200, 64), (2, 3, 150, 64), "cpu", gen)
    ref = exact_reference(q, k, v, do, causal)
    s = q.float() @ k.float().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(torch.ones(200, 150, dtype=torch.bool).triu(1), 0.0)
    ds = (p * (do.float() @ v.float().transpose(-1, -2))).to(torch.bfloat16).float()
    p = p.to(torch.bfloat16).float()
    emulated = (ds @ k.float(), ds.transpose(-1, -2) @ q.float(), p.transpose(-1, -2) @ do.float())
    for e, r in zip(emulated, ref):
        assert torch.equal(e.to(torch.bfloat16), r.to(torch.bfloat16))
        assert r.abs().max() > 8  # not trivially zero
    with pytest.raises(ValueError, match="not exact"):  # dP x 37^2: dS beyond what bf16 holds exactly
        exact_reference(q, k, v * 37, do * 37, causal)


# bytes spilled per thread by the shipped tiles, causal, bf16 (ptxas 12.8 of Triton 3.6): d=128 ping-pong's 4 B and
# d=64 lockstep's 84 B stayed after every restructuring tried, and they are still the fastest schedules measured
# (DECISIONS.md#backward-schedule)
SPILL_BYTES = {64: 84, 128: 4}


@pytest.mark.parametrize("head_dim", sorted(SPILL_BYTES))
def test_compiles_for_sm90_with_the_known_spills(tmp_path, head_dim):
    """The causal bf16 configuration of each shipped tile compiled for the H100 on this machine through the launcher's
    own host code: no more spills than known, the tiles' shared memory, the dQ reduce-add lowered to TMA. In a
    process of its own (Triton's JIT, a stand-in driver)."""
    out = tmp_path / "gluon_bwd.csv"
    subprocess.run([sys.executable, "-m", "cs336_systems.bench.flash_gluon_bwd_resources", "--head-dims",
                    str(head_dim), "--only-first", "--out", str(out)], check=True, capture_output=True, text=True,
                   timeout=600)
    rows = pd.read_csv(out)
    assert len(rows) == 1 and (rows["status"] == "ok").all(), rows.to_dict("records")
    row = rows.iloc[0]
    assert row["variant"] == "shipped" and bool(row["pingpong"]) == TILES[head_dim].pingpong
    limit = SPILL_BYTES[head_dim]
    assert row["spill_store_bytes"] <= limit and row["spill_load_bytes"] <= limit
    tile_bytes = row["tile_shared_bytes"]
    assert TILES[head_dim].shared_bytes() == tile_bytes <= row["shared_bytes"] <= tile_bytes + 1024
    assert row["tma_reduce_ops"] >= 1


# ----------------------------------------------------------------------------------------------
# on an sm_90 GPU
# ----------------------------------------------------------------------------------------------
# (q shape, k shape, causal, model layout): lengths off the 64-row and 128-key tiles, one query, rectangular both
# ways (causal aligned at the start; n_q < n_k leaves key tiles that no query sees), 3-d inputs, the model's strides.
GPU_CASES = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False),
    ((2, 3, 777, 128), (2, 3, 777, 128), False, True),
    ((1, 4, 513, 128), (1, 4, 513, 128), True, True),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, False),
    ((1, 4, 1000, 64), (1, 4, 300, 64), True, True),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False),
    ((3, 1, 64), (3, 1, 64), True, False),
    ((2, 257, 128), (2, 257, 128), True, False),
]
FA2_TILE = (64, 32, 4, 2)  # one FA2 config on the GPU (as test_flash): no autotuning per test shape


def _rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1.0)).item()


def _fresh(shape, model_layout, dtype=torch.bfloat16):
    t = torch.randn(shape, device="cuda", dtype=torch.float64)
    if model_layout:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(dtype)


def _check_against_float64_and_fa2(q, k, v, do, causal):
    from cs336_systems.kernels.flash.gluon_fwd import flash_attention_gluon_forward
    from cs336_systems.kernels.flash.fa2 import flash_backward_triton, pinned_tiles

    o, lse = flash_attention_gluon_forward(q, k, v, causal)
    grads = bwd.flash_backward_gluon(q, k, v, o, do, lse, causal)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(naive_attention(*leaves, causal), leaves, do.double())
    with pinned_tiles(FA2_TILE, FA2_TILE):
        fa2_grads = flash_backward_triton(q, k, v, o, lse, do, causal)
    for name, g, f, r, t in zip(("dQ", "dK", "dV"), grads, fa2_grads, ref, (q, k, v)):
        assert g.dtype == t.dtype and g.stride() == t.stride(), name
        assert torch.isfinite(g).all(), name
        # our FA2 backward's own error on the same O and L, with a floor for the one-token cases (errors ~0)
        err, limit = _rel_err(g, r), 2 * _rel_err(f, r) + 2e-3
        assert err < limit, f"{name}: error {err:.2e} vs float64 (limit {limit:.2e})"
        assert _rel_err(g, f) < limit, name


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("q_shape,k_shape,causal,model_layout", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_float64_and_flash_triton(q_shape, k_shape, causal, model_layout, dtype):
    q, k, v = (_fresh(s, model_layout, dtype) for s in (q_shape, k_shape, k_shape))
    _check_against_float64_and_fa2(q, k, v, _fresh(q_shape, model_layout, dtype), causal)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_stride0_grad_out(head_dim, causal):
    """A ragged length with the dO of o.sum() (stride 0: copied for TMA)."""
    shape = (2, 3, 777, head_dim)
    q, k, v = (_fresh(shape, False) for _ in range(3))
    do = torch.ones((), device="cuda", dtype=q.dtype).expand(shape)
    _check_against_float64_and_fa2(q, k, v, do, causal)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_exact_pipeline(head_dim, causal):
    """EXACT: P^T = S^T mod 8 with integer inputs, O = 0 and scale 1, so every product and sum is an exact integer:
    dQ, dK, dV must equal the float64 reference rounded to bf16, bit for bit, on repeated launches (any lost,
    repeated or reordered tile, a barrier race or a register-A hazard shows as a mismatch). Ragged lengths,
    rectangular."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    q, k, v, do = exact_inputs((2, 3, 777, head_dim), (2, 3, 1000, head_dim), "cuda", gen)
    expected = [g.to(torch.bfloat16) for g in exact_reference(q, k, v, do, causal)]
    o, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], device="cuda")
    for _ in range(3):
        grads = bwd.flash_backward_gluon(q, k, v, o, do, lse, causal, scale=1.0, exact=True)
        for name, g, e in zip(("dQ", "dK", "dV"), grads, expected):
            assert torch.equal(g, e), f"{name}: {int((g != e).sum())} mismatches"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_fast_launch_matches_the_public_path(head_dim):
    """From the second call of a layout both launches run the cached binaries (FastLauncher): with fresh inputs each
    call, the same gradients as Triton's public launch path (fast_launch off). EXACT (integer arithmetic): dQ, dK, dV
    bit for bit. The real softmax: dK and dV bit for bit (one program writes each key tile), dQ within one bf16
    rounding step (2^-8) in norm: its float32 reduce-adds from different key tiles land in any order, so the fast
    and the public run may round differently."""
    from cs336_systems.kernels.flash.gluon_fwd import flash_attention_gluon_forward

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    q_shape, k_shape = (2, 3, 777, head_dim), (2, 3, 1000, head_dim)
    for _ in range(3):
        q, k, v, do = exact_inputs(q_shape, k_shape, "cuda", gen)
        o, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], device="cuda")
        fast, public = (bwd.flash_backward_gluon(q, k, v, o, do, lse, False, scale=1.0, exact=True,
                                                 fast_launch=fast_launch)
                        for fast_launch in (True, False))
        for name, f, p in zip(("dQ", "dK", "dV"), fast, public):
            assert torch.equal(f, p), f"EXACT {name}: {int((f != p).sum())} mismatches"
        q, k, v, do = (_fresh(s, True) for s in (q_shape, k_shape, k_shape, q_shape))
        o, lse = flash_attention_gluon_forward(q, k, v, True)
        fast, public = (bwd.flash_backward_gluon(q, k, v, o, do, lse, True, fast_launch=fast_launch)
                        for fast_launch in (True, False))
        assert _rel_err(fast[0], public[0]) < 2**-8
        assert torch.equal(fast[1], public[1]) and torch.equal(fast[2], public[2])
