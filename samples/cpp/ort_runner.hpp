// GraphRunner on an ONNX Runtime session (C++ API). The only file of the sample that needs onnxruntime headers.
#pragma once

#include <onnxruntime_cxx_api.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "decoding.hpp"

namespace mirrorsd {

class OrtRunner : public GraphRunner {
 public:
  OrtRunner(Ort::Env& env, const std::filesystem::path& file, int threads)
      : session_(env, file.c_str(), make_options(threads)) {}  // path::c_str() is ORTCHAR_T* on every platform

  Outputs run(const Feeds& feeds, const std::vector<std::string>& output_names) override {
    std::vector<const char*> in_names, out_names;
    std::vector<Ort::Value> values;
    values.reserve(feeds.size());
    for (const auto& [name, tensor] : feeds) {
      in_names.push_back(name.c_str());
      values.push_back(wrap(*tensor));
    }
    for (const auto& name : output_names) out_names.push_back(name.c_str());
    std::vector<Ort::Value> outs = session_.Run(Ort::RunOptions{nullptr}, in_names.data(), values.data(),
                                                values.size(), out_names.data(), out_names.size());
    Outputs result;
    for (size_t i = 0; i < outs.size(); ++i) result.emplace(output_names[i], unwrap(outs[i], output_names[i]));
    return result;
  }

 private:
  static Ort::SessionOptions make_options(int threads) {
    Ort::SessionOptions options;
    options.SetIntraOpNumThreads(threads);
    options.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
    return options;
  }

  // Wraps host memory without copying. ONNX Runtime does not write to inputs; the const_cast only satisfies
  // CreateTensor's signature. An empty tensor (a zero-length past) still gets a valid pointer.
  Ort::Value wrap(const HostTensor& t) {
    static float no_floats = 0;
    static int64_t no_ints = 0;
    if (t.is_float) {
      float* data = t.f32.empty() ? &no_floats : const_cast<float*>(t.f32.data());
      return Ort::Value::CreateTensor<float>(memory_, data, t.f32.size(), t.shape.data(), t.shape.size());
    }
    int64_t* data = t.i64.empty() ? &no_ints : const_cast<int64_t*>(t.i64.data());
    return Ort::Value::CreateTensor<int64_t>(memory_, data, t.i64.size(), t.shape.data(), t.shape.size());
  }

  static HostTensor unwrap(const Ort::Value& value, const std::string& name) {
    Ort::TensorTypeAndShapeInfo info = value.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> shape = info.GetShape();
    const size_t count = info.GetElementCount();
    switch (info.GetElementType()) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: {
        const float* p = value.GetTensorData<float>();
        return HostTensor::floats(shape, std::vector<float>(p, p + count));
      }
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: {
        const int64_t* p = value.GetTensorData<int64_t>();
        return HostTensor::ints(shape, std::vector<int64_t>(p, p + count));
      }
      default:
        throw std::runtime_error("output " + name + " is neither float32 nor int64 (this sample reads fp32 exports)");
    }
  }

  Ort::Session session_;
  Ort::MemoryInfo memory_ = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
};

}  // namespace mirrorsd
