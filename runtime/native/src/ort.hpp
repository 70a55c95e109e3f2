// The only file pair that talks to ONNX Runtime's C API: the environment, owned values, tensors over host memory, and
// one session per graph. Everything else sees GraphSession::run with OrtValue pointers in the manifest's order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "manifest.hpp"
#include "onnxruntime_c_api.h"

namespace mirrorsd {

const OrtApi& ort();  // the API table at ORT_API_VERSION; throws Error(Device) if the library is older

// Throws Error(code, what, ONNX Runtime's message, fix) when `status` is an error (and releases it).
void check(OrtStatus* status, Code code, const std::string& what, const std::string& fix);

struct ValueDeleter {
  void operator()(OrtValue* v) const;
};
using Value = std::unique_ptr<OrtValue, ValueDeleter>;

// A tensor that borrows host memory (no copy); the memory must outlive the value.
Value float_tensor(float* data, const std::vector<int64_t>& shape);
Value int64_tensor(int64_t* data, const std::vector<int64_t>& shape);
std::vector<int64_t> shape_of(const OrtValue* value);
const float* float_data(const OrtValue* value);
const int64_t* int64_data(const OrtValue* value);

// Busy intervals of one model's device, in seconds since an arbitrary origin; appended by the one thread running it.
struct Timeline {
  std::vector<std::pair<double, double>> intervals;
  double busy() const;
};
double now_seconds();

class Environment;  // the process-wide OrtEnv (one per process, shared by every model)
std::shared_ptr<Environment> environment();
OrtEnv* env_handle(Environment& env);
std::mutex& registration_lock(Environment& env);  // held while an EP library is registered

// How one model's graphs run: a device string (see mirrorsd.h) and intra-op threads.
struct DeviceRequest {
  std::string device = "auto";
  int threads = 1;
  std::string openvino_ep_library;
  std::string kernels_library;  // libmirrorsd_kern.so for every CPU session whose graph imports com.microsoft; "" = none
};

class GraphSession {
 public:
  GraphSession(std::shared_ptr<Environment> env, const GraphSpec& spec, const DeviceRequest& request,
               Timeline& timeline);
  ~GraphSession();
  GraphSession(const GraphSession&) = delete;
  GraphSession& operator=(const GraphSession&) = delete;

  // inputs: one value per manifest input, in order. outputs: one slot per manifest output; a non-null slot is a
  // preallocated tensor that ONNX Runtime writes into, a null slot receives a value ONNX Runtime allocates.
  void run(const std::vector<OrtValue*>& inputs, std::vector<OrtValue*>& outputs);

  const GraphSpec& spec() const { return spec_; }
  const std::string& provider() const { return provider_; }  // the execution provider it was opened on
  bool mirrorsd_kernels() const { return mirrorsd_kernels_; }  // its MatMulNBits nodes run kernels_library

 private:
  std::shared_ptr<Environment> env_;
  GraphSpec spec_;
  Timeline& timeline_;
  OrtSession* session_ = nullptr;
  std::string provider_;
  bool mirrorsd_kernels_ = false;
  std::vector<const char*> input_names_, output_names_;  // point into spec_
};

}  // namespace mirrorsd
