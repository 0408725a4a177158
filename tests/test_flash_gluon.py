"""The Gluon FlashAttention forward for Hopper (`kernels/flash_gluon.py`).

On CPU: its plain-Python parts (tiles, the program order, the dispatch predicate and its errors) and, in a process
of its own, a compile for sm_90 with 0 spills. On an sm_90 GPU (marked `gpu`): O and L against a float64
reference and against our Triton FlashAttention-2 forward on awkward shapes (lengths not tile multiples, causal
or not, rectangular, d 64/128, the model's strides), error within 2x (plus a small floor) of PyTorch's own bf16
attention; and the EXACT pipeline check (integer inputs, P = S mod 8: every value exact, so any lost or reordered
tile, or a register-A hazard, shows as a mismatch).
"""

import subprocess
import sys

import pandas as pd
import pytest
import torch

from cs336_systems.kernels import flash_gluon
from cs336_systems.kernels.flash_gluon import (
    TILES,
    GluonTile,
    gluon_supported,
    key_tiles,
    layout_problem,
    program_order,
)
from cs336_systems.model.attention import attention_scores, naive_attention

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
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
        flash_gluon.flash_attention_gluon_forward(q, q, q, True)
    with pytest.raises(ValueError, match="head dim 32"):
        flash_gluon.flash_attention_gluon_forward(*[problems["head dim 32"]] * 3, False)


def test_compiles_for_sm90_without_spills(tmp_path):
    """One configuration (d=128, causal, bf16) compiled for the H100 on this machine, through the launcher's
    own host code: 0 spills and the tiles' shared memory. In a process of its own (Triton's JIT, a stand-in
    driver)."""
    out = tmp_path / "gluon.csv"
    subprocess.run([sys.executable, "-m", "cs336_systems.bench.flash_gluon_resources", "--head-dims", "128",
                    "--only-first", "--out", str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = pd.read_csv(out)
    assert len(rows) == 1 and (rows["status"] == "ok").all(), rows.to_dict("records")
    row = rows.iloc[0]
    assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0
    assert TILES[128].shared_bytes() <= row["shared_bytes"] <= TILES[128].shared_bytes() + 1024


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


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1.0)).item()


def _fresh(shape, model_layout, dtype=torch.bfloat16):
    t = torch.randn(shape, device="cuda", dtype=torch.float64)
    if model_layout:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.to(dtype)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("q_shape,k_shape,causal,model_layout", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_float64_and_flash_triton(q_shape, k_shape, causal, model_layout, dtype):
    from cs336_systems.kernels.flash_triton import flash_forward_triton, pinned_tiles

    q, k, v = _fresh(q_shape, model_layout, dtype), _fresh(k_shape, model_layout, dtype), _fresh(k_shape, model_layout, dtype)
    out, lse = flash_gluon.flash_attention_gluon_forward(q, k, v, causal)
    ref = naive_attention(q.double(), k.double(), v.double(), causal)
    ref_lse = torch.logsumexp(attention_scores(q.double(), k.double(), causal), dim=-1)
    own = naive_attention(q, k, v, causal)  # PyTorch's own attention in this dtype
    what = f"{q_shape} {k_shape} causal={causal} {dtype}"
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
def test_gpu_exact_pipeline(head_dim, causal):
    """EXACT: P = S mod 8 with inputs in {-1, 0, 1} (V sparse), so every product and sum is an exact integer: the
    output must equal the float64 result rounded to bf16, bit for bit, on repeated launches."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    shape = (2, 3, 1500, head_dim)
    q, k = (torch.randint(-1, 2, shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    v = (torch.randint(-1, 2, shape, device="cuda", generator=gen)
         * (torch.rand(shape, device="cuda", generator=gen) < 0.25)).to(torch.bfloat16)
    s = q.double() @ k.double().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), 0.0)
    expected = (p @ v.double()).to(torch.bfloat16)
    for _ in range(3):
        out, _ = flash_gluon._forward(q, k, v, causal, exact=True)
        assert torch.equal(out, expected), f"{int((out != expected).sum())} mismatches"
