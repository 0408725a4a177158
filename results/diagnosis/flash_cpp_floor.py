"""How low a C++ autograd node could take a short attention call (issue #26: "never slower than SDPA flash").

    python results/diagnosis/flash_cpp_floor.py --out FILE.csv [--shapes ...] [--rounds N]
    (needs a C++ compiler, the CUDA headers and ninja. The GPU machine has the first two; for ninja, run
    `pip download ninja` into .whl here (wheels.sh does not fetch it) and carry .whl, then there:
    `python3 -m pip install -q --no-index --find-links .whl ninja` with the venv's scripts directory on PATH.)

kernels/NOTES.md, "What a short call's host time is made of": at the 13 forward+backward points where ours lost to
SDPA flash in the f634041 grid, ours' kernels took 0.59-0.78x SDPA flash's device time, but the call's host time
set its do_bench time. `HostFloor`, a Python autograd.Function with ours' allocations and no kernel, already cost
0.67-0.79x SDPA flash's whole call. So a Python Function ties SDPA flash at best, and the notes name a C++ autograd
node that launches the compiled kernels as the only way past it. This measures that node's floor before it is built.

`CppFloor` (below, built with torch.utils.cpp_extension.load_inline) is a torch::autograd::Function in C++ that does
on the host what such a node would do, with empty kernels in place of ours:
- forward: O and L allocated; four TMA descriptors encoded (cuTensorMapEncodeTiled: q, k, v, O); one launch with
  them as parameters (cuLaunchKernel, 132 programs of 128 threads);
- backward: D, the float32 dQ accumulator, dQ, dK and dV allocated; a preprocessing launch; seven descriptors
  encoded (q, k, v, dO, dK, dV, the accumulator) and the main launch; the dQ cast's launch.
It is called through pybind11, as a Python caller would call it. Per point, in alternating rounds (do_bench median of
forward+backward, as the grid times it; grad set to None between calls): ours (`flash_triton`, "auto"), SDPA flash,
HostFloor and CppFloor, and ours' summed kernel time (torch.profiler, mean of 10 calls). Rows go to --out.
"""

import argparse
import statistics
import sys
from pathlib import Path

from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_gluon_tile_overhead import kernel_ms  # noqa: E402
from flash_short_calls import HostFloor, parse_shape, tensors  # noqa: E402

# the 13 points where ours lost to SDPA flash in the f634041 grid (flash_short_calls/lost13/)
SHAPES = ["1x16x512x64c", "1x16x512x128", "1x16x512x128c", "1x16x1024x64c", "1x16x2048x64", "1x16x2048x128",
          "1x16x2048x128c", "2x32x512x128", "2x32x512x128c", "4x16x1024x64", "4x16x1024x64c", "16x16x512x64",
          "16x16x512x64c"]

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>

#include <string>
#include <vector>

namespace {

// Empty kernels with the parameters of ours: 4 or 7 TMA descriptors and a pointer; or 3 pointers.
const char* kPtx = R"PTX(
.version 8.0
.target sm_90
.address_size 64
.visible .entry maps4(.param .align 64 .b8 d0[128], .param .align 64 .b8 d1[128], .param .align 64 .b8 d2[128],
    .param .align 64 .b8 d3[128], .param .u64 p) { ret; }
.visible .entry maps7(.param .align 64 .b8 d0[128], .param .align 64 .b8 d1[128], .param .align 64 .b8 d2[128],
    .param .align 64 .b8 d3[128], .param .align 64 .b8 d4[128], .param .align 64 .b8 d5[128],
    .param .align 64 .b8 d6[128], .param .u64 p) { ret; }
.visible .entry ptrs3(.param .u64 a, .param .u64 b, .param .u64 c) { ret; }
)PTX";

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    const char* text = nullptr;
    cuGetErrorString(result, &text);
    TORCH_CHECK(false, "cpp_floor: ", what, " failed: ", text ? text : "unknown error");
  }
}

struct Kernels {
  CUfunction maps4, maps7, ptrs3;
};

const Kernels& kernels() {
  static Kernels k = [] {
    Kernels out;
    CUmodule module;
    check(cuModuleLoadData(&module, kPtx), "cuModuleLoadData");
    check(cuModuleGetFunction(&out.maps4, module, "maps4"), "cuModuleGetFunction");
    check(cuModuleGetFunction(&out.maps7, module, "maps7"), "cuModuleGetFunction");
    check(cuModuleGetFunction(&out.ptrs3, module, "ptrs3"), "cuModuleGetFunction");
    return out;
  }();
  return k;
}

// A (batch, head, row, col) descriptor with t's strides, boxes of 64 rows and 128 bytes of columns, 128-byte swizzle.
CUtensorMap encode(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "cpp_floor: 4-d tensors only, got ", t.dim());
  const int64_t size = t.element_size();
  CUtensorMap map;
  cuuint64_t dims[4] = {(cuuint64_t)t.size(3), (cuuint64_t)t.size(2), (cuuint64_t)t.size(1), (cuuint64_t)t.size(0)};
  cuuint64_t strides[3] = {(cuuint64_t)(t.stride(2) * size), (cuuint64_t)(t.stride(1) * size),
                           (cuuint64_t)(t.stride(0) * size)};
  cuuint32_t box[4] = {(cuuint32_t)(128 / size), 64, 1, 1};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
  auto type = t.scalar_type() == at::kFloat ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  check(cuTensorMapEncodeTiled(&map, type, 4, t.data_ptr(), dims, strides, box, element_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
  return map;
}

void launch(CUfunction function, std::vector<void*>& params) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  check(cuLaunchKernel(function, 132, 1, 1, 128, 1, 1, 0, (CUstream)stream.stream(), params.data(), nullptr),
        "cuLaunchKernel");
}

void launch_maps(CUfunction function, const std::vector<at::Tensor>& tensors, void* pointer) {
  std::vector<CUtensorMap> maps;
  maps.reserve(tensors.size());
  for (const auto& t : tensors) maps.push_back(encode(t));
  std::vector<void*> params;
  for (auto& m : maps) params.push_back(&m);
  params.push_back(&pointer);
  launch(function, params);
}

void launch_pointers(void* a, void* b, void* c) {
  std::vector<void*> params = {&a, &b, &c};
  launch(kernels().ptrs3, params);
}

struct CppFloor : public torch::autograd::Function<CppFloor> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, bool is_causal) {
    c10::cuda::CUDAGuard guard(q.device());
    auto out = at::empty_like(q);
    auto lse = at::empty(q.sizes().slice(0, q.dim() - 1), q.options().dtype(at::kFloat));
    launch_maps(kernels().maps4, {q, k, v, out}, lse.data_ptr());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["is_causal"] = is_causal;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto& d_out = grads[0];
    c10::cuda::CUDAGuard guard(q.device());
    auto delta = at::empty_like(lse);
    auto accumulator = at::empty_like(q, q.options().dtype(at::kFloat));
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    launch_pointers(out.data_ptr(), d_out.data_ptr(), delta.data_ptr());  // D, and the accumulator's zero fill
    launch_maps(kernels().maps7, {q, k, v, d_out, dk, dv, accumulator}, lse.data_ptr());
    launch_pointers(accumulator.data_ptr(), dq.data_ptr(), nullptr);  // dQ's scale and cast
    return {dq, dk, dv, at::Tensor()};
  }
};

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal) {
  return CppFloor::apply(q, k, v, is_causal);
}
"""


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("cs336_cpp_floor", cpp_sources=[SOURCE], functions=["attention"], with_cuda=True,
                       extra_ldflags=["-lcuda"], extra_cflags=["-O2"], verbose=False)


def forward_backward_calls(providers: dict, q, k, v, do, causal: bool) -> dict:
    """Per provider, a call of its forward+backward on these inputs that leaves no gradient behind."""
    def both(fn):
        def call():
            fn(q, k, v, causal).backward(do)
            q.grad = k.grad = v.grad = None
        return call

    return {name: both(fn) for name, fn in providers.items()}


def alternating_rounds(calls: dict, q, k, v, rounds: int) -> tuple[dict, dict]:
    """Each call's do_bench times in `rounds` alternating rounds (as the grid times a point), and their medians."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(bench_ms(call, q.device, 25, 100, grad_to_none=[q, k, v], min_calls=10))
    return times, {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    floor = build()
    prov = provenance("cuda")
    providers = {"ours": get_attention("flash_triton"), "sdpa_flash": get_attention("sdpa_flash"),
                 "host_floor": HostFloor.apply, "cpp_floor": floor.attention}
    rows = []
    for shape in args.shapes:
        batch, heads, seq, dim, causal = shape
        q, k, v, do = tensors(batch, heads, seq, dim)

        calls = forward_backward_calls(providers, q, k, v, do, causal)
        ours_kernels = kernel_ms(calls["ours"], "")  # "": every kernel
        floor_kernels = kernel_ms(calls["cpp_floor"], "")
        times, med = alternating_rounds(calls, q, k, v, args.rounds)
        for name in calls:
            rows.append({"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                         "variant": name, "bench_ms": med[name], "over_sdpa_flash": med[name] / med["sdpa_flash"],
                         "rounds": " ".join(f"{t:.4f}" for t in times[name]),
                         "ours_kernel_ms": ours_kernels, "cpp_floor_kernel_ms": floor_kernels, **prov})
        print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}: ours kernels {ours_kernels:.4f} ms, cpp floor "
              f"kernels {floor_kernels:.4f} ms; " + ", ".join(f"{n} {m:.4f}" for n, m in med.items()), flush=True)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
