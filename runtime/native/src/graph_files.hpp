#pragma once

#include "manifest.hpp"

namespace mirrorsd {

// Throws Error(GraphFile) when the graph's file is missing, not a readable ONNX protobuf, or names external data
// outside its folder (the check of runtime/graph_files.py, done before ONNX Runtime opens the file).
void check_graph_file(const GraphSpec& spec);

}  // namespace mirrorsd
