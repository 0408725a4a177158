"""The Gluon FlashAttention forward for Hopper (`kernels/fwd.py`).

On CPU: its plain-Python parts (tiles, the program order, the persistent variant's schedule and grid, the dispatch
predicate and its errors) and, in a process of its own, a compile for sm_90 with 0 spills (both variants).
On an sm_90 GPU (marked `gpu`): O and L against a float64 reference and against our Triton FlashAttention-2
forward on awkward shapes (lengths not tile multiples, causal or not, rectangular, d 64/128, the model's strides),
error within 2x (plus a small floor) of PyTorch's own bf16 attention; and the EXACT pipeline check (integer
inputs, P = S mod 8: every value exact, so any lost or reordered tile, or a register-A hazard, shows as a
mismatch). Both for the one-tile-per-program kernel and the persistent one, which also runs on a few SMs' worth of
programs so that every program walks many tiles (the barrier state carried from tile to tile).

The wiring into the `flash_triton` backend (`kernels/dispatch.py`): on CPU, the shape rule against the
measured timings it was written from, and that the CPU and the interpreter take FA2; on an sm_90 GPU, O, L, dQ, dK,
dV through `FlashAttentionTriton` with the forward forced to Gluon or left to the rule, against float64 and the
FA2-only path, and `torch.compile(fullgraph=True)` compiling and recompiling as often as with FA2.
"""

import subprocess
import sys

import pandas as pd
import pytest
import torch

from cs336_systems.kernels.flash import dispatch
from cs336_systems.kernels.flash import gluon_fwd as fwd
from cs336_systems.kernels.flash import settings as settings_module
from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash.dispatch import (BACKWARD_ENV, FORWARD_ENV, GLUON_FORWARD_RULES, HOPPER,
                                                  choose_forward, gluon_pays)
from cs336_systems.kernels.flash.gluon_fwd import (
    TILES,
    GluonTile,
    HEADS_PER_GROUP,
    MAX_GROUPED_KEYS,
    gluon_supported,
    heads_per_group,
    key_tiles,
    layout_problem,
    persistent_grid,
    persistent_schedule,
    program_order,
    schedule_table,
    tile_works,
)
from cs336_systems.model.attention import attention_scores, naive_attention
from tests.kernel_devices import gluon_call

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def reread_env(monkeypatch, var: str, value: str | None = None) -> None:
    """Set (value None: unset) the CS336_FLASH_* variable `var` as for a process started with it: the settings read
    the environment once, so the next read here reads it again (restored after the test)."""
    if value is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(settings_module, "_from_env", None)
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel needs an sm_90 GPU")


# ----------------------------------------------------------------------------------------------
# plain Python, on CPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tiles,batch_heads,group", [(5, 3, 1), (4, 7, 3), (1, 5, 8), (6, 4, 4), (3, 10, 4)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_program_order_covers_every_tile_once_heaviest_first(n_tiles, batch_heads, group, is_causal):
    order = program_order(n_tiles, batch_heads, group, is_causal)
    assert sorted(order) == [(t, bh) for t in range(n_tiles) for bh in range(batch_heads)]
    # groups of `group` heads in turn; within a group every head's tile of one rank before the next rank
    for start in range(0, batch_heads, group):
        heads = min(group, batch_heads - start)
        block = order[start * n_tiles:(start + heads) * n_tiles]
        assert {bh for _, bh in block} == set(range(start, start + heads))
        tiles = [t for t, _ in block]
        expected = [n_tiles - 1 - r if is_causal else r for r in range(n_tiles) for _ in range(heads)]
        assert tiles == expected


def test_causal_work_is_non_increasing_within_a_group():
    """Causal: a program's key tiles (its work) never grow along the launch order within a group of heads."""
    tile = TILES[64]
    n = 1000
    n_tiles = -(-n // tile.rows)
    order = program_order(n_tiles, 6, 3, True)
    for start in (0, 3 * n_tiles):
        work = [key_tiles(t, n, n, tile, True) for t, _ in order[start:start + 3 * n_tiles]]
        assert work == sorted(work, reverse=True) and work[0] == n_tiles and work[-1] == 1


@pytest.mark.parametrize("n_q,n_k", [(1000, 1000), (1, 1), (300, 1000), (1000, 300), (128, 129), (129, 128)])
def test_key_tiles_reach_the_last_visible_key(n_q, n_k):
    tile = TILES[128]
    for causal in (True, False):
        for q_tile in range(-(-n_q // tile.rows)):
            rows = range(q_tile * tile.rows, min((q_tile + 1) * tile.rows, n_q))
            last_key = max(min(r, n_k - 1) for r in rows) if causal else n_k - 1
            assert key_tiles(q_tile, n_q, n_k, tile, causal) == last_key // tile.block_n + 1


def test_tiles_keep_the_masking_assumption_and_fit_shared_memory():
    for d, tile in TILES.items():
        assert tile.head_dim == d and tile.block_n == tile.rows
        assert tile.shared_bytes() <= 227 * 1024
    with pytest.raises(ValueError, match="block_n must be 2 x block_m"):
        GluonTile(64, block_m=64, block_n=64)


def _list_scheduled(works, programs):
    """Graham's list scheduling written out plainly (a scan, not a heap): each position in turn to the program
    with the least work so far, the lowest id among equals."""
    loads, walks = [0] * programs, [[] for _ in range(programs)]
    for position, work in enumerate(works):
        p = loads.index(min(loads))
        walks[p].append(position)
        loads[p] += work
    return walks


# (n_queries, n_keys, batch·heads, causal, programs): causal square (the sawtooth of work per head), rectangular
# both ways, non-causal (equal work: round robin), fewer tiles than programs, one program
SCHEDULE_CASES = [(16384, 16384, 16, True, 132), (4096, 4096, 128, True, 132), (1000, 300, 6, True, 7),
                  (300, 1000, 5, True, 4), (2048, 2048, 128, False, 132), (1000, 1000, 2, True, 132),
                  (777, 777, 3, True, 1)]


@pytest.mark.parametrize("n_q,n_k,batch_heads,causal,programs", SCHEDULE_CASES)
def test_persistent_schedule_walks_every_tile_once_in_order(n_q, n_k, batch_heads, causal, programs):
    tile = TILES[64]
    works = tile_works(n_q, n_k, batch_heads, 1, tile, causal)
    n_tiles = -(-n_q // tile.rows) * batch_heads
    assert len(works) == n_tiles
    walks = persistent_schedule(works, programs)
    assert len(walks) == programs
    assert sorted(p for walk in walks for p in walk) == list(range(n_tiles))  # every tile exactly once
    assert all(walk == sorted(walk) for walk in walks)  # each program in launch order: heaviest first per head
    assert walks == _list_scheduled(works, programs)
    if not causal:  # equal work: plain round robin, t = pid, pid + programs, ...
        assert walks == [list(range(p, n_tiles, programs)) for p in range(programs)]
    loads = [sum(works[p] for p in walk) for walk in walks]
    assert max(loads) - min(loads) <= max(works)  # list scheduling's bound (no program idles while work is left)
    # the table the kernel reads: offsets, then the positions of each program in turn
    table = schedule_table(walks)
    positions = table[programs + 1:]
    assert [positions[table[p]:table[p + 1]] for p in range(programs)] == walks


def test_persistent_schedule_balances_causal_work_better_than_round_robin():
    """Why list scheduling: walking t = pid, pid + grid, ... of the heaviest-first order gives some programs the
    heavy tiles of every head (the leaderboard shape: 1.5x the mean work); the list schedule stays within 1%."""
    tile = TILES[64]
    works = tile_works(16384, 16384, 16, 1, tile, True)
    mean = sum(works) / 132
    listed = max(sum(works[p] for p in walk) for walk in persistent_schedule(works, 132))
    round_robin = max(sum(works[p::132]) for p in range(132))
    assert listed < 1.01 * mean < 1.3 * mean < round_robin


def test_heads_per_group_rule():
    """Causal calls with at most MAX_GROUPED_KEYS keys take HEADS_PER_GROUP heads per group; non-causal calls and
    longer sequences one head at a time."""
    assert HEADS_PER_GROUP == 4 and MAX_GROUPED_KEYS == 8192
    assert heads_per_group(8192, True) == heads_per_group(1, True) == 4
    assert heads_per_group(8193, True) == heads_per_group(32768, True) == 1  # the 8B shape: 32768
    assert heads_per_group(1000, False) == 1


def test_grouped_schedule_balances_few_tiles_per_sm():
    """Why groups: with ~4 causal tiles per SM (1 x 16 x 4096, d=64), one head after another leaves the last head's
    heavy tiles to nearly full walks (the longest 1.27x the mean); four heads per group stay within 1%."""
    tile = TILES[64]

    def balance(group):
        works = tile_works(4096, 4096, 16, group, tile, True)
        return max(sum(works[p] for p in walk) for walk in persistent_schedule(works, 132)) / (sum(works) / 132)

    assert balance(4) < 1.01 < 1.2 < balance(1)


def test_kernel_launch_passes_the_group_rule():
    for n, causal, expected in ((1000, True, 4), (1000, False, 1), (8192, True, 4), (8200, True, 1)):
        q = torch.empty(1, 6, n, 128, dtype=torch.bfloat16)
        lse = torch.empty(1, 6, n)
        args, _, _ = fwd.kernel_launch(q, q, q, q, lse, causal)
        assert args[11] == expected == heads_per_group(n, causal)
    q = torch.empty(1, 3, 1000, 128, dtype=torch.bfloat16)  # fewer heads than the group
    assert fwd.kernel_launch(q, q, q, q, torch.empty(1, 3, 1000), True)[0][11] == 3


def test_kernel_launch_holds_q_in_registers_in_causal_d64_calls_only():
    """Q_REGS, the kernel's last argument, is on exactly where the A/B measured a gain: causal calls at head dim 64."""
    for head_dim in (64, 128):
        q = torch.empty(1, 2, 1000, head_dim, dtype=torch.bfloat16)
        lse = torch.empty(1, 2, 1000)
        for causal in (True, False):
            assert fwd.kernel_launch(q, q, q, q, lse, causal)[0][-1] == (causal and head_dim == 64)


def test_persistent_grid_and_schedule_errors():
    assert persistent_grid(2048, 132) == 132 and persistent_grid(48, 132) == 48 and persistent_grid(0, 132) == 1
    with pytest.raises(ValueError, match="programs must be >= 1, got 0"):
        persistent_schedule([1, 2], 0)


def test_dispatch_predicate_and_errors_name_the_problem():
    bf16 = torch.bfloat16
    q = torch.empty(2, 4, 100, 64, dtype=bf16)
    assert layout_problem(q, q, q) is None
    model_layout = torch.empty(2, 100, 4, 128, dtype=bf16).transpose(1, 2)
    assert layout_problem(model_layout, model_layout, model_layout) is None
    rect = torch.empty(2, 4, 333, 64, dtype=bf16)
    assert layout_problem(q, rect, rect) is None and layout_problem(q[:, 0], rect[:, 0], rect[:, 0]) is None
    problems = {
        "dtype torch.float32": torch.empty(2, 4, 100, 64),
        "head dim 32": torch.empty(2, 4, 100, 32, dtype=bf16),
        "unit stride": torch.empty(2, 4, 64, 100, dtype=bf16).transpose(2, 3),
        "16-byte aligned": torch.empty(2, 4, 100, 68, dtype=bf16)[..., :64],
    }
    for words, t in problems.items():
        assert words in layout_problem(t, t, t)
    assert "incompatible shapes" in layout_problem(q, rect[..., :32], rect[..., :32])
    assert not gluon_supported(q, q, q, True)  # CPU tensors
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fwd.flash_attention_gluon_forward(q, q, q, True)
    with pytest.raises(ValueError, match="head dim 32"):
        fwd.flash_attention_gluon_forward(*[problems["head dim 32"]] * 3, False)


def test_compiles_for_sm90_without_spills(tmp_path):
    """One configuration (d=128, causal, bf16) compiled for the H100 on this machine, through the launcher's
    own host code: 0 spills and the tiles' shared memory; the consumers' turns are named barriers whose ids are
    clear of those Triton gives its partitions (a Triton that used ids from TURN_BARRIER up would share a barrier
    with them). In a process of its own (Triton's JIT, a stand-in driver)."""
    out = tmp_path / "gluon.csv"
    subprocess.run([sys.executable, "-m", "cs336_systems.bench.flash_gluon_resources", "--head-dims", "128",
                    "--only-first", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    rows = pd.read_csv(out)
    assert len(rows) == 1 and (rows["status"] == "ok").all(), rows.to_dict("records")
    row = rows.iloc[0]
    assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0
    tile = TILES[128]
    assert tile.shared_bytes() <= row["shared_bytes"] <= tile.shared_bytes() + 1024
    triton_ids = [int(i) for i in str(row["triton_barrier_ids"]).split()]
    assert triton_ids and max(triton_ids) < fwd.TURN_BARRIER, triton_ids
    assert row["register_barriers"] >= 4  # each consumer's wait and pass, in the first key tile and the loop


# ----------------------------------------------------------------------------------------------
# on an sm_90 GPU
# ----------------------------------------------------------------------------------------------
# (q shape, k shape, causal, model layout): lengths off the 128-row tile, one query, rectangular both ways
# (causal aligned at the start), 3-d inputs, the model's (batch, seq, heads, dim) strides.
GPU_CASES = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False),
    ((2, 3, 777, 128), (2, 3, 777, 128), False, True),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, False),
    ((1, 4, 1000, 64), (1, 4, 300, 64), True, True),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False),
    ((3, 1, 64), (3, 1, 64), True, False),
    ((2, 257, 128), (2, 257, 128), True, False),
    ((1, 2, 4096, 128), (1, 2, 4096, 128), True, True),
]


# The forward's grids on the GPU, by the SMs the persistent grid is sized for (None: the device's). Three SMs' worth
# of programs make each program walk many tiles of several heads, whatever the test's size.
VARIANTS = {"persistent": None, "persistent_3_programs": 3}


def _run_variant(monkeypatch, variant, q, k, v, causal, exact=False):
    sms = VARIANTS[variant]
    if sms is not None:  # without fast launch: no plan of the device's grid is used, and none of this one kept
        monkeypatch.setattr(fwd, "sm_count", lambda device: sms)
        return fwd.flash_attention_gluon_forward(q, k, v, causal, exact=exact, fast_launch=False)
    return fwd.flash_attention_gluon_forward(q, k, v, causal, exact=exact)


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1.0)).item()


def _fresh(shape, model_layout, dtype=torch.bfloat16):
    t = torch.randn(shape, device="cuda", dtype=torch.float64)
    if model_layout:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(dtype)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fast_launch_matches_the_public_path():
    """From the second call of a layout the forward launches the cached binary (FastLauncher): with fresh inputs
    each time, the same O and L bit for bit as Triton's public launch path (the fast_launch setting off)."""
    for call in range(3):
        q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fast = fwd.flash_attention_gluon_forward(q, k, v, True, fast_launch=True)
        public = fwd.flash_attention_gluon_forward(q, k, v, True, fast_launch=False)
        for got, expected in zip(fast, public):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("q_shape,k_shape,causal,model_layout", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_matches_float64_and_flash_triton(q_shape, k_shape, causal, model_layout, dtype, variant, monkeypatch):
    from cs336_systems.kernels.flash.fa2 import flash_forward_triton, pinned_tiles

    q, k, v = _fresh(q_shape, model_layout, dtype), _fresh(k_shape, model_layout, dtype), _fresh(k_shape, model_layout, dtype)
    out, lse = _run_variant(monkeypatch, variant, q, k, v, causal)
    ref = naive_attention(q.double(), k.double(), v.double(), causal)
    ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
    own = naive_attention(q, k, v, causal)  # PyTorch's own attention in this dtype
    what = f"{q_shape} {k_shape} causal={causal} {dtype} {variant}"
    assert out.stride() == q.stride() and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), what
    err, limit = _rel_err(out, ref), 2 * _rel_err(own, ref) + 2e-3
    assert err < limit, f"{what}: O error {err:.2e} (limit {limit:.2e})"
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3, what  # float32 L of 16-bit scores
    with pinned_tiles((64, 32, 4, 2), (64, 32, 4, 2)):  # one config, as test_flash's GPU tests
        fa2_out, fa2_lse = flash_forward_triton(q, k, v, causal)
    assert _rel_err(out, fa2_out.double()) < limit, what
    torch.testing.assert_close(lse, fa2_lse, rtol=0, atol=1e-3)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_exact_pipeline(head_dim, causal, variant, monkeypatch):
    """EXACT: P = S mod 8 with inputs in {-1, 0, 1} (V sparse), so every product and sum is an exact integer: the
    output must equal the float64 result rounded to bf16, bit for bit, on repeated launches. 2 x 29 heads of 1500
    rows: 696 tiles, more than an H100's SMs, so the persistent grid walks several tiles per program too, and
    (causal) 58 heads in groups of four end with a group of two."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shape = (2, 29, 1500, head_dim)
    q, k = (torch.randint(-1, 2, shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    v = (torch.randint(-1, 2, shape, device="cuda", generator=gen)
         * (torch.rand(shape, device="cuda", generator=gen) < 0.25)).to(torch.bfloat16)
    s = q.double() @ k.double().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), 0.0)
    expected = (p @ v.double()).to(torch.bfloat16)
    for _ in range(3):
        out, _ = _run_variant(monkeypatch, variant, q, k, v, causal, exact=True)
        assert torch.equal(out, expected), f"{variant}: {int((out != expected).sum())} mismatches"


# ----------------------------------------------------------------------------------------------
# wired into the flash_triton backend (kernels/dispatch.py)
# ----------------------------------------------------------------------------------------------
FA2_TILE = (64, 32, 4, 2)  # one FA2 config on the GPU (as test_flash): no autotuning per test shape


def test_cpu_and_interpreter_take_fa2(monkeypatch):
    reread_env(monkeypatch, FORWARD_ENV)
    q = torch.empty(gluon_call(GLUON_FORWARD_RULES[64], 64, True), dtype=torch.bfloat16)  # all Gluon asks but the device
    assert layout_problem(q, q, q) is None and gluon_pays(HOPPER, q.shape, q.shape, True)
    assert choose_forward(q, q, q, True) == "triton"
    assert choose_forward(q, q, q, True, forward="triton") == "triton"
    with pytest.raises(ValueError, match="interpreter" if INTERPRET else "needs CUDA tensors"):
        choose_forward(q, q, q, True, forward="gluon")


def test_forward_setting_is_read_at_each_call(monkeypatch):
    q = torch.empty(1, 2, 40, 64, dtype=torch.bfloat16)
    reread_env(monkeypatch, FORWARD_ENV)
    assert dispatch.forward_setting() == "auto"
    for value in dispatch.FORWARDS:
        reread_env(monkeypatch, FORWARD_ENV, value)
        assert dispatch.forward_setting() == value
    assert dispatch.forward_setting("triton") == "triton"  # the argument wins over the environment
    assert choose_forward(q, q, q, False, forward="triton") == "triton"
    reread_env(monkeypatch, FORWARD_ENV, "fast")
    with pytest.raises(ValueError, match="CS336_FLASH_FORWARD='fast': choose one of auto, triton, gluon"):
        choose_forward(q, q, q, False)
    with pytest.raises(ValueError, match="forward='Gluon'"):
        choose_forward(q, q, q, False, forward="Gluon")


def test_forced_gluon_reaches_the_eager_path_and_the_custom_op(monkeypatch):
    """Both run dispatch.flash_forward, so a Gluon forward forced on the CPU is the dispatcher's error in
    either (and not a silent FA2 run)."""
    from cs336_systems.kernels.flash.api import FlashAttentionTriton

    q = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    reread_env(monkeypatch, FORWARD_ENV, "gluon")
    with pytest.raises(ValueError, match="Gluon forward was asked for"):
        FlashAttentionTriton.apply(q, q, q, True)
    with pytest.raises(ValueError, match="Gluon forward was asked for"):
        torch.ops.cs336_systems.flash_triton_forward(q, q, q, True)


def test_auto_on_a_pretend_hopper_runs_the_gluon_forward_once_checked(monkeypatch):
    """On CPU, with the device checks answering as an H100 would: a long bf16 call reaches the Gluon forward's entry
    with the dispatcher's checked=True (its input checks ran once, in the choice), and the entry without it still
    looks for problems itself."""
    reread_env(monkeypatch, FORWARD_ENV)
    monkeypatch.setattr(dispatch, "device_capability", lambda q: HOPPER)
    monkeypatch.setattr(fwd, "device_problem", lambda q: None)
    calls = []
    monkeypatch.setattr(fwd, "flash_attention_gluon_forward",
                        lambda q, k, v, is_causal, **options: calls.append(options) or "ran")
    q = torch.empty(gluon_call(GLUON_FORWARD_RULES[64], 64, True), dtype=torch.bfloat16)
    assert dispatch.flash_forward(q, q, q, True) == "ran"
    assert choose_forward(q[..., :16, :], q, q, True) == "triton"  # causal rows of <= 16 keys: FA2's
    assert calls == [{"checked": True, "fast_launch": True}]


def test_fast_launch_key_and_arguments_on_the_cpu(monkeypatch):
    """The forward's FastLauncher (no GPU: its public path is a stub): fresh tensors of one layout share a key and
    reach the runner with exactly `kernel_launch`'s arguments, which are the kernel's whole signature; a new layout
    (q in another dtype; k with other strides) is a new key, so it goes through Triton's public path again."""
    from cs336_systems.kernels.flash.host import launch

    monkeypatch.setattr(launch, "INTERPRET", False)
    launcher = launch.FastLauncher(fwd.LAUNCHER.kernel, key=fwd.descriptor_launch_key)
    assert launcher.problem is None
    public, runs = [], []
    compiled = type("Compiled", (), {"__getitem__": lambda self, grid: lambda *args: runs.append((grid, args))})()
    launcher.kernel = type("Public", (), {"__getitem__": lambda self, grid: lambda *a, **kw: public.append(a)
                                          or compiled})()

    def launch_once(dtype=torch.bfloat16, k_layout=False):
        q, k, v = (torch.randn(2, 3, 200, 64, dtype=dtype) for _ in range(3))
        if k_layout:
            k = torch.randn(2, 200, 3, 64, dtype=dtype).transpose(1, 2)
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
        args, grid, options = fwd.kernel_launch(q, k, v, out, lse, True)
        launcher(grid, *args, fast_launch=True, **options)
        return args, grid

    launch_once()
    args, grid = launch_once()
    assert len(public) == 1 and len(args) == len(launcher.names)
    assert runs == [((*grid, 1, 1), args)]
    launch_once(torch.float16)
    launch_once(k_layout=True)
    assert len(public) == 3 and len(runs) == 1


def test_forward_plan_launches_this_calls_tensors_in_the_first_calls_geometry(monkeypatch, request):
    """The forward's per-layout plan (no GPU: the launcher's Triton side is a stub): the first call of a layout
    checks its inputs and goes through Triton's public path; from the second (fresh tensors of the layout) the
    runner gets, without any check, what the first call's arguments were with this call's tensors in them: each TMA
    descriptor as a HostDescriptor of this call's tensor in the first descriptor's shape, strides and padding, which
    Triton's launcher turns into the same argument list as a TensorDescriptor of it; the rest equal. A new layout
    (3-d inputs) misses; PLANS.clear drops the plans; with fast_launch off no plan is made or used."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from cs336_systems.kernels.flash.gluon_common import HostDescriptor
    from cs336_systems.kernels.flash.host import launch

    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(fwd, "device_problem", lambda q: None)
    plans = launch.PLANS.table("gluon_forward")
    plans.clear()  # no plan around the stub
    request.addfinalizer(plans.clear)  # is left to another test
    checks, real_check = [], fwd.layout_problem
    monkeypatch.setattr(fwd, "layout_problem", lambda *a: checks.append(a) or real_check(*a))
    launcher = launch.FastLauncher(fwd.LAUNCHER.kernel, key=fwd.descriptor_launch_key)
    public, runs = [], []
    compiled = type("Compiled", (), {"__getitem__": lambda self, grid: lambda *args: runs.append(args)})()
    launcher.kernel = type("Public", (), {"__getitem__": lambda self, grid: lambda *a, **kw: public.append(a)
                                          or compiled})()
    monkeypatch.setattr(fwd, "LAUNCHER", launcher)

    def call(shape=(2, 3, 200, 64), fast_launch=True):
        q, k, v = (torch.randn(shape[0], shape[2], *shape[1:-2], shape[-1], dtype=torch.bfloat16).transpose(1, -2)
                   if len(shape) == 4 else torch.randn(shape, dtype=torch.bfloat16) for _ in range(3))
        out, lse = fwd.flash_attention_gluon_forward(q, k, v, True, fast_launch=fast_launch)
        return q, k, v, out, lse

    first = call()
    assert len(public) == 1 and len(checks) == 1 and len(plans) == 1
    q, k, v, out, lse = call()
    assert len(public) == 1 and len(checks) == 1 and len(runs) == 1
    [args] = runs
    expected, _, _ = fwd.kernel_launch(*map(fwd.as_4d, (q, k, v, out)), lse, True)
    assert len(args) == len(expected) == len(launcher.names)
    for got, want, t in zip(args, expected, (q, k, v, out)):
        assert isinstance(want, TensorDescriptor) and type(got) is HostDescriptor
        assert got.base.data_ptr() == t.data_ptr() and got.base.data_ptr() != first[0].data_ptr()
        assert make_tensordesc_arg(got, None) == make_tensordesc_arg(want, None)
    assert args[4] is lse and args[5:] == expected[5:]
    call((2, 200, 64))  # another layout: checked, public path, a plan of its own
    assert len(public) == 2 and len(checks) == 2 and len(plans) == 2
    launch.PLANS.clear()
    assert plans == {}
    call(fast_launch=False)
    call(fast_launch=False)
    assert len(public) == 4 and len(runs) == 1 and plans == {}


def _counting(compiles: list, backend: str):
    """A torch.compile backend that counts the graphs Dynamo hands it (one per compile or recompile) and
    compiles them with `backend` (composed as PyTorch's custom-backend documentation shows)."""
    from torch._dynamo import lookup_backend

    def compile_graph(gm, example_inputs):
        compiles.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    return compile_graph


def _with_grads(fn, q, k, v, do, causal, saved_lse=False):
    """O, dQ, dK, dV of fn(q, k, v, causal) under autograd; with saved_lse, also the L that fn (one of our
    Functions, uncompiled) saved for its backward."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    if saved_lse:
        [lse] = [t for t in out.grad_fn.saved_tensors if t.dtype == torch.float32 and t.shape == q.shape[:-1]]
    out.backward(do.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad, (lse.detach() if saved_lse else None)


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="Triton kernels need a GPU or the interpreter")
def test_compiled_call_does_not_guard_on_the_forward_setting(monkeypatch):
    """The setting is read inside the custom op, at run time: switching it between calls recompiles nothing."""
    from cs336_systems.kernels.flash.api import flash_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.compiler.reset()
    compiles = []
    compiled = torch.compile(flash_attention_triton, backend=_counting(compiles, "aot_eager"), fullgraph=True)
    q, k, v, do = (torch.randn(1, 2, 24, 16, device=device) for _ in range(4))
    ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), True)
    for setting in ("triton", "auto", "triton"):
        reread_env(monkeypatch, FORWARD_ENV, setting)
        got = _with_grads(compiled, q, k, v, do, True)
        for name, x, want in zip(("O", "dQ", "dK", "dV"), got, ref):
            assert _rel_err(x, want) < 1e-4, f"{setting}: {name}"
    assert len(compiles) == 1


# (q shape, k shape, causal, model layout): lengths off the 128-row tile, rectangular both ways (causal aligned at
# the start), 3-d inputs, the model's strides; the last two long enough for "auto" to take Gluon.
WIRE_CASES = [
    ((2, 3, 1000, 64), (2, 3, 1000, 64), True, False),
    ((1, 4, 300, 128), (1, 4, 1000, 128), True, True),
    ((1, 2, 513, 64), (1, 2, 129, 64), False, False),
    ((2, 257, 128), (2, 257, 128), True, False),
    ((1, 2, 4100, 64), (1, 2, 4100, 64), True, True),
    ((1, 2, 3000, 128), (1, 2, 4133, 128), False, False),
]


def _spy_on_gluon(monkeypatch) -> list:
    """The q shapes the Gluon forward is called with, from now on."""
    calls, real = [], fwd.flash_attention_gluon_forward

    def spy(q, k, v, is_causal, **options):  # options: the dispatcher's checked=True
        calls.append(tuple(q.shape))
        return real(q, k, v, is_causal, **options)

    monkeypatch.setattr(fwd, "flash_attention_gluon_forward", spy)
    return calls


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("forward", ["gluon", "auto"])
@pytest.mark.parametrize("q_shape,k_shape,causal,model_layout", WIRE_CASES)
def test_gpu_autograd_function_with_the_gluon_forward(q_shape, k_shape, causal, model_layout, forward, monkeypatch):
    """O, L, dQ, dK, dV through FlashAttentionTriton (the model's backend) with the forward forced to Gluon or left
    to the rule: within 2x (plus a floor) of PyTorch's own bf16 error against float64, and as close to the
    FA2-only path; the backward is FA2's in both (pinned: "auto" would take the Gluon backward at the long cases),
    fed Gluon's O and L."""
    from cs336_systems.kernels.flash.api import FlashAttentionTriton
    from cs336_systems.kernels.flash.fa2 import pinned_tiles

    q, k, v, do = (_fresh(shape, model_layout) for shape in (q_shape, k_shape, k_shape, q_shape))
    reread_env(monkeypatch, BACKWARD_ENV, "triton")
    calls = _spy_on_gluon(monkeypatch)
    takes_gluon = forward == "gluon" or gluon_pays(HOPPER, q_shape, k_shape, causal)
    with pinned_tiles(FA2_TILE, FA2_TILE):
        reread_env(monkeypatch, FORWARD_ENV, forward)
        got = _with_grads(FlashAttentionTriton.apply, q, k, v, do, causal, saved_lse=True)
        assert calls == [q_shape] * takes_gluon
        reread_env(monkeypatch, FORWARD_ENV, "triton")
        fa2_grads = _with_grads(FlashAttentionTriton.apply, q, k, v, do, causal, saved_lse=True)
        assert calls == [q_shape] * takes_gluon
    ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), causal)
    ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
    own = _with_grads(naive_attention, q, k, v, do, causal)  # PyTorch's own attention in bf16
    what = f"{q_shape} {k_shape} causal={causal} forward={forward}"
    assert got[0].stride() == q.stride(), what
    for i, name in enumerate(("O", "dQ", "dK", "dV")):
        assert torch.isfinite(got[i]).all(), f"{what}: {name} not finite"
        limit = 2 * _rel_err(own[i], ref[i]) + 2e-3
        err, err_fa2 = _rel_err(got[i], ref[i]), _rel_err(got[i], fa2_grads[i].double())
        assert err < limit and err_fa2 < limit, f"{what}: {name} error {err:.2e}, vs FA2 {err_fa2:.2e} ({limit:.2e})"
    lse, fa2_lse = got[4], fa2_grads[4]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3, what  # float32 L of 16-bit scores
    torch.testing.assert_close(lse, fa2_lse, rtol=0, atol=1e-3)


@pytest.mark.gpu
@needs_sm90
def test_gpu_dispatch_by_input_on_hopper():
    """On the device: the rule's long shapes take Gluon; what the kernel does not take goes to FA2 in "auto" and
    is a clear error when Gluon is forced."""
    batch, heads, n, _ = gluon_call(GLUON_FORWARD_RULES[64], 64, True)
    long = torch.empty(batch, heads, n, 64, device="cuda", dtype=torch.bfloat16)
    assert choose_forward(long, long, long, True) == "gluon"
    assert choose_forward(long[:, :, :n - 1], long[:, :, :n - 1], long[:, :, :n - 1], True) == "triton"
    assert choose_forward(long, long, long, True, forward="triton") == "triton"
    for other, words in ((long.float(), "dtype torch.float32"), (long[..., :32], "head dim 32")):
        assert choose_forward(other, other, other, True) == "triton"
        with pytest.raises(ValueError, match=words):
            choose_forward(other, other, other, True, forward="gluon")


COMPILE_LENGTHS = (1000, 1337)  # the second one new: Dynamo recompiles once (with dynamic lengths)


@pytest.mark.gpu
@needs_sm90
def test_gpu_compiled_with_the_gluon_forward_recompiles_as_fa2(monkeypatch):
    """torch.compile(fullgraph=True) (a graph break would raise) with the forward forced to FA2, then to Gluon:
    the same number of compiles over two calls of different lengths, and the same results."""
    from cs336_systems.kernels.flash.api import flash_attention_triton
    from cs336_systems.kernels.flash.fa2 import pinned_tiles

    calls = _spy_on_gluon(monkeypatch)
    compiles = {}
    for forward in ("triton", "gluon"):
        reread_env(monkeypatch, FORWARD_ENV, forward)
        torch.compiler.reset()
        graphs = []
        compiled = torch.compile(flash_attention_triton, backend=_counting(graphs, "inductor"), fullgraph=True)
        for n in COMPILE_LENGTHS:
            q, k, v, do = (_fresh((1, 2, n, 64), False) for _ in range(4))
            with pinned_tiles(FA2_TILE, FA2_TILE):
                got = _with_grads(compiled, q, k, v, do, True)
            ref = _with_grads(naive_attention, q.double(), k.double(), v.double(), do.double(), True)
            own = _with_grads(naive_attention, q, k, v, do, True)
            for i, name in enumerate(("O", "dQ", "dK", "dV")):
                limit = 2 * _rel_err(own[i], ref[i]) + 2e-3
                assert _rel_err(got[i], ref[i]) < limit, f"forward={forward} n={n}: {name}"
        compiles[forward] = len(graphs)
        assert len(calls) == (2 if forward == "gluon" else 0)
    assert 1 <= compiles["gluon"] <= compiles["triton"], compiles
