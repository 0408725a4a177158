// The flash_triton backend's autograd node in C++ (built and driven by kernels/flash/host/node.py).
//
// At host-bound calls (a few hundred microseconds of forward+backward) a Python autograd.Function costs more than
// the kernels: the engine runs its Python backward on autograd's device thread, where every Python line costs
// 1.5-2.4x what it costs on the calling thread.
// This node does what the per-layout plans of fa2.py (FA2) and gluon_fwd.py / gluon_bwd.py (Hopper) do, in C++: it allocates
// the outputs and the scratch buffers and launches the binaries Triton compiled for the layout, with the arguments
// Triton would pass, through cuLaunchKernel. Its backward runs no Python at all.
// The two passes are also exported alone, without autograd (`forward`, `backward`): the kernels of the operators
// that compiled graphs call.
//
// What it launches comes from Python, per layout: each Launch holds a CUfunction (Triton's loaded binary), the
// grid, the block and shared-memory sizes, and the kernel's parameters as bytes, where the pointer parameters name
// one of the call's tensors (`Slot`) and are written in at each launch, and so are the TMA descriptors (`TensorMap`:
// encoded at each launch for the slot's address, with the geometry fixed by the layout). host/node.py reads those
// from Triton's compiled kernels; this file knows nothing of Triton.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <array>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

// The tensors of one call. The forward has the first five; the backward the rest too, of which DELTA, DQ_ACC and
// LSE2 are scratch buffers that the plan lays out (FA2's backward uses DELTA; Gluon's all three).
enum Slot : int { Q, K, V, OUT, LSE, GRAD_OUT, DELTA, DQ, DK, DV, DQ_ACC, LSE2, SLOTS };
using Tensors = std::array<at::Tensor, SLOTS>;

// cuLaunchKernel and cuTensorMapEncodeTiled from the driver library the process has loaded (torch and Triton load
// libcuda.so.1), so that the build needs CUDA's headers but links nothing of it.
struct Driver {
  decltype(&cuLaunchKernel) launch;
  decltype(&cuTensorMapEncodeTiled) encode;
  decltype(&cuGetErrorString) error_string;
};

const Driver& driver() {
  static const Driver loaded = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(library != nullptr, "flash_node: cannot open libcuda.so.1: ", dlerror());
    Driver found{reinterpret_cast<decltype(&cuLaunchKernel)>(dlsym(library, "cuLaunchKernel")),
                 reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(dlsym(library, "cuTensorMapEncodeTiled")),
                 reinterpret_cast<decltype(&cuGetErrorString)>(dlsym(library, "cuGetErrorString"))};
    TORCH_CHECK(found.launch != nullptr && found.encode != nullptr && found.error_string != nullptr,
                "flash_node: libcuda.so.1 has no cuLaunchKernel, cuTensorMapEncodeTiled or cuGetErrorString");
    return found;
  }();
  return loaded;
}

void check_driver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  driver().error_string(result, &text);
  TORCH_CHECK(false, "flash_node: ", what, " failed: ", text ? text : "unknown error", " (", result, ")");
}

// Big enough for the Gluon backward's parameters (nine TMA descriptors of 128 bytes, each followed by its shape
// and strides, ~110 parameters in all); Launch's constructor checks.
constexpr size_t kMaxParams = 192;
constexpr size_t kMaxParamBytes = 3072;
constexpr size_t kTensorMapBytes = sizeof(CUtensorMap);  // 128, aligned to 64 as a kernel parameter

// A TMA descriptor parameter: everything cuTensorMapEncodeTiled takes but the address, which is the data pointer of
// the call's tensor `slot`. The arrays are in the driver's order (innermost dimension first); `strides` are in
// bytes, one fewer than the dimensions.
struct TensorMap {
  TensorMap(int64_t param, int64_t slot, int64_t data_type, std::vector<int64_t> dims, std::vector<int64_t> strides,
            std::vector<int64_t> box, int64_t swizzle, int64_t fill)
      : param(param), slot(static_cast<Slot>(slot)), data_type(static_cast<CUtensorMapDataType>(data_type)),
        rank(static_cast<unsigned>(dims.size())), swizzle(static_cast<CUtensorMapSwizzle>(swizzle)),
        fill(static_cast<CUtensorMapFloatOOBfill>(fill)) {
    TORCH_CHECK(slot >= 0 && slot < SLOTS, "flash_node: TensorMap slot ", slot, " is not 0..", SLOTS - 1);
    TORCH_CHECK(rank >= 1 && rank <= 5, "flash_node: a TensorMap has 1..5 dimensions, got ", dims.size());
    TORCH_CHECK(box.size() == rank && strides.size() + 1 == rank, "flash_node: a TensorMap of ", rank,
                " dimensions needs as many box sizes (got ", box.size(), ") and one stride fewer (got ",
                strides.size(), ")");
    for (unsigned i = 0; i < rank; ++i) {
      TORCH_CHECK(dims[i] > 0 && box[i] > 0, "flash_node: TensorMap dims ", dims, " and box ", box,
                  " must be positive");
      this->dims[i] = static_cast<cuuint64_t>(dims[i]);
      this->box[i] = static_cast<cuuint32_t>(box[i]);
    }
    for (unsigned i = 0; i + 1 < rank; ++i) {
      TORCH_CHECK(strides[i] > 0 && strides[i] % 16 == 0, "flash_node: TensorMap strides ", strides,
                  " must be positive multiples of 16 bytes");
      this->strides[i] = static_cast<cuuint64_t>(strides[i]);
    }
  }

  // Encodes the descriptor of `address` at `out` (kTensorMapBytes, 64-byte aligned).
  void encode(void* address, void* out) const {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(address) % 16 == 0, "flash_node: a TMA base address must be 16-byte "
                "aligned, got ", address);
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    check_driver(driver().encode(static_cast<CUtensorMap*>(out), data_type, rank, address, dims.data(),
                                 strides.data(), box.data(), element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_128B, fill),
                 "cuTensorMapEncodeTiled");
  }

  int64_t param;  // an index into the Launch's parameters
  Slot slot;
  CUtensorMapDataType data_type;
  unsigned rank;
  std::array<cuuint64_t, 5> dims{};
  std::array<cuuint64_t, 5> strides{};
  std::array<cuuint32_t, 5> box{};
  CUtensorMapSwizzle swizzle;
  CUtensorMapFloatOOBfill fill;
};

// One kernel launch of a fixed layout.
class Launch {
 public:
  // `params`: the parameters' bytes, back to back, each at `offsets[i]`; `pointer_params[j]` (an index into
  // `offsets`) takes the data pointer of the call's tensor `pointer_slots[j]`, and each of `tensor_maps` its
  // parameter's TMA descriptor.
  Launch(int64_t function, std::vector<int64_t> grid, int64_t threads, int64_t shared_bytes, const std::string& params,
         std::vector<int64_t> offsets, std::vector<int64_t> pointer_params, std::vector<int64_t> pointer_slots,
         std::vector<TensorMap> tensor_maps)
      : function_(reinterpret_cast<CUfunction>(function)),
        threads_(static_cast<unsigned>(threads)),
        shared_bytes_(static_cast<unsigned>(shared_bytes)),
        params_(params),
        offsets_(std::move(offsets)),
        tensor_maps_(std::move(tensor_maps)) {
    TORCH_CHECK(function != 0, "flash_node: Launch needs a loaded CUfunction, got 0");
    TORCH_CHECK(grid.size() == 3 && grid[0] > 0 && grid[1] > 0 && grid[2] > 0,
                "flash_node: the grid must be 3 positive sizes, got ", grid);
    TORCH_CHECK(threads > 0 && threads <= 1024, "flash_node: threads=", threads, " is not 1..1024");
    TORCH_CHECK(offsets_.size() <= kMaxParams, "flash_node: ", offsets_.size(), " parameters, at most ", kMaxParams);
    TORCH_CHECK(params_.size() <= kMaxParamBytes, "flash_node: ", params_.size(), " parameter bytes, at most ",
                kMaxParamBytes);
    TORCH_CHECK(pointer_params.size() == pointer_slots.size(), "flash_node: ", pointer_params.size(),
                " pointer parameters but ", pointer_slots.size(), " slots");
    for (size_t i = 0; i < 3; ++i) grid_[i] = static_cast<unsigned>(grid[i]);
    for (int64_t offset : offsets_) {
      TORCH_CHECK(offset >= 0 && static_cast<size_t>(offset) < params_.size(), "flash_node: parameter offset ",
                  offset, " outside the ", params_.size(), " bytes");
    }
    for (size_t j = 0; j < pointer_params.size(); ++j) {
      TORCH_CHECK(pointer_params[j] >= 0 && static_cast<size_t>(pointer_params[j]) < offsets_.size(),
                  "flash_node: pointer parameter ", pointer_params[j], " is not one of the ", offsets_.size());
      TORCH_CHECK(pointer_slots[j] >= 0 && pointer_slots[j] < SLOTS, "flash_node: slot ", pointer_slots[j],
                  " is not 0..", SLOTS - 1);
      size_t offset = static_cast<size_t>(offsets_[pointer_params[j]]);
      TORCH_CHECK(offset + sizeof(CUdeviceptr) <= params_.size(), "flash_node: pointer parameter ", pointer_params[j],
                  " does not fit in the parameter bytes");
      pointers_.push_back({offset, static_cast<Slot>(pointer_slots[j])});
    }
    for (const TensorMap& map : tensor_maps_) {
      TORCH_CHECK(map.param >= 0 && static_cast<size_t>(map.param) < offsets_.size(), "flash_node: TensorMap "
                  "parameter ", map.param, " is not one of the ", offsets_.size());
      size_t offset = static_cast<size_t>(offsets_[map.param]);
      TORCH_CHECK(offset % 64 == 0 && offset + kTensorMapBytes <= params_.size(), "flash_node: TensorMap parameter ",
                  map.param, " at byte ", offset, " is not 64-byte aligned within the ", params_.size(), " bytes");
    }
  }

  void run(const Tensors& tensors, CUstream stream) const {
    alignas(128) unsigned char bytes[kMaxParamBytes];
    void* params[kMaxParams];
    std::memcpy(bytes, params_.data(), params_.size());
    for (const Pointer& pointer : pointers_) {
      auto address = reinterpret_cast<CUdeviceptr>(tensors[pointer.slot].data_ptr());
      std::memcpy(bytes + pointer.offset, &address, sizeof(address));
    }
    for (const TensorMap& map : tensor_maps_) map.encode(tensors[map.slot].data_ptr(), bytes + offsets_[map.param]);
    for (size_t i = 0; i < offsets_.size(); ++i) params[i] = bytes + offsets_[i];
    check_driver(driver().launch(function_, grid_[0], grid_[1], grid_[2], threads_, 1, 1, shared_bytes_, stream,
                                 params, nullptr),
                 "cuLaunchKernel");
  }

 private:
  struct Pointer {
    size_t offset;
    Slot slot;
  };
  CUfunction function_;
  std::array<unsigned, 3> grid_{};
  unsigned threads_;
  unsigned shared_bytes_;
  std::string params_;
  std::vector<int64_t> offsets_;
  std::vector<Pointer> pointers_;
  std::vector<TensorMap> tensor_maps_;
};

// A float32 scratch buffer of the backward, fixed by the layout: sizes and strides.
struct Scratch {
  Scratch(int64_t slot, std::vector<int64_t> sizes, std::vector<int64_t> strides)
      : slot(static_cast<Slot>(slot)), sizes(std::move(sizes)), strides(std::move(strides)) {
    TORCH_CHECK(slot == DELTA || slot == DQ_ACC || slot == LSE2, "flash_node: slot ", slot,
                " is not a scratch buffer's (delta, dq_acc, lse2)");
    TORCH_CHECK(this->sizes.size() == this->strides.size(), "flash_node: scratch sizes ", this->sizes,
                " and strides ", this->strides, " differ in length");
  }
  Slot slot;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

// The launches of one call layout: the forward's, then the backward's in order, one list per dO layout its binaries
// were made for (`grad_strides[i]` for `backward[i]`; the first is the one any other dO is copied into); the backward's
// scratch buffers (the same for every dO layout); where `dq_scale` is not 0, dQ is the float32
// accumulator DQ_ACC times dq_scale, rounded to dQ's dtype after the launches (Gluon's backward); and tensors the
// launches read by a fixed address (`keep`: a persistent schedule), kept alive with the plan.
struct Plan : torch::CustomClassHolder {
  Plan(std::vector<Launch> forward, std::vector<std::vector<Launch>> backward,
       std::vector<std::vector<int64_t>> grad_strides, std::vector<Scratch> scratch, double dq_scale,
       std::vector<at::Tensor> keep)
      : forward(std::move(forward)), backward(std::move(backward)), grad_strides(std::move(grad_strides)),
        scratch(std::move(scratch)), dq_scale(dq_scale), keep(std::move(keep)) {
    TORCH_CHECK(!this->backward.empty() && this->backward.size() == this->grad_strides.size(), "flash_node: ",
                this->backward.size(), " backward launch lists for ", this->grad_strides.size(),
                " dO layouts (one each, at least one)");
    // dQ's scale as Python's `torch.mul(dq_acc, scale, out=dq)` passes it: a wrapped number (a CPU scalar that
    // takes the accumulator's dtype), so that the product and its rounding into dQ are the Python path's
    scale_tensor = at::scalar_tensor(dq_scale, at::TensorOptions().dtype(at::kDouble));
    scale_tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  std::vector<Launch> forward;
  std::vector<std::vector<Launch>> backward;
  std::vector<std::vector<int64_t>> grad_strides;
  std::vector<Scratch> scratch;
  double dq_scale;
  std::vector<at::Tensor> keep;
  at::Tensor scale_tensor;
};

CUstream current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

// The forward's launches on q, k, v: O (in q's layout) and L, as both Python forwards allocate them.
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const Plan& plan) {
  c10::cuda::CUDAGuard guard(q.device());
  Tensors t;
  t[Q] = q, t[K] = k, t[V] = v;
  t[OUT] = at::empty_like(q);
  t[LSE] = at::empty(q.sizes().slice(0, q.dim() - 1), q.options().dtype(at::kFloat));  // float32, q.shape[:-1]
  CUstream stream = current_stream(q);
  for (const Launch& launch : plan.forward) launch.run(t, stream);
  return {t[OUT], t[LSE]};
}

// The backward's launches: dQ, dK and dV as the Python backwards allocate them (each in its input's layout).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& out,
                                                            const at::Tensor& lse, at::Tensor grad,
                                                            const Plan& plan) {
  c10::cuda::CUDAGuard guard(q.device());
  // Each list of backward binaries was compiled for one dense dO layout, 16-byte aligned (Triton specialises
  // pointers on it): a dO of none of them (an expanded ones tensor, a strided view) is copied into the first one.
  const std::vector<Launch>* launches = nullptr;
  if (reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 == 0) {
    for (size_t i = 0; i < plan.grad_strides.size() && launches == nullptr; ++i) {
      if (grad.strides().equals(plan.grad_strides[i])) launches = &plan.backward[i];
    }
  }
  if (launches == nullptr) {
    grad = at::empty_strided(grad.sizes(), plan.grad_strides[0], grad.options()).copy_(grad);
    launches = &plan.backward[0];
  }
  Tensors t;
  t[Q] = q, t[K] = k, t[V] = v, t[OUT] = out, t[LSE] = lse, t[GRAD_OUT] = grad;
  for (const Scratch& buffer : plan.scratch) {
    t[buffer.slot] = at::empty_strided(buffer.sizes, buffer.strides, q.options().dtype(at::kFloat));
  }
  t[DQ] = at::empty_like(q);
  t[DK] = at::empty_like(k);
  t[DV] = at::empty_like(v);
  CUstream stream = current_stream(q);
  for (const Launch& launch : *launches) launch.run(t, stream);
  if (plan.dq_scale != 0.0) at::mul_out(t[DQ], t[DQ_ACC], plan.scale_tensor);  // one pass: scale, round, layout
  return {t[DQ], t[DK], t[DV]};
}

class FlashNode : public torch::autograd::Function<FlashNode> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<Plan>& plan) {
    auto [out, lse] = run_forward(q, k, v, *plan);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    auto saved = ctx->get_saved_variables();
    auto plan = c10::static_intrusive_pointer_cast<Plan>(ctx->saved_data["plan"].toCapsule());
    auto [dq, dk, dv] = run_backward(saved[0], saved[1], saved[2], saved[3], saved[4], grads[0], *plan);
    return {dq, dk, dv, at::Tensor()};
  }
};

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::intrusive_ptr<Plan>& plan) {
  return FlashNode::apply(q, k, v, plan);
}

// The two passes alone, without autograd: the kernels of flash_triton's operators when a compiled graph calls them.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const c10::intrusive_ptr<Plan>& plan) {
  return run_forward(q, k, v, *plan);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& lse, const at::Tensor& grad_out,
                                                        const c10::intrusive_ptr<Plan>& plan) {
  return run_backward(q, k, v, out, lse, grad_out, *plan);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The flash_triton backend's autograd node in C++ (kernels/flash/host/node.py)";
  py::class_<TensorMap>(m, "TensorMap")
      .def(py::init<int64_t, int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    int64_t, int64_t>(),
           py::arg("param"), py::arg("slot"), py::arg("data_type"), py::arg("dims"), py::arg("strides"),
           py::arg("box"), py::arg("swizzle"), py::arg("fill"));
  py::class_<Launch>(m, "Launch")
      .def(py::init<int64_t, std::vector<int64_t>, int64_t, int64_t, const std::string&, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<TensorMap>>(),
           py::arg("function"), py::arg("grid"), py::arg("threads"), py::arg("shared_bytes"), py::arg("params"),
           py::arg("offsets"), py::arg("pointer_params"), py::arg("pointer_slots"), py::arg("tensor_maps"));
  py::class_<Scratch>(m, "Scratch")
      .def(py::init<int64_t, std::vector<int64_t>, std::vector<int64_t>>(), py::arg("slot"), py::arg("sizes"),
           py::arg("strides"));
  py::class_<Plan, c10::intrusive_ptr<Plan>>(m, "Plan")
      .def(py::init<std::vector<Launch>, std::vector<std::vector<Launch>>, std::vector<std::vector<int64_t>>,
                    std::vector<Scratch>, double, std::vector<at::Tensor>>(),
           py::arg("forward"), py::arg("backward"), py::arg("grad_strides"), py::arg("scratch"), py::arg("dq_scale"),
           py::arg("keep"));
  m.def("flash_attention", &flash_attention, "O of q, k, v through the plan's launches, with the C++ backward",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("plan"));
  m.def("forward", &forward, "(O, L) of q, k, v through the plan's forward launches (no autograd)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("plan"));
  m.def("backward", &backward, "(dQ, dK, dV) through the plan's backward launches (no autograd)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("grad_out"), py::arg("plan"));
  m.attr("SLOTS") =
      py::make_tuple("q", "k", "v", "out", "lse", "grad_out", "delta", "dq", "dk", "dv", "dq_acc", "lse2");
}
