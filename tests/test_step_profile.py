"""The leaderboard's profiled step (bench/step_profile.py, `--profile`) and its `ours-keep:N` ablations, on the
CPU at tiny scale: the kernel classifier on real kernel names, the phase rules (recomputation, loss, optimizer),
the profile rows adding up, and the peak-memory split's parts counted from the built models."""

import pandas as pd
import pytest
import torch

from cs336_systems.bench import leaderboard, merge, step_profile
from cs336_systems.bench.step_profile import categorize, classify
from cs336_systems.model import get_config
from tests.kernel_devices import cpu_kernels
from tests.test_leaderboard import TINY, _tiny

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]

# Real names: GPU kernels from results/profile*.csv (the 2025 models on an H100 / H200), our Triton kernels and
# custom ops, SDPA's flash / memory-efficient / cuDNN kernels, Inductor's generated kernels, CPU-side ops.
NAMED = {
    "attention forward": [
        "_flash_fwd_kernel", "_flash_fwd_gluon_kernel", "cs336_systems::flash_triton_forward", "FlashAttentionTriton",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, true, false, false, "
        "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward"],
    "attention backward": [
        "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_flash_bwd_gluon_kernel",
        "_bwd_preprocess_kernel", "cs336_systems::flash_triton_backward", "FlashAttentionTritonBackward",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
        "2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, "
        "true, false, false, false, false, true>(pytorch_flash::Flash_bwd_params)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
        "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> > >"
        "(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
        "cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 128, false>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_4_64x128x128_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_cudnn_attention_backward"],
    "GEMM": [
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_"
        "kernel__5x_cublas", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nt_align1>(cutlass_80_simt_sgemm_256x128_8x4_nt_"
        "align1::Params)", "aten::mm", "aten::addmm", "aten::linear"],
    "loss": ["_ce_kernel", "cs336_systems::linear_cross_entropy", "aten::cross_entropy_loss",
             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
             "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
             "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>"
             "(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)"],
    "optimizer": [
        "_adamw_kernel",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, 4, "
        "(at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float*, float*>"
        "(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
        "FusedAdamMathFunctor<c10::BFloat16, 4, (at::native::ADAM_MODE)1, false>, float*, double, double, double, "
        "double, double, bool, float*, float*)", "aten::_fused_adamw_"],
    "elementwise/norm/rope": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*,"
        " 2ul> >(int, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4>)",
        "triton_per_fused__to_copy_mean_mul_pow_rsqrt_1", "triton_poi_fused_mul_silu_2", "aten::mul", "aten::rsqrt",
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>(float*, float const*, "
        "int, int, int, bool const*, int, bool)"],
    "copies": ["Memcpy DtoD (Device -> Device)", "Memset (Device)", "aten::copy_", "aten::_to_copy",
               "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
               "::{lambda()#3}::operator()() const::{lambda()#4}::operator()() const::{lambda(float)#1}, std::array<"
               "char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>>(int, float, std::array<char*, 2ul>)"],
    "other": ["void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, "
              "bool)", "aten::embedding", "aten::empty"],
}


@pytest.mark.parametrize("category", list(NAMED))
def test_classifier_on_real_kernel_names(category):
    assert {name[:60]: classify(name) for name in NAMED[category]} == {name[:60]: category for name in NAMED[category]}


def test_classifier_covers_the_2025_profiles():
    """Every GEMM of the committed profiles is a GEMM, every multi-tensor (foreach AdamW) kernel optimizer, and
    no kernel there is attention (the 2025 models' naive attention is GEMMs and elementwise kernels)."""
    names = pd.concat(pd.read_csv(ROOT / "results" / f) for f in ("profile.csv", "profile_bf16.csv"))["name"].dropna().unique()
    found = {name: classify(name) for name in names}
    gemms = [n for n in names if n.startswith(("sm80_xmma_gemm", "nvjet_", "void cutlass::Kernel2"))]
    assert len(gemms) > 20 and all(found[n] == "GEMM" for n in gemms)
    assert all(found[n] == "optimizer" for n in names if "multi_tensor_apply_kernel" in n)
    assert not [n for n, c in found.items() if c.startswith("attention")]
    assert sum(c == "other" for c in found.values()) < len(names) / 5  # radix sorts, gathers, index kernels


def test_phase_rules():
    flash_fwd, gemm = "_flash_fwd_kernel", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
    assert categorize(flash_fwd, "forward") == "attention forward"
    assert categorize(flash_fwd, "backward") == "recompute"  # a checkpoint reran it
    assert categorize("_flash_bwd_dq_kernel", "backward") == "attention backward"
    sdpa_cpu = "aten::_scaled_dot_product_flash_attention_for_cpu"  # full checkpointing reruns SDPA in backward
    assert categorize(sdpa_cpu, "backward") == "recompute" and categorize(sdpa_cpu, "forward") == "attention forward"
    assert categorize(sdpa_cpu + "_backward", "backward") == "attention backward"
    assert categorize(gemm, "backward", ("MmBackward0",)) == "GEMM"
    assert categorize("aten::mm", "backward", ("aten::matmul", "MmBackward0")) == "recompute"  # a forward matmul
    assert categorize(gemm, "forward", ("cs336_systems::linear_cross_entropy",)) == "loss"  # inside the fused loss
    assert categorize(gemm, "backward", ("GeneratedBackwardFor_cs336_systems_linear_cross_entropy_default",)) == "loss"
    assert categorize(gemm, "loss") == "loss" and categorize(flash_fwd, "loss") == "attention forward"
    assert categorize("aten::mul", "optimizer") == categorize(gemm, "optimizer") == "optimizer"
    assert categorize("aten::empty", None) == "other"


def _event(device_type, name, start, end, kernels=(), parent=None):
    from types import SimpleNamespace
    return SimpleNamespace(device_type=device_type, name=name, time_range=SimpleNamespace(start=start, end=end),
                           kernels=list(kernels), cpu_parent=parent, self_cpu_time_total=0)


def test_cuda_kernels_no_op_launched_are_counted_in_the_phase_they_ran_in():
    """On CUDA the profiler links a kernel to the op whose runtime call launched it; our AdamW's Triton kernels,
    launched from Python outside any op, come out linked to nothing (an H200 run showed optimizer = 0 ms and the
    categories 28 ms short of the total). Such kernels count by name, in the phase that started last before
    they ran on the device (after the host range has ended, here)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    rng = step_profile.RANGE_PREFIX
    events = [_event(cpu, rng + "forward", 0, 100), _event(cpu, rng + "backward", 100, 200),
              _event(cpu, rng + "optimizer", 200, 210),
              _event(cpu, "aten::mm", 10, 20, [Kernel("nvjet_sm90_tst_gemm", 0, 40)]),
              _event(cuda, "nvjet_sm90_tst_gemm", 15, 55),  # linked to aten::mm
              _event(cuda, "nvjet_sm90_tst_gemm", 120, 160),  # the same kernel name and time, unlinked
              _event(cuda, "_adamw_kernel", 230, 255), _event(cuda, "_adamw_kernel", 255, 280),
              _event(cuda, rng + "backward", 100, 200)]  # a range the profiler puts on the GPU timeline too
    assert step_profile.unlinked_kernels(events) == [("nvjet_sm90_tst_gemm", 120, 0.04), ("_adamw_kernel", 230, 0.025),
                                                    ("_adamw_kernel", 255, 0.025)]
    listing = []
    times = step_profile.device_times(events, torch.device("cuda"), listing)
    assert times["optimizer"] == (2, pytest.approx(0.05)) and times["GEMM"] == (2, pytest.approx(0.08))
    assert sum(ms for _, ms in times.values()) == pytest.approx((40 + 40 + 25 + 25) / 1e3)
    assert [(k["name"], k["found"], k["phase"]) for k in listing] == [
        ("nvjet_sm90_tst_gemm", "linked", "forward"), ("nvjet_sm90_tst_gemm", "unlinked", "backward"),
        ("_adamw_kernel", "unlinked", "optimizer"), ("_adamw_kernel", "unlinked", "optimizer")]


def test_cupti_overhead_records_do_not_count_their_ops_kernels_again():
    """CUPTI's overhead records ("Command Buffer Full" while the host waits on a full launch queue) share the
    correlation id of the op launching then, so the profiler lists that op's kernels under them too (an 8B step's
    categories overcounted by 1.27 s). Each kernel counts once, under its op; an unlinked kernel of the same name and
    time stays unlinked (the duplicate must not hide it)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    rng = step_profile.RANGE_PREFIX
    gemm = Kernel("nvjet_sm90_tst_gemm", 0, 40)
    overhead = _event(cpu, "Command Buffer Full", 12, 90, [gemm])
    typed = _event(cpu, "Buffer wait", 12, 90, [gemm])  # an overhead record known by its activity type only
    typed.activity_type = "overhead"
    events = [_event(cpu, rng + "forward", 0, 100), _event(cpu, rng + "backward", 100, 200),
              _event(cpu, "aten::mm", 10, 20, [gemm]), overhead, typed,
              _event(cuda, "nvjet_sm90_tst_gemm", 15, 55), _event(cuda, "nvjet_sm90_tst_gemm", 120, 160)]
    assert step_profile.unlinked_kernels(events) == [("nvjet_sm90_tst_gemm", 120, 0.04)]
    listing = []
    times = step_profile.device_times(events, torch.device("cuda"), listing)
    assert times["GEMM"] == (2, pytest.approx(0.08)) and sum(calls for calls, _ in times.values()) == 2
    assert [k["where"] for k in listing] == ["aten::mm @10.0", "@120.0"]


# ---- the profiled run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The smoke command with --profile: the plain anchor with full checkpointing and ours keeping one block."""
    tmp = tmp_path_factory.mktemp("profile")
    leaderboard.main([*TINY, "--check-size", "none", "--providers", "torch_plain_ac", "--ablations", "ours-keep:1",
                      "--ablation-batch", "2", "--profile", str(tmp / "snapshots"), "--out", str(tmp / "lb.csv")])
    return pd.read_csv(tmp / "leaderboard_8b_profile.csv"), tmp


@cpu_kernels  # the profiled fixture runs ours' kernels on CPU tensors
def test_profile_rows_add_up_to_the_step(profiled):
    """On the CPU a category's time is its ops' self CPU time; the categories must add up to the outermost ops'
    total CPU time (summed independently from the nesting, `profiled ops (total)`) within 1% (µs rounding of
    the profiler's events), and lie below the step's wall time (the rest is Python between ops)."""
    rows, tmp = profiled
    assert set(rows["provider"]) == {"torch_plain_ac", "ours-keep:1"} and (rows["batch"] == 2).all()
    for provider, mine in rows.groupby("provider"):
        times = mine[mine["kind"] == "time"].set_index("category")["value"]
        assert set(times.index) == {*step_profile.CATEGORIES, step_profile.WALL, step_profile.WALL_OF_OPS}
        categories = times[list(step_profile.CATEGORIES)]
        assert categories.sum() == pytest.approx(times[step_profile.WALL_OF_OPS], rel=0.01), provider
        assert categories.sum() <= times[step_profile.WALL]
        assert times["recompute"] > 0 and times["GEMM"] > 0 and times["loss"] > 0 and times["optimizer"] > 0
    ours = rows[(rows["provider"] == "ours-keep:1") & (rows["kind"] == "time")].set_index("category")["value"]
    assert ours["attention forward"] > 0 and ours["attention backward"] > 0
    assert not list(tmp.glob("snapshots/*.pickle"))  # allocator history is CUDA's


@cpu_kernels  # the profiled fixture runs ours' kernels on CPU tensors
def test_profile_lists_every_kernel_it_counted(profiled):
    """Beside each snapshot path, the per-kernel (on a CPU, per-op) listing the categories were summed from: its
    ms and counts per category are the rows' (what a total that does not add up is checked against)."""
    rows, tmp = profiled
    for provider, mine in rows[rows["kind"] == "time"].groupby("provider"):
        listing = pd.read_csv(tmp / "snapshots" / f"{provider}_b2.kernels.csv")
        assert set(listing.columns) == {"name", "ms", "category", "phase", "found", "where"}
        times = mine.set_index("category")
        per_category = listing.groupby("category")["ms"].agg(["sum", "count"])
        for category in step_profile.CATEGORIES:
            found = per_category.loc[category] if category in per_category.index else pd.Series({"sum": 0, "count": 0})
            assert found["sum"] == pytest.approx(times.at[category, "value"], abs=1e-6), (provider, category)
            assert found["count"] == times.at[category, "calls"], (provider, category)
        assert set(listing["phase"].dropna()) <= {"forward", "loss", "backward", "optimizer"}


@cpu_kernels  # the profiled fixture runs ours' kernels on CPU tensors
def test_profile_memory_parts_are_the_models_tensors(profiled):
    """Parameters and gradients counted from the model (float32 here), AdamW's two moments per parameter plus
    its per-tensor step counters; no peak on a CPU, so no rest."""
    rows, _ = profiled
    config = get_config("tiny", edition="2026", context_length=24)
    from cs336_systems.model import TransformerLM
    with torch.device("meta"):
        model = TransformerLM(config)
    params = list(model.parameters())
    param_bytes = 4 * sum(p.numel() for p in params)
    for provider, mine in rows[rows["kind"] == "memory"].groupby("provider"):
        memory = mine.set_index("category")["value"] * 2**30  # back from GiB
        assert memory["parameters"] == pytest.approx(param_bytes) and memory["gradients"] == pytest.approx(param_bytes)
        state = round(memory["optimizer state"])
        assert 2 * param_bytes <= state <= 2 * param_bytes + 8 * len(params), provider
        assert memory[["peak", "activations + workspace"]].isna().all()


def test_memory_parts_count_only_what_is_on_the_profiled_device():
    """An optimizer state kept on the host (cs336_systems/offload.py) is no device memory: counted on the CPU's
    own profile, not on another device's."""
    from cs336_systems.optim import AdamW

    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7))]
    optimizer = AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    nbytes = 4 * (15 + 7)
    assert step_profile.state_bytes(params, optimizer, torch.device("cpu")) == {
        "parameters": nbytes, "gradients": nbytes, "optimizer state": 2 * nbytes}
    assert set(step_profile.state_bytes(params, optimizer, torch.device("cuda")).values()) == {0}


def test_a_failed_profiled_step_is_an_error_row_and_the_timed_row_stands(tmp_path, monkeypatch):
    """The profiler failing (as an out-of-memory under its bookkeeping would) costs the profile, not the point."""
    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (made up by the test)")

    monkeypatch.setattr(step_profile, "profile_step", fail)
    leaderboard.main([*TINY, "--check-size", "none", "--providers", "torch_plain_ac", "--ablations",
                      "--profile", str(tmp_path / "snapshots"), "--out", str(tmp_path / "lb.csv")])
    steps, rows = pd.read_csv(tmp_path / "lb.csv"), pd.read_csv(tmp_path / "leaderboard_8b_profile.csv")
    assert list(steps["status"]) == ["ok"] and steps["step_ms"].iloc[0] > 0
    assert list(rows["kind"]) == ["error"] and "made up by the test" in rows["tool"].iloc[0]


def test_a_step_the_allocator_history_breaks_is_profiled_again_without_it(tmp_path, monkeypatch):
    """torch 2.11's SystemError under the allocator's history (pytorch/pytorch#179536) costs the snapshot only: the
    step is profiled again without the history, and its rows are the profile's; a second failure is an error row."""
    real, calls = step_profile.profile_step, []

    def history_breaks(*args, history=True, **kwargs):
        calls.append(history)
        if history:
            raise SystemError("<built-in method apply of FunctionMeta object> returned NULL (made up by the test)")
        return real(*args, history=history, **kwargs)

    monkeypatch.setattr(step_profile, "profile_step", history_breaks)
    args = [*TINY, "--check-size", "none", "--providers", "torch_plain_ac", "--ablations",
            "--profile", str(tmp_path / "snapshots")]
    leaderboard.main([*args, "--out", str(tmp_path / "lb.csv")])
    rows = pd.read_csv(tmp_path / "leaderboard_8b_profile.csv")
    assert calls == [True, False] and "error" not in set(rows["kind"])
    assert {"time", "memory"} <= set(rows["kind"]) and (tmp_path / "snapshots/torch_plain_ac_b2.kernels.csv").exists()

    calls.clear()
    monkeypatch.setattr(step_profile, "profile_step", lambda *a, history=True, **k: calls.append(history) or 1 / 0)
    leaderboard.main([*args, "--out", str(tmp_path / "lb2.csv")])
    rows = pd.read_csv(tmp_path / "leaderboard_8b_profile.csv")
    assert calls == [True] and list(rows["kind"]) == ["error"] and "ZeroDivisionError" in rows["tool"].iloc[0]


# ---- ours-keep:N and ours-mm:N ---------------------------------------------------------------------------------------------


def test_sized_ablations_parse_and_name_bad_values():
    assert leaderboard.recipe("ours-keep:2").checkpoint == "selective:2"
    assert leaderboard.recipe("ours-mm:2").checkpoint == "selective:0,2"
    assert leaderboard.recipe("ours-mm:02").checkpoint == "selective:0,2"
    assert leaderboard.recipe_columns("ours-keep:1", _tiny(), 2)["checkpoint"] == "selective:1"
    assert _tiny(ablations=("ours-keep:1", "ours-keep:2")).points()[-2:] == [(2, "ours-keep:1"), (2, "ours-keep:2")]
    for name, message in [("ours-keep:0", "got '0'"), ("ours-keep:x", "got 'x'"), ("ours-keep:-1", "got '-1'"),
                          ("ours-keep:", "got ''"), ("ours-keep:3", "names 3 blocks; size 'tiny' has 2"),
                          ("ours-mm:0", "got '0'"), ("ours-mm:3", "names 3 blocks; size 'tiny' has 2"),
                          ("ours-kept:1", "unknown ablation 'ours-kept:1'")]:
        with pytest.raises(ValueError, match=message):
            _tiny(ablations=(name,))
    with pytest.raises(ValueError, match="without a profile folder"):
        _tiny(profile_out="p.csv")


# ---- the writeup section ---------------------------------------------------------------------------------------


def _render(results):
    """The leaderboard section and its continuation (the profile), built as the `table` rule and the writeup do."""
    from cs336_systems.report.__main__ import make_tables
    from cs336_systems.report.section import Context
    from cs336_systems.report.sections.leaderboard import DELIVERABLES, render_leaderboard
    from cs336_systems.report.writeup import render

    make_tables(results, ["leaderboard_8b", "leaderboard_8b_ablations", "leaderboard_8b_verdict",
                          "leaderboard_8b_profile", "leaderboard_8b_memory"])  # those whose data is present
    ctx = Context(results, results, results)
    profile = next(item for item in DELIVERABLES if "leaderboard_8b_profile" in item.data)  # the continuation
    return render_leaderboard(ctx), render(profile, ctx)


@cpu_kernels  # the profiled fixture runs ours' kernels on CPU tensors
def test_section_renders_the_profile_and_is_pending_without_it(profiled, tmp_path):
    """Without the profile CSV the section names the command that records it (and its continuation is pending);
    with it, the continuation's time table holds each provider's category times from the CSV, its memory table
    each provider's split, and the keep:N ablation is in the ablation table."""
    from cs336_systems.report.frame import NumericTable
    from tests.test_report import unquoted

    rows, tmp = profiled
    merge.main([str(tmp / "lb.csv"), "--out", str(tmp_path / "leaderboard_8b.csv"), "--quote", "latest"])  # as the rule
    body, profile = _render(tmp_path)
    assert "Pending (needs a GPU run with the profiler)" in body.markdown()
    assert "--profile results/leaderboard_8b_snapshots" in body.markdown()
    assert "ours-keep:1" in body.markdown() and unquoted(body) == [] and "nan" not in body.markdown()
    assert profile.startswith("pending: rule `leaderboard_8b`")

    rows.assign(quoted=True).to_csv(tmp_path / "leaderboard_8b_profile.csv", index=False)
    body, profile = _render(tmp_path)
    assert "Pending (needs a GPU run with the profiler)" not in body.markdown() and "next section" in body.markdown()
    assert "nan" not in profile
    table = NumericTable.load(tmp_path / "tables" / "leaderboard_8b_profile.json")
    assert table.to_markdown(index=False) in profile
    for (provider, category), value in rows[rows["kind"] == "time"].set_index(["provider", "category"])["value"].items():
        assert table.data.set_index("category").at[category, provider] == pytest.approx(value), (provider, category)
    memory = NumericTable.load(tmp_path / "tables" / "leaderboard_8b_memory.json")
    assert memory.to_markdown(index=False) in profile
    assert list(memory.data["provider"]) == ["torch_plain_ac", "ours-keep:1"]
    assert memory.data["peak"].isna().all() and "|      — |" in memory.to_markdown(index=False)  # no CPU peak
