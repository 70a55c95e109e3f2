#include "devices.hpp"

#include <algorithm>
#include <cctype>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace mirrorsd {
namespace {

const char* const kOpenVINO = "OpenVINOExecutionProvider";
const char* const kPluginRegistration = "mirrorsd_openvino_plugin";  // the name devices/probe.py registers it under
const char* const kSyntax = "auto, cpu, cuda, ort-openvino:CPU, ort-openvino:GPU";

bool has_provider(const std::string& name) {
  const auto all = available_providers();
  return std::find(all.begin(), all.end(), name) != all.end();
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return s;
}

std::string append_cuda(OrtSessionOptions* options) {
  if (!has_provider("CUDAExecutionProvider"))
    throw Error(Code::Device, "This ONNX Runtime build has no CUDAExecutionProvider",
                "libmirrorsd uses the execution providers of the library it is linked against (here: " +
                    joined(available_providers()) + ")",
                "link against a CUDA build of ONNX Runtime (e.g. the onnxruntime-gpu wheel's library), or use cpu");
  OrtCUDAProviderOptionsV2* cuda = nullptr;
  check(ort().CreateCUDAProviderOptions(&cuda), Code::Device, "Could not set up the CUDA execution provider", "");
  OrtStatus* status = ort().SessionOptionsAppendExecutionProvider_CUDA_V2(options, cuda);
  ort().ReleaseCUDAProviderOptions(cuda);
  check(status, Code::Device, "The CUDA execution provider could not be used", "check the GPU and its driver");
  return "CUDAExecutionProvider";
}

// The OpenVINO plugin EP (a library registered with the environment), on the device of `kind`.
std::string append_openvino_plugin(OrtSessionOptions* options, Environment& env, const std::string& kind,
                                   const std::string& library) {
  if (library.empty())
    throw Error(Code::Device, "This ONNX Runtime build has no OpenVINO execution provider",
                "it is neither built in (available: " + joined(available_providers()) +
                    ") nor given as a plugin library",
                "set openvino_ep_library to the OpenVINO plugin EP library (Python: "
                "onnxruntime_ep_openvino.get_library_path()), or use cpu");
  {
    std::lock_guard<std::mutex> guard(registration_lock(env));
    OrtStatus* status = ort().RegisterExecutionProviderLibrary(env_handle(env), kPluginRegistration, library.c_str());
    if (status != nullptr) {
      std::string message = ort().GetErrorMessage(status);
      ort().ReleaseStatus(status);
      if (message.find("already registered") == std::string::npos)
        throw Error(Code::Device, "The OpenVINO plugin EP library could not be registered: " + library,
                    "ONNX Runtime: " + message.substr(0, 400), "check the path and the plugin's version");
    }
  }
  const OrtHardwareDeviceType wanted = kind == "GPU" ? OrtHardwareDeviceType_GPU : OrtHardwareDeviceType_CPU;
  const OrtEpDevice* const* devices = nullptr;
  size_t count = 0;
  check(ort().GetEpDevices(env_handle(env), &devices, &count), Code::Device, "Could not list the EP devices", "");
  for (size_t i = 0; i < count; ++i) {
    if (std::string(ort().EpDevice_EpName(devices[i])) != kOpenVINO ||
        ort().HardwareDevice_Type(ort().EpDevice_Device(devices[i])) != wanted)
      continue;
    const std::string config = "{\"" + kind + "\": {\"INFERENCE_PRECISION_HINT\": \"f32\"}}";  // as backends.py
    const char* keys[] = {"device_type", "load_config"};
    const char* values[] = {kind.c_str(), config.c_str()};
    check(ort().SessionOptionsAppendExecutionProvider_V2(options, env_handle(env), &devices[i], 1, keys, values, 2),
          Code::Device, "The OpenVINO plugin EP refused the " + kind + " device", "");
    return std::string(kOpenVINO) + ":" + kind;
  }
  throw Error(Code::Device, "The OpenVINO plugin EP offers no " + kind + " device",
              "it sees only Intel hardware", "use cpu on this machine");
}

std::string append_openvino(OrtSessionOptions* options, Environment& env, const std::string& kind,
                            const std::string& library) {
  if (kind == "NPU")
    throw Error(Code::Device, "libmirrorsd does not drive NPUs",
                "NPUs compile fixed shapes only and need the static draft (draft_static.onnx), which only the Python "
                "runtime drives",
                "use the Python runtime (mirrorsd generate --draft-device openvino:NPU), or a CPU or GPU here");
  if (kind != "CPU" && kind != "GPU")
    throw Error(Code::InvalidArgument, "Unknown OpenVINO device '" + kind + "'", "it is CPU or GPU", "pick one");
  if (!has_provider(kOpenVINO)) return append_openvino_plugin(options, env, kind, library);
  const char* keys[] = {"device_type"};
  const char* values[] = {kind.c_str()};
  check(ort().SessionOptionsAppendExecutionProvider(options, "OpenVINO", keys, values, 1), Code::Device,
        "The OpenVINO execution provider refused the " + kind + " device", "use cpu");
  return std::string(kOpenVINO) + ":" + kind;
}

}  // namespace

int cores() {
#if defined(__linux__)
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof mask, &mask) == 0) return std::max(1, CPU_COUNT(&mask));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// Every core for each session, as devices/backends.py's default_threads (os.cpu_count()): ar and sd run one session
// at a time, and Mirror-SD's two sessions share the cores with spinning off (docs/performance.md).
int default_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

std::vector<std::string> available_providers() {
  char** names = nullptr;
  int count = 0;
  check(ort().GetAvailableProviders(&names, &count), Code::Device, "Could not list ONNX Runtime's providers", "");
  std::vector<std::string> out(names, names + count);
  check(ort().ReleaseAvailableProviders(names, count), Code::Internal, "Could not release the provider list", "");
  return out;
}

std::string resolve_device(const std::string& device, const std::string& model) {
  if (!device.empty() && device != "auto") return device;
  return model == "target" && has_provider("CUDAExecutionProvider") ? "cuda" : "cpu";
}

std::string append_provider(OrtSessionOptions* options, Environment& env, const DeviceRequest& request) {
  const std::string& device = request.device;
  if (device == "cpu" || device == "ort-cpu") return "CPUExecutionProvider";
  if (device == "cuda") return append_cuda(options);
  const std::string prefix = "ort-openvino:";
  if (device.compare(0, prefix.size(), prefix) == 0)
    return append_openvino(options, env, upper(device.substr(prefix.size())), request.openvino_ep_library);
  if (device.compare(0, 9, "openvino:") == 0)
    throw Error(Code::Device, "'" + device + "' names the OpenVINO runtime itself, which libmirrorsd does not link",
                "libmirrorsd runs every graph through ONNX Runtime",
                "use ort-openvino:" + device.substr(9) + " (ONNX Runtime's OpenVINO execution provider)");
  if (device == "dml")
    throw Error(Code::Device, "libmirrorsd does not drive DirectML",
                "DirectML's provider header (dml_provider_factory.h) is not vendored", "use cpu or cuda");
  throw Error(Code::InvalidArgument, "Unknown device '" + device + "'", std::string("devices are ") + kSyntax,
              "pick one of those");
}

}  // namespace mirrorsd
