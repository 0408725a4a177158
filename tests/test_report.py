"""Report helpers on synthetic inputs with known answers: allocator snapshots (real ones need CUDA),
profiler traces and the training-matrix table."""

import pickle

import pandas as pd

from cs336_systems.report import memory

MiB = 2**20


def _event(action, size, filename="/x/cs336_systems/model/transformer.py", line=10, name="forward"):
    return {"action": action, "addr": 0, "size": size, "frames": [
        {"filename": "/torch/nn/module.py", "line": 1, "name": "_call_impl"},
        {"filename": filename, "line": line, "name": name}]}


# 100 MiB made before recording stays live; an 8 MiB tensor made before recording is freed in it.
SNAPSHOT = {"segments": [{"device": 0, "blocks": [
    {"size": 100 * MiB, "state": "active_allocated"}, {"size": 4 * MiB, "state": "active_allocated"},
    {"size": 60 * MiB, "state": "inactive"}]}], "device_traces": [[
    _event("free_completed", 8 * MiB),
    _event("alloc", 4 * MiB), _event("alloc", 16 * MiB, line=42, name="attention"),
    _event("free_requested", 16 * MiB), _event("free_completed", 16 * MiB),
    _event("alloc", 4 * MiB), _event("segment_alloc", 64 * MiB), _event("free_completed", 4 * MiB),
]]}


def test_active_timeline_starts_from_what_was_live_before_recording():
    xs, ys = memory.active_timeline(SNAPSHOT)
    assert ys == [100, 104, 120, 104, 108, 104]  # ends at the 104 MiB the segments hold at the dump
    assert xs == [0, 1, 2, 4, 5, 7]


def test_largest_allocations_name_our_code():
    rows = memory.largest_allocations(SNAPSHOT, n=2)
    assert rows[0] == {"size_mib": 16, "count": 1, "origin": "transformer.py:42 (attention)"}
    assert rows[1] == {"size_mib": 4, "count": 2, "origin": "transformer.py:10 (forward)"}


def test_cli_draws_and_tabulates(tmp_path):
    path = tmp_path / "forward_fp32_128.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    memory.main([str(path), "--figures-dir", str(tmp_path / "figs"), "--out", str(tmp_path / "a.csv")])
    assert (tmp_path / "figs" / "forward_fp32_128.png").stat().st_size > 1000
    table = pd.read_csv(tmp_path / "a.csv")
    assert table["size_mib"].tolist()[:2] == [16, 4]


def test_trace_lanes_and_overlap():
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 110, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 150, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 160, "dur": 20},
    ]
    lanes = traces.lanes(events)
    assert lanes["backward"] == [(100.0, 200.0)] and lanes["compute"] == [(110.0, 160.0)]
    assert len(lanes["communication"]) == 2
    # merged communication 150..250 (100 µs), of which 150..200 is inside backward
    assert traces.overlap_fraction(lanes["communication"], lanes["backward"]) == 0.5


def test_trace_host_side_of_backward():
    """Collectives called during backward are counted with their CPU time; GPU busy share of backward."""
    from cs336_systems.report import traces

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "backward", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 120, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 170, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 300, "dur": 10},  # after backward
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 110, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 90, "dur": 30},  # 100..120 inside
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 150, "dur": 20},
    ]
    found = traces.host_side(events, traces.lanes(events)["backward"])
    assert found == {"collectives_in_backward": 2, "host_collective_ms_in_backward": 0.04, "backward_ms": 0.1,
                     "gpu_busy_in_backward": 0.4}


def test_train_matrix_table_speed_and_loss_drift():
    """Speed from the second half of the steps; drift is the largest per-step gap to torch DDP."""
    from cs336_systems.report.tables import train_matrix

    def run(wrapper, world, losses, ms):
        return pd.DataFrame({"step": [1, 2, 3, 4], "loss": losses, "step_ms": ms, "attention": "sdpa",
                             "wrapper": wrapper, "world_size": world, "tokens_per_step": 1000,
                             "peak_memory_mib": float("nan")})

    frame = pd.concat([run("torch_ddp", 2, [4.0, 3.0, 2.0, 1.0], [900, 10, 10, 10]),
                       run("none", 1, [4.0, 3.0, 2.5, 1.0], [900, 20, 20, 20])])
    table = train_matrix(frame).set_index("wrapper")
    assert table.loc["torch_ddp", "step (ms, median)"] == 10 and table.loc["torch_ddp", "tokens/s"] == 100_000
    assert table.loc["single GPU", "max |loss − torch DDP|"] == 0.5
    assert table.loc["single GPU", "ranks"] == 1 and table.loc["single GPU", "final loss"] == 1.0


def test_writeup_html_keeps_tables_and_figure_links(tmp_path):
    from cs336_systems.report import html

    source = tmp_path / "writeup.md"
    source.write_text("# Results & more\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![fig](../figures/x.png)\n")
    html.main([str(source), "--out", str(tmp_path / "writeup.html")])
    page = (tmp_path / "writeup.html").read_text()
    assert "<title>Results &amp; more</title>" in page
    assert "<table>" in page and "<td>2</td>" in page
    assert '<img alt="fig" src="../figures/x.png"' in page


def test_kernel_labels_name_the_operation():
    from cs336_systems.report.tables import kernel_label

    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
           "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, at::native::BinaryFunctor"
           "<float, float, float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)")
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, "
            "at::native::Sqrt<float> >(at::native::(anonymous namespace)::TensorListMetadata<2>)")
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>(float*, int, bool)"
    assert kernel_label(mul) == "vectorized_elementwise_kernel<MulFunctor>"
    assert kernel_label(adam) == "multi_tensor_apply_kernel<Sqrt>"
    assert kernel_label(softmax) == "(anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>"
    assert kernel_label("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"


def test_profile_kernels_drop_ranges_and_merge_instances():
    """torch.optim's `Optimizer.step#AdamW.step` range shows up on the GPU timeline; it is not a kernel."""
    from cs336_systems.report.tables import profile_kernels_of

    rows = pd.DataFrame({
        "kind": ["kernel"] * 4 + ["harness"], "phase": ["optimizer"] * 3 + ["forward"] * 2,
        "name": ["Optimizer.step#AdamW.step", "void at::native::elementwise_kernel<128, at::native::MulFunctor<float> >(int)",
                 "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float> >(int)",
                 "gemm", "forward"],
        "calls_per_step": [1, 2, 3, 4, 1], "ms_per_step": [10.0, 1.0, 2.0, 5.0, 6.0], "size": "xl"})
    kernels = profile_kernels_of(rows).set_index(["phase", "name"])["ms_per_step"]
    assert kernels.to_dict() == {("forward", "gemm"): 5.0, ("optimizer", "elementwise_kernel<MulFunctor>"): 1.0,
                                 ("optimizer", "vectorized_elementwise_kernel<MulFunctor>"): 2.0}


def test_optimizer_table_bandwidth_and_oom():
    from cs336_systems.model import get_config, parameter_count
    from cs336_systems.report.tables import optimizer_timing

    params = parameter_count(get_config("small"))
    base = {"size": "small", "status": "ok", "std_ms": 0.1}
    frame = pd.DataFrame([
        {**base, "optimizer": "fused", "phase": "optimizer", "mean_ms": 2.0, "median_ms": 2.0},
        {**base, "optimizer": "fused", "phase": "step", "mean_ms": 30.0, "median_ms": 30.0},
        {**base, "size": "2.7B", "optimizer": "fused", "phase": "step", "status": "oom"},
    ])
    table = optimizer_timing(frame).set_index("size")
    assert table.loc["small", "GB/s at 28 B/param"] == round(params * 28 / 2e-3 / 1e9)
    assert table.loc["small", "optimizer step (ms)"] == "2.00 ± 0.10"
    assert table.loc["2.7B", "optimizer step (ms)"] == "OOM"
    assert pd.isna(table.loc["2.7B", "GB/s at 28 B/param"])
