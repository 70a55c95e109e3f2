// Device strings -> ONNX Runtime execution providers, with the names of devices/placement.py where this library can
// honour them:
//   cpu (ort-cpu)        ONNX Runtime's CPU execution provider (always there)
//   cuda                 CUDAExecutionProvider, when the linked ONNX Runtime build has it
//   ort-openvino:CPU|GPU ONNX Runtime's OpenVINO execution provider: the built-in one of an OpenVINO build, else the
//                        OpenVINO plugin EP library (onnxruntime-ep-openvino) named in the open options
//   auto                 target: cuda -> cpu; draft: cpu
// Refused with a reason: openvino:DEV (the OpenVINO runtime itself is not linked), NPUs (they need the static draft,
// which only the Python runtime drives) and dml (DirectML's provider header is not vendored).
#pragma once

#include <string>
#include <vector>

#include "ort.hpp"

namespace mirrorsd {

std::vector<std::string> available_providers();  // what the linked ONNX Runtime build offers

int cores();            // the cores this process may run on (its affinity), as runtime/limits.py's cores()
int default_threads();  // intra-op threads per session when the caller passes 0: every core

// "auto" -> the first usable entry of the model's chain; other strings are returned as they are.
std::string resolve_device(const std::string& device, const std::string& model);

// Appends the execution provider for `request.device` (already resolved) to `options`; returns the provider name.
// Throws Error(Device) for a device this machine or build cannot honour, Error(InvalidArgument) for an unknown string.
std::string append_provider(OrtSessionOptions* options, Environment& env, const DeviceRequest& request);

}  // namespace mirrorsd
