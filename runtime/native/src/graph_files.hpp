#pragma once

#include "manifest.hpp"

namespace mirrorsd {

// Throws Error(GraphFile) when the graph's file is missing, not a readable ONNX protobuf, or names external data
// outside its folder (the check of runtime/graph_files.py, done before ONNX Runtime opens the file).
void check_graph_file(const GraphSpec& spec);

// Whether the ONNX file imports the operator domain `domain` (ModelProto.opset_import); reads the top-level fields
// only (devices/kernels/rewrite.py's imports_ort_domain). Throws Error(GraphFile) for a file that is not ONNX.
bool imports_domain(const std::filesystem::path& path, const std::string& domain);

}  // namespace mirrorsd
