#include "ort.hpp"

#include <algorithm>
#include <mutex>
#include <set>

#include "devices.hpp"
#include "graph_files.hpp"

namespace mirrorsd {

const OrtApi& ort() {
  static const OrtApi* api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (api == nullptr)
    throw Error(Code::Device, "The ONNX Runtime library is older than this libmirrorsd's header",
                std::string("it does not offer C API version ") + std::to_string(ORT_API_VERSION) + " (it is " +
                    OrtGetApiBase()->GetVersionString() + ")",
                "link against onnxruntime 1." + std::to_string(ORT_API_VERSION) + " or newer");
  return *api;
}

void check(OrtStatus* status, Code code, const std::string& what, const std::string& fix) {
  if (status == nullptr) return;
  std::string message = ort().GetErrorMessage(status);
  ort().ReleaseStatus(status);
  throw Error(code, what, "ONNX Runtime: " + message.substr(0, 600), fix);
}

void ValueDeleter::operator()(OrtValue* v) const {
  if (v != nullptr) ort().ReleaseValue(v);
}

namespace {

const OrtMemoryInfo* cpu_memory() {
  static OrtMemoryInfo* info = [] {
    OrtMemoryInfo* out = nullptr;
    check(ort().CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &out), Code::Internal,
          "Could not describe host memory to ONNX Runtime", "");
    return out;
  }();
  return info;
}

template <typename T>
Value tensor(T* data, const std::vector<int64_t>& shape, ONNXTensorElementDataType type) {
  static T dummy{};  // ONNX Runtime wants a non-null pointer even for a tensor with no elements
  size_t count = 1;
  for (int64_t d : shape) count *= static_cast<size_t>(d);
  OrtValue* out = nullptr;
  check(ort().CreateTensorWithDataAsOrtValue(cpu_memory(), count ? data : &dummy, count * sizeof(T), shape.data(),
                                             shape.size(), type, &out),
        Code::Internal, "Could not wrap a host buffer as a tensor", "");
  return Value(out);
}

}  // namespace

Value float_tensor(float* data, const std::vector<int64_t>& shape) {
  return tensor(data, shape, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
}

Value int64_tensor(int64_t* data, const std::vector<int64_t>& shape) {
  return tensor(data, shape, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
}

std::vector<int64_t> shape_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(ort().GetTensorTypeAndShape(value, &info), Code::Runtime, "A graph returned something that is not a tensor",
        "re-export the folder");
  size_t rank = 0;
  OrtStatus* status = ort().GetDimensionsCount(info, &rank);
  std::vector<int64_t> shape(rank);
  if (status == nullptr) status = ort().GetDimensions(info, shape.data(), rank);
  ort().ReleaseTensorTypeAndShapeInfo(info);
  check(status, Code::Runtime, "Could not read a tensor's shape", "");
  return shape;
}

template <typename T>
static const T* data_of(const OrtValue* value) {
  void* out = nullptr;
  check(ort().GetTensorMutableData(const_cast<OrtValue*>(value), &out), Code::Runtime,
        "Could not read a graph output", "");
  return static_cast<const T*>(out);
}

const float* float_data(const OrtValue* value) { return data_of<float>(value); }
const int64_t* int64_data(const OrtValue* value) { return data_of<int64_t>(value); }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Timeline::busy() const {
  double total = 0;
  for (const auto& [a, b] : intervals) total += b - a;
  return total;
}

// mirrorsd's MatMulNBits kernels (devices/kernels) in replace mode, as devices/backends.py's OrtSession registers
// them: the config entry first (the library reads it when it registers), then the library. Only for graphs that import
// com.microsoft: registering the replacement claims that domain, and a graph that does not import it would then fail
// to load the contrib ops ONNX Runtime's optimizer fuses in.
namespace {

const char* const kReplaceKey = "mirrorsd_kern.replace_com_microsoft";  // kernels.REPLACE_KEY in Python
const char* const kOrtDomain = "com.microsoft";

bool register_kernels(OrtSessionOptions* options, const GraphSpec& spec, const std::string& library) {
  if (library.empty() || !imports_domain(spec.path, kOrtDomain)) return false;
  const std::string fix = "pass the path of libmirrorsd_kern.so (Python: mirrorsd.devices.kernels."
                          "usable_library().path), or none for ONNX Runtime's own kernel";
  check(ort().AddSessionConfigEntry(options, kReplaceKey, "1"), Code::Internal, "Bad option", "");
  check(ort().RegisterCustomOpsLibrary_V2(options, library.c_str()), Code::Device,
        "The kernels library '" + library + "' could not be registered for graph '" +
            spec.path.filename().string() + "'",
        fix);
  return true;
}

}  // namespace

class Environment {
 public:
  Environment() {
    check(ort().CreateEnv(ORT_LOGGING_LEVEL_ERROR, "mirrorsd", &env_), Code::Device,
          "ONNX Runtime could not start", "check the onnxruntime library libmirrorsd is linked against");
  }
  ~Environment() { ort().ReleaseEnv(env_); }
  OrtEnv* handle() { return env_; }
  std::mutex registration;  // EP library registration happens once per process

 private:
  OrtEnv* env_ = nullptr;
};

std::shared_ptr<Environment> environment() {
  static std::mutex lock;
  static std::weak_ptr<Environment> current;
  std::lock_guard<std::mutex> guard(lock);
  std::shared_ptr<Environment> env = current.lock();
  if (!env) current = env = std::make_shared<Environment>();
  return env;
}

OrtEnv* env_handle(Environment& env) { return env.handle(); }
std::mutex& registration_lock(Environment& env) { return env.registration; }

GraphSession::GraphSession(std::shared_ptr<Environment> env, const GraphSpec& spec, const DeviceRequest& request,
                           Timeline& timeline)
    : env_(std::move(env)), spec_(spec), timeline_(timeline) {
  const OrtApi& api = ort();
  OrtSessionOptions* options = nullptr;
  check(api.CreateSessionOptions(&options), Code::Internal, "Could not create session options", "");
  std::unique_ptr<OrtSessionOptions, void (*)(OrtSessionOptions*)> owned(
      options, [](OrtSessionOptions* o) { ort().ReleaseSessionOptions(o); });
  // The settings of devices/backends.py's OrtSession, so that the same graph gives the same bits here and there.
  check(api.SetIntraOpNumThreads(options, std::max(1, request.threads)), Code::Internal, "Bad thread count", "");
  check(api.SetInterOpNumThreads(options, 1), Code::Internal, "Bad thread count", "");
  check(api.SetSessionExecutionMode(options, ORT_SEQUENTIAL), Code::Internal, "Bad execution mode", "");
  check(api.SetSessionGraphOptimizationLevel(options, ORT_ENABLE_ALL), Code::Internal, "Bad optimization level", "");
  check(api.SetSessionLogSeverityLevel(options, 3), Code::Internal, "Bad log level", "");
  // Two sessions share the cores in Mirror-SD: spinning threads would steal the other session's core.
  check(api.AddSessionConfigEntry(options, "session.intra_op.allow_spinning", "0"), Code::Internal, "Bad option", "");
  provider_ = append_provider(options, *env_, request);
  if (provider_ == "CPUExecutionProvider")  // as Python: mirrorsd's kernels run on ONNX Runtime's CPU provider only
    mirrorsd_kernels_ = register_kernels(options, spec_, request.kernels_library);
  check(api.CreateSession(env_handle(*env_), spec_.path.c_str(), options, &session_), Code::GraphFile,
        "ONNX Runtime could not load '" + spec_.path.filename().string() + "'",
        "the file may be truncated or damaged: re-export the folder");
  OrtAllocator* allocator = nullptr;
  check(api.GetAllocatorWithDefaultOptions(&allocator), Code::Internal, "No default allocator", "");
  size_t count = 0;
  check(api.SessionGetInputCount(session_, &count), Code::GraphFile, "Could not read the graph's inputs", "");
  std::set<std::string> actual;
  for (size_t i = 0; i < count; ++i) {
    char* name = nullptr;
    check(api.SessionGetInputName(session_, i, allocator, &name), Code::GraphFile, "Could not read an input", "");
    actual.insert(name);
    check(api.AllocatorFree(allocator, name), Code::Internal, "Could not free a name", "");
  }
  for (const auto& t : spec_.inputs) {
    if (!actual.count(t.name)) {
      api.ReleaseSession(session_);
      session_ = nullptr;
      throw Error(Code::GraphFile, "Graph '" + spec_.path.filename().string() + "' lacks the input '" + t.name +
                                       "' that the manifest names",
                  "the ONNX file and mirrorsd.json do not belong together", "re-export the folder");
    }
  }
  for (const auto& t : spec_.inputs) input_names_.push_back(t.name.c_str());
  for (const auto& t : spec_.outputs) output_names_.push_back(t.name.c_str());
}

GraphSession::~GraphSession() {
  if (session_ != nullptr) ort().ReleaseSession(session_);
}

void GraphSession::run(const std::vector<OrtValue*>& inputs, std::vector<OrtValue*>& outputs) {
  if (inputs.size() != input_names_.size() || outputs.size() != output_names_.size())
    throw Error(Code::Internal, "A graph call was assembled with the wrong number of tensors", spec_.role, "");
  const double start = now_seconds();
  OrtStatus* status = ort().Run(session_, nullptr, input_names_.data(), inputs.data(), inputs.size(),
                                output_names_.data(), output_names_.size(), outputs.data());
  timeline_.intervals.emplace_back(start, now_seconds());
  check(status, Code::Runtime, "Graph '" + spec_.role + "' failed to run",
        "see ONNX Runtime's message; the device may be out of memory");
}

}  // namespace mirrorsd
