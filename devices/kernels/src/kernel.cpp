#include "kernel.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "arena.hpp"
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace mirrorsd_kern {

namespace {

constexpr int64_t kTaskBytes = 64 * 1024;  // packed bytes per ParallelFor task: many tasks per thread, few calls
// Below this many packed bytes the calling thread does it all (~15 us at one thread's bandwidth): waking a sleeping
// worker of ONNX Runtime's pool costs about as much (mode mirror's pools sleep between sections: devices/backends.py).
constexpr size_t kInlineBytes = 512 * 1024;

#define MIRRORSD_RETURN_IF(expr)    \
  do {                              \
    OrtStatus* _status = (expr);    \
    if (_status) return _status;    \
  } while (0)

OrtStatus* view(const OrtApi* api, const OrtValue* value, TensorView& out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  MIRRORSD_RETURN_IF(api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = api->GetTensorElementType(info, &out.type);
  if (!status) status = api->GetDimensionsCount(info, &rank);
  if (!status) {
    out.dims.assign(rank, 0);
    status = api->GetDimensions(info, out.dims.data(), rank);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status) return status;
  out.count = 1;
  for (int64_t d : out.dims) out.count *= d;
  return api->GetTensorMutableData(const_cast<OrtValue*>(value), &out.data);
}

bool input_present(const OrtApi* api, const OrtKernelInfo* info, size_t index) {
  size_t count = 0, size = 0;
  if (OrtStatus* s = api->KernelInfo_GetInputCount(info, &count)) return api->ReleaseStatus(s), false;
  if (index >= count) return false;
  if (OrtStatus* s = api->KernelInfo_GetInputName(info, index, nullptr, &size)) return api->ReleaseStatus(s), false;
  return size > 1;  // the size counts the terminating zero; an absent optional input has the empty name
}

// Every float step must round the same way on every thread, but ONNX Runtime may turn on flush-to-zero and
// denormals-are-zero on its pool threads (session.set_denormal_as_zero) and not on the calling one. The kernel's
// work runs in the default mode: round half to even, denormals kept, exceptions masked; the caller's is restored.
class DefaultFloatMode {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  DefaultFloatMode() : saved_(_mm_getcsr()) { _mm_setcsr(0x1F80); }
  ~DefaultFloatMode() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

std::atomic<size_t> packed_as_superblocks{0};

struct Job {
  const Shape* shape;
  void (*gemm)(const Shape& shape, const uint8_t* packed, const QuantizedRows& a, int64_t g0, int64_t g1,
               const float* bias, float* y);
  const uint8_t* packed;
  const QuantizedRows* rows;
  const float* bias;
  float* y;
  int64_t groups, groups_per_task;
};

void run_task(void* data, size_t task) {
  const DefaultFloatMode mode;
  const Job& job = *static_cast<const Job*>(data);
  const int64_t g0 = static_cast<int64_t>(task) * job.groups_per_task;
  const int64_t g1 = g0 + job.groups_per_task < job.groups ? g0 + job.groups_per_task : job.groups;
  job.gemm(*job.shape, job.packed, *job.rows, g0, g1, job.bias, job.y);
}

}  // namespace

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

std::string node_name(const OrtApi* api, const OrtKernelInfo* info) {
  size_t size = 0;
  if (OrtStatus* s = api->KernelInfo_GetNodeName(info, nullptr, &size)) return api->ReleaseStatus(s), "";
  std::string name(size, '\0');
  if (OrtStatus* s = api->KernelInfo_GetNodeName(info, name.data(), &size)) return api->ReleaseStatus(s), "";
  return name.c_str();  // drops the terminating zero
}

int prefetch_wanted(const Path& path) {
  const char* value = std::getenv("MIRRORSD_KERNELS_PREFETCH");
  if (value && *value) {
    char* end = nullptr;
    const long rows = std::strtol(value, &end, 10);
    if (*end == '\0' && rows >= 0) return rows > 64 ? 64 : static_cast<int>(rows);  // (no tile has 64 rows)
  }
#if defined(__x86_64__) || defined(_M_X64)
  return &path != &avx512_path() || __builtin_cpu_is("intel") ? 1 : kAvx512PrefetchFromElsewhere;
#else
  (void)path;
  return 1;
#endif
}

bool superblocks_wanted() {
  const char* value = std::getenv("MIRRORSD_KERNELS_SUPERBLOCKS");
  return !(value && std::strcmp(value, "0") == 0);
}

size_t superblock_nodes() { return packed_as_superblocks.load(); }

void ArenaDeleter::operator()(uint8_t* p) const { arena_release(p); }

OrtStatus* Kernel::error(OrtErrorCode code, const std::string& what, const std::string& fix) const {
  const std::string text = "mirrorsd.kern MatMulNBits node '" + node_ + "': " + what + ". Fix: " + fix + ".";
  return api_->CreateStatus(code, text.c_str());
}

OrtStatus* Kernel::create(const OrtApi* api, const OrtKernelInfo* info, Kernel** out) {
  std::unique_ptr<Kernel> kernel(new Kernel(api, node_name(api, info)));
  std::string why;
  kernel->path_ = select_path(why);
  if (!kernel->path_) return kernel->error(ORT_FAIL, why, "unset MIRRORSD_KERNELS_ISA or name a path this CPU runs");
  MIRRORSD_RETURN_IF(kernel->read_attributes(info));
  MIRRORSD_RETURN_IF(kernel->check_optional_inputs(info));
  MIRRORSD_RETURN_IF(kernel->pack_weights(info));
  *out = kernel.release();
  return nullptr;
}

OrtStatus* Kernel::read_attributes(const OrtKernelInfo* info) {
  const char* names[] = {"K", "N", "bits", "block_size"};
  int64_t values[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    if (OrtStatus* s = api_->KernelInfoGetAttribute_int64(info, names[i], &values[i])) {
      api_->ReleaseStatus(s);
      return error(ORT_INVALID_ARGUMENT, std::string("the int attribute '") + names[i] + "' is missing",
                   "MatMulNBits needs K, N, bits and block_size");
    }
  }
  const int64_t K = values[0], N = values[1], bits = values[2], block = values[3];
  if (K <= 0 || N <= 0)
    return error(ORT_INVALID_ARGUMENT, "K=" + std::to_string(K) + " and N=" + std::to_string(N) + " must be >= 1",
                 "re-quantize the model");
  if (bits != 4 && bits != 8)
    return error(ORT_NOT_IMPLEMENTED, "bits=" + std::to_string(bits) + " (this kernel handles 4 and 8)",
                 "quantize with bits=4 or 8, or run the node with ONNX Runtime's own kernel");
  if (block != kBlock)
    return error(ORT_NOT_IMPLEMENTED, "block_size=" + std::to_string(block) + " (this kernel handles 32)",
                 "quantize with block_size=32, or run the node with ONNX Runtime's own kernel");
  shape_.K = K;
  shape_.N = N;
  shape_.kb = (K + kBlock - 1) / kBlock;
  shape_.bits = static_cast<int>(bits);
  return nullptr;
}

OrtStatus* Kernel::check_optional_inputs(const OrtKernelInfo* info) {
  if (input_present(api_, info, kGroupIndex))
    return error(ORT_NOT_IMPLEMENTED, "g_idx is given (act-order weights are not handled)",
                 "run the node with ONNX Runtime's own kernel");
  shape_.offsets = input_present(api_, info, kZeroPoints);
  shape_.prefetch_from = prefetch_wanted(*path_);
  return nullptr;
}

OrtStatus* Kernel::constant_input(const OrtKernelInfo* info, size_t index, const char* name, TensorView& out) const {
  const OrtValue* value = nullptr;
  int constant = 0;
  OrtStatus* s = api_->KernelInfoGetConstantInput_tensor(info, index, &constant, &value);
  if (s) api_->ReleaseStatus(s);
  if (s || !constant)
    return error(ORT_NOT_IMPLEMENTED, std::string(name) + " is not a constant initializer",
                 "keep B, scales and zero_points as initializers (MatMulNBitsQuantizer does): they are packed once");
  return view(api_, value, out);
}

// Float zero points, one per (column, block) like the scales; packed uint8 ones are refused.
OrtStatus* Kernel::check_zero_points(const TensorView& zero_points) const {
  if (zero_points.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8)
    return error(ORT_NOT_IMPLEMENTED, "packed uint8 zero_points are given (this kernel handles float zero points, "
                 "or none)", "give float zero points, quantize with is_symmetric=True, or run the node with ONNX "
                 "Runtime's own kernel");
  if (zero_points.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    return error(ORT_INVALID_ARGUMENT, "zero_points are neither float nor uint8", "re-quantize the model");
  const int64_t expected = shape_.N * shape_.kb;
  if (zero_points.count != expected)
    return error(ORT_INVALID_ARGUMENT, "zero_points has " + std::to_string(zero_points.count) +
                 " values, expected N * ceil(K/32) = " + std::to_string(expected), "re-quantize the model");
  return nullptr;
}

OrtStatus* Kernel::pack_weights(const OrtKernelInfo* info) {
  TensorView b, scales, zero_points;
  MIRRORSD_RETURN_IF(constant_input(info, kB, "B", b));
  MIRRORSD_RETURN_IF(constant_input(info, kScales, "scales", scales));
  if (shape_.offsets) {
    MIRRORSD_RETURN_IF(constant_input(info, kZeroPoints, "zero_points", zero_points));
    MIRRORSD_RETURN_IF(check_zero_points(zero_points));
  }
  const Shape& s = shape_;
  if (b.count != s.N * s.kb * s.blob() || b.dims.empty() || b.dims[0] != s.N)
    return error(ORT_INVALID_ARGUMENT, "B has shape " + shape_text(b.dims) + ", expected [" + std::to_string(s.N) +
                 ", " + std::to_string(s.kb) + ", " + std::to_string(s.blob()) + "] for K, N and bits",
                 "re-quantize the model");
  if (scales.count != s.N * s.kb)
    return error(ORT_INVALID_ARGUMENT, "scales has " + std::to_string(scales.count) +
                 " values, expected N * ceil(K/32) = " + std::to_string(s.N * s.kb), "re-quantize the model");
  SuperBlocks parts;
  superblocks_ = path_->pack_superblocks && superblocks_wanted() &&
                 find_superblocks(s, static_cast<const float*>(scales.data),
                                  static_cast<const float*>(zero_points.data), parts);
  packed_bytes_ = superblocks_ ? path_->superblock_bytes(s) : path_->packed_bytes(s);
  packed_.reset(arena_allocate(packed_bytes_));  // in 2 MiB pages shared with other nodes (arena.hpp)
  if (!packed_)
    return error(ORT_FAIL, "cannot allocate " + std::to_string(packed_bytes_) + " bytes for packed B", "free memory");
  if (superblocks_) {
    path_->pack_superblocks(s, static_cast<const uint8_t*>(b.data), parts, packed_.get());
    ++packed_as_superblocks;
  } else {
    path_->pack(s, static_cast<const uint8_t*>(b.data), static_cast<const float*>(scales.data),
                static_cast<const float*>(zero_points.data), packed_.get());
  }
  groups_ = (s.N + path_->group - 1) / path_->group;
  const int64_t group_bytes = static_cast<int64_t>(packed_bytes_) / groups_;
  groups_per_task_ = group_bytes >= kTaskBytes ? 1 : kTaskBytes / group_bytes;
  return nullptr;
}

OrtStatus* Kernel::compute(OrtKernelContext* context) const {
  const OrtValue* a_value = nullptr;
  MIRRORSD_RETURN_IF(api_->KernelContext_GetInput(context, kA, &a_value));
  TensorView a;
  MIRRORSD_RETURN_IF(view(api_, a_value, a));
  if (a.dims.empty() || a.dims.back() != shape_.K)
    return error(ORT_INVALID_ARGUMENT, "A has shape " + shape_text(a.dims) + ", whose last dimension is not K=" +
                 std::to_string(shape_.K), "feed A as [..., K]");
  std::vector<int64_t> y_dims = a.dims;
  y_dims.back() = shape_.N;
  OrtValue* y_value = nullptr;
  MIRRORSD_RETURN_IF(api_->KernelContext_GetOutput(context, 0, y_dims.data(), y_dims.size(), &y_value));
  TensorView y;
  MIRRORSD_RETURN_IF(view(api_, y_value, y));
  const float* bias = nullptr;
  size_t inputs = 0;
  MIRRORSD_RETURN_IF(api_->KernelContext_GetInputCount(context, &inputs));
  if (inputs > kBias) {
    const OrtValue* bias_value = nullptr;
    MIRRORSD_RETURN_IF(api_->KernelContext_GetInput(context, kBias, &bias_value));
    if (bias_value) {
      TensorView view_bias;
      MIRRORSD_RETURN_IF(view(api_, bias_value, view_bias));
      if (view_bias.count != shape_.N)
        return error(ORT_INVALID_ARGUMENT, "bias has shape " + shape_text(view_bias.dims) + ", expected [" +
                     std::to_string(shape_.N) + "]", "give one bias value per output column");
      bias = static_cast<const float*>(view_bias.data);
    }
  }
  const int64_t rows = a.count / shape_.K;
  if (rows == 0) return nullptr;
  thread_local QuantizedRows quantized;  // reused across calls on this thread
  {
    const DefaultFloatMode mode;
    quantize_rows(*path_, static_cast<const float*>(a.data), rows, shape_, quantized);
  }
  Job job{&shape_, superblocks_ ? path_->gemm_superblocks : path_->gemm, packed_.get(), &quantized, bias,
          static_cast<float*>(y.data), groups_, groups_per_task_};
  const size_t tasks = static_cast<size_t>((groups_ + groups_per_task_ - 1) / groups_per_task_);
  if (tasks == 1 || packed_bytes_ < kInlineBytes) {
    for (size_t task = 0; task < tasks; ++task) run_task(&job, task);
    return nullptr;
  }
  return api_->KernelContext_ParallelFor(context, run_task, tasks, 0, &job);
}

}  // namespace mirrorsd_kern
