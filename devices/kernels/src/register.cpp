// The library's entry points: RegisterCustomOps (what SessionOptions.register_custom_ops_library calls) adds the
// domain "mirrorsd.kern" with three ops: MatMulNBits, a drop-in for com.microsoft::MatMulNBits (same inputs,
// outputs and attributes), and GroupedAttention and InPlaceAttention (attention.cpp), which only graphs rewritten for
// them name (devices/kernels/attention_rewrite.py, kv_in_place.py). Two ways to route a graph's
// MatMulNBits nodes to the first:
//   - rewrite the nodes' domain: "mirrorsd.kern" has the length of "com.microsoft", so the bytes change in place;
//   - set the session config entry "mirrorsd_kern.replace_com_microsoft" = "1" before registering: the op is then
//     also registered as com.microsoft::MatMulNBits, and ONNX Runtime, which looks in custom-op registries before
//     its own kernels, runs it for every MatMulNBits node of an unchanged graph.
// mirrorsd_kern_paths() tells a caller (through ctypes) which paths this CPU runs.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "arena.hpp"
#include "attention.hpp"
#include "kernel.hpp"

namespace mirrorsd_kern {

namespace {

constexpr const char* kDomain = "mirrorsd.kern";
constexpr const char* kOrtDomain = "com.microsoft";
constexpr const char* kReplaceKey = "mirrorsd_kern.replace_com_microsoft";
static_assert(sizeof("mirrorsd.kern") == sizeof("com.microsoft"), "the domain must be rewritable in place");

bool cpu_runs(const Path& path) {
#if defined(__x86_64__) || defined(_M_X64)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (&path == &avx512_path()) return avx512;
  if (&path == &amx_path())
    return avx512 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_ready();
  if (&path == &avx2_path()) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return &path == &scalar_path();
}

// Every path this build has, fastest first.
const Path* const* all_paths(size_t& count) {
#if defined(__x86_64__) || defined(_M_X64)
  // amx is not picked by default: it measured no faster than avx512vnni on a Sapphire Rapids class Xeon
  // (MIRRORSD_KERNELS_ISA names it)
  static const Path* const paths[] = {&avx512_path(), &amx_path(), &avx2_path(), &scalar_path()};
  count = 4;
#else
  static const Path* const paths[] = {&scalar_path()};
  count = 1;
#endif
  return paths;
}

ONNXTensorElementDataType input_type(const OrtCustomOp*, size_t index) {
  switch (index) {
    case kB: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    case kZeroPoints: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float taken, uint8 refused at creation
    case kGroupIndex: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;  // A, scales, bias
  }
}

OrtCustomOpInputOutputCharacteristic input_kind(const OrtCustomOp*, size_t index) {
  return index < kZeroPoints ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  Kernel* made = nullptr;
  OrtStatus* status = Kernel::create(api, info, &made);
  *kernel = made;
  return status;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  return static_cast<const Kernel*>(kernel)->compute(context);
}

const OrtCustomOp* matmul_nbits_op() {
  static OrtCustomOp op = [] {
    OrtCustomOp o;
    std::memset(&o, 0, sizeof(o));
    o.version = kOrtApiVersion;  // ORT reads only the fields of this API level
    o.GetName = [](const OrtCustomOp*) { return "MatMulNBits"; };
    o.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    o.GetInputType = input_type;
    o.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kInputCount; };
    o.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    o.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    o.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
    o.GetInputCharacteristic = input_kind;
    o.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    o.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    o.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    o.CreateKernelV2 = create_kernel;
    o.KernelComputeV2 = compute;
    o.GetStartVersion = [](const OrtCustomOp*) { return 1; };
    o.GetEndVersion = [](const OrtCustomOp*) { return 1 << 30; };
    return o;
  }();
  return &op;
}

// A custom op whose inputs and outputs are all float tensors, required (the last input variadic when VariadicLast),
// made by Op::create and run by its kernel's compute: GroupedAttention and InPlaceAttention.
template <class Op, const char* Name, size_t Inputs, size_t Outputs, bool VariadicLast = false>
const OrtCustomOp* float_op() {
  using K = typename Op::Kernel;
  static OrtCustomOp op = [] {
    OrtCustomOp o;
    std::memset(&o, 0, sizeof(o));
    o.version = kOrtApiVersion;
    o.GetName = [](const OrtCustomOp*) { return Name; };
    o.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    o.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    o.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return Inputs; };
    o.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    o.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return Outputs; };
    o.KernelDestroy = [](void* kernel) { delete static_cast<K*>(kernel); };
    o.GetInputCharacteristic = [](const OrtCustomOp*, size_t index) {
      return VariadicLast && index + 1 == Inputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
    };
    o.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    o.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    o.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    o.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    o.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
      K* made = nullptr;
      OrtStatus* status = Op::create(api, info, &made);
      *kernel = made;
      return status;
    };
    o.KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<const K*>(kernel)->compute(context);
    };
    o.GetStartVersion = [](const OrtCustomOp*) { return 1; };
    o.GetEndVersion = [](const OrtCustomOp*) { return 1 << 30; };
    return o;
  }();
  return &op;
}

constexpr char kGroupedAttention[] = "GroupedAttention";
constexpr char kInPlaceAttention[] = "InPlaceAttention";

OrtStatus* wants_replace(const OrtApi* api, const OrtSessionOptions* options, bool& replace) {
  int has = 0;
  replace = false;
  if (OrtStatus* s = api->HasSessionConfigEntry(options, kReplaceKey, &has)) return s;
  if (!has) return nullptr;
  char value[8] = {0};
  size_t size = sizeof(value);
  OrtStatus* s = api->GetSessionConfigEntry(options, kReplaceKey, value, &size);
  if (s || (std::strcmp(value, "0") != 0 && std::strcmp(value, "1") != 0)) {
    if (s) api->ReleaseStatus(s);
    const std::string text = std::string("mirrorsd.kern: the session config entry ") + kReplaceKey +
                             " must be \"0\" or \"1\"";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, text.c_str());
  }
  replace = value[0] == '1';
  return nullptr;
}

}  // namespace

const Path* select_path(std::string& why) {
  size_t count = 0;
  const Path* const* paths = all_paths(count);
  const char* wanted = std::getenv("MIRRORSD_KERNELS_ISA");
  const bool forced = wanted && *wanted;
  for (size_t i = 0; i < count; ++i) {  // fastest first
    if (forced && std::strcmp(wanted, paths[i]->name) != 0) continue;
    if (cpu_runs(*paths[i])) return paths[i];
    if (!forced) continue;  // not on this CPU: the next one
    why = std::string("MIRRORSD_KERNELS_ISA=") + wanted + " names a path this CPU cannot run";
    return nullptr;
  }
  why = forced ? std::string("MIRRORSD_KERNELS_ISA=") + wanted + " names no path (avx512vnni, amx, avx2, scalar)"
               : std::string("this CPU runs none of the built paths");
  return nullptr;
}

}  // namespace mirrorsd_kern

extern "C" {

// "name:1,name:0,..." for every path this build has (1: this CPU runs it), fastest first.
ORT_EXPORT const char* mirrorsd_kern_paths() {
  static std::string text;
  static std::once_flag once;
  std::call_once(once, [] {
    size_t count = 0;
    const mirrorsd_kern::Path* const* paths = mirrorsd_kern::all_paths(count);
    for (size_t i = 0; i < count; ++i)
      text += std::string(i ? "," : "") + paths[i]->name + (mirrorsd_kern::cpu_runs(*paths[i]) ? ":1" : ":0");
  });
  return text.c_str();
}

// The packed-weight arena now (src/arena.hpp): out[0] chunks, out[1] bytes reserved, out[2] parts not released.
ORT_EXPORT void mirrorsd_kern_arena_counts(size_t out[3]) {
  const mirrorsd_kern::ArenaCounts counts = mirrorsd_kern::arena_counts();
  out[0] = counts.chunks, out[1] = counts.reserved, out[2] = counts.live;
}

// The fewest rows a tile of kernels created now (on the path MIRRORSD_KERNELS_ISA or the CPU picks) has when it
// prefetches B ahead of the stream: 1 every tile, 0 none, N tiles of N rows or more; -1 when no path runs (kernel.hpp:
// prefetch_wanted).
ORT_EXPORT int mirrorsd_kern_prefetch() {
  std::string why;
  const mirrorsd_kern::Path* path = mirrorsd_kern::select_path(why);
  return path ? mirrorsd_kern::prefetch_wanted(*path) : -1;
}

// MatMulNBits nodes packed in a super-block layout since the library was loaded (qgemm.hpp: SuperBlocks).
ORT_EXPORT size_t mirrorsd_kern_superblock_nodes() { return mirrorsd_kern::superblock_nodes(); }

// 1 when a 4-bit node of shape K x N with these float scales and zero points ([N * ceil(K/32)] each) would be packed
// in a super-block layout (by a path that has one), else 0: the kernel's own test (devices/kernels/superblocks.py).
ORT_EXPORT int mirrorsd_kern_superblock_form(int64_t K, int64_t N, const float* scales, const float* zero_points) {
  mirrorsd_kern::Shape shape;
  if (K <= 0 || N <= 0 || !scales || !zero_points) return 0;
  shape.K = K, shape.N = N, shape.kb = (K + mirrorsd_kern::kBlock - 1) / mirrorsd_kern::kBlock, shape.bits = 4;
  shape.offsets = true;
  mirrorsd_kern::SuperBlocks parts;
  return mirrorsd_kern::find_superblocks(shape, scales, zero_points, parts) ? 1 : 0;
}

ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace mirrorsd_kern;
  const OrtApi* api = api_base->GetApi(kOrtApiVersion);
  if (!api)  // the first API level is in every ONNX Runtime: enough to say why
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, "mirrorsd.kern needs ONNX Runtime 1.17 or newer");
  // one domain object per name for every session (ONNX Runtime keeps pointers to them; they live as long as the
  // library stays loaded, which ONNX Runtime ensures while a session uses it)
  static OrtCustomOpDomain* domains[2] = {nullptr, nullptr};
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  const char* names[2] = {kDomain, kOrtDomain};
  bool replace = false;
  if (OrtStatus* s = wants_replace(api, options, replace)) return s;
  const int count = replace ? 2 : 1;
  for (int i = 0; i < count; ++i) {
    if (!domains[i]) {
      if (OrtStatus* s = api->CreateCustomOpDomain(names[i], &domains[i])) return s;
      if (OrtStatus* s = api->CustomOpDomain_Add(domains[i], matmul_nbits_op())) return s;
      if (i == 0) {  // mirrorsd's own op, under its own domain only
        const OrtCustomOp* attention = float_op<GroupedAttentionOp, kGroupedAttention, 8, 3>();
        if (OrtStatus* s = api->CustomOpDomain_Add(domains[i], attention)) return s;
        // q, k, v, cos, sin, mask, then the views (one key and one value view per KV head)
        const OrtCustomOp* in_place = float_op<InPlaceAttentionOp, kInPlaceAttention, 7, 1, true>();
        if (OrtStatus* s = api->CustomOpDomain_Add(domains[i], in_place)) return s;
      }
    }
    if (OrtStatus* s = api->AddCustomOpDomain(options, domains[i])) return s;
  }
  return nullptr;
}

}  // extern "C"
