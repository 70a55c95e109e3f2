// Refuse an ONNX graph whose tensors live outside its export folder, before ONNX Runtime opens it: the same scan as
// runtime/graph_files.py (read there why, and which protobuf field numbers it walks). An ONNX file may keep tensors in
// external files named by a `location` string, and ONNX Runtime reads whatever it names; a folder someone sent you
// could point one at a private file. The scan seeks over weight bytes, so it reads little of a large file.
#include "graph_files.hpp"

#include <fstream>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "manifest.hpp"

namespace fs = std::filesystem;

namespace mirrorsd {
namespace {

enum class Kind { Model, Training, Function, Graph, Node, Attribute, Sparse, Tensor };

// message kind -> (field number, kind of the embedded message) it may hold tensors in
const std::vector<std::pair<int, Kind>>& children(Kind kind) {
  static const std::vector<std::pair<int, Kind>> model{{7, Kind::Graph}, {20, Kind::Training}, {25, Kind::Function}},
      training{{1, Kind::Graph}, {2, Kind::Graph}}, function{{7, Kind::Node}},
      graph{{1, Kind::Node}, {5, Kind::Tensor}, {15, Kind::Sparse}}, node{{5, Kind::Attribute}},
      attribute{{5, Kind::Tensor}, {6, Kind::Graph}, {10, Kind::Tensor}, {11, Kind::Graph}, {22, Kind::Sparse},
                {23, Kind::Sparse}},
      sparse{{1, Kind::Tensor}, {2, Kind::Tensor}}, none{};
  switch (kind) {
    case Kind::Model: return model;
    case Kind::Training: return training;
    case Kind::Function: return function;
    case Kind::Graph: return graph;
    case Kind::Node: return node;
    case Kind::Attribute: return attribute;
    case Kind::Sparse: return sparse;
    default: return none;
  }
}

struct Malformed {
  std::string why;
};

struct Field {
  uint64_t number, wire, lo, hi;  // value bytes [lo, hi)
};

class Reader {
 public:
  explicit Reader(const fs::path& path) : in_(path, std::ios::binary) {
    if (!in_) throw Malformed{"it cannot be opened"};
    in_.seekg(0, std::ios::end);
    size_ = static_cast<uint64_t>(in_.tellg());
    if (size_ == 0) throw Malformed{"it is empty"};
  }
  uint64_t size() const { return size_; }

  // Every field of the message in [pos, end), in order.
  std::vector<Field> fields(uint64_t pos, uint64_t end) {
    std::vector<Field> out;
    while (pos < end) {
      const uint64_t key = varint(pos, end);
      Field f{key >> 3, key & 7, pos, pos};
      if (f.wire == 0) {
        varint(pos, end);
        f.hi = pos;
      } else if (f.wire == 1 || f.wire == 5) {
        f.hi = pos + (f.wire == 1 ? 8 : 4);
      } else if (f.wire == 2) {
        const uint64_t length = varint(pos, end);
        f.lo = pos;
        f.hi = pos + length;
        if (f.hi < pos) throw Malformed{"a length overflows at byte " + std::to_string(pos)};
      } else {  // 3 and 4 are protobuf groups, which ONNX never uses; 6 and 7 do not exist
        throw Malformed{"wire type " + std::to_string(f.wire) + " at byte " + std::to_string(pos)};
      }
      if (f.number == 0 || f.hi > end) throw Malformed{"a field runs past its message at byte " + std::to_string(pos)};
      out.push_back(f);
      pos = f.hi;
    }
    return out;
  }

  std::string text(const Field& f) {
    std::string s(f.hi - f.lo, '\0');
    in_.seekg(static_cast<std::streamoff>(f.lo));
    if (!s.empty() && !in_.read(&s[0], static_cast<std::streamsize>(s.size()))) throw Malformed{"a name is cut off"};
    return s;
  }

 private:
  uint64_t varint(uint64_t& pos, uint64_t end) {
    uint64_t value = 0;
    in_.seekg(static_cast<std::streamoff>(pos));
    for (int shift = 0; pos < end && shift < 64; shift += 7) {
      const int byte = in_.get();
      if (byte == EOF) break;
      ++pos;
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) return value;
    }
    throw Malformed{"a number breaks off at byte " + std::to_string(pos)};
  }

  std::ifstream in_;
  uint64_t size_ = 0;
};

// (tensor name, location) of a TensorProto: name 8, external_data 13 (StringStringEntryProto: key 1, value 2).
void tensor_locations(Reader& r, const Field& tensor, std::vector<std::pair<std::string, std::string>>& found) {
  std::string name;
  std::vector<std::string> locations;
  for (const Field& f : r.fields(tensor.lo, tensor.hi)) {
    if (f.wire != 2) continue;
    if (f.number == 8) name = r.text(f);
    if (f.number != 13) continue;
    std::string key, value;
    for (const Field& e : r.fields(f.lo, f.hi)) {
      if (e.wire == 2 && e.number == 1) key = r.text(e);
      if (e.wire == 2 && e.number == 2) value = r.text(e);
    }
    if (key == "location") locations.push_back(value);
  }
  for (auto& loc : locations) found.emplace_back(name, loc);
}

std::vector<std::pair<std::string, std::string>> external_locations(const fs::path& path) {
  Reader r(path);
  std::vector<std::pair<std::string, std::string>> found;
  std::vector<std::pair<Kind, Field>> stack{{Kind::Model, Field{0, 2, 0, r.size()}}};
  while (!stack.empty()) {  // an explicit stack: nesting depth is the file's to choose
    auto [kind, message] = stack.back();
    stack.pop_back();
    if (kind == Kind::Tensor) {
      tensor_locations(r, message, found);
      continue;
    }
    for (const Field& f : r.fields(message.lo, message.hi)) {
      if (f.wire != 2) continue;
      for (const auto& [number, child] : children(kind))
        if (static_cast<uint64_t>(number) == f.number) stack.emplace_back(child, f);
    }
  }
  return found;
}

}  // namespace

bool imports_domain(const fs::path& path, const std::string& domain) {
  try {
    Reader r(path);
    for (const Field& f : r.fields(0, r.size())) {
      if (f.wire != 2 || f.number != 8) continue;  // ModelProto.opset_import: OperatorSetIdProto { domain 1 }
      for (const Field& e : r.fields(f.lo, f.hi))
        if (e.wire == 2 && e.number == 1 && r.text(e) == domain) return true;
    }
  } catch (const Malformed& m) {
    throw Error(Code::GraphFile, "Graph file '" + path.filename().string() + "' is not a valid ONNX file",
                m.why + " (truncated or damaged)", "re-export the folder");
  }
  return false;
}

void check_graph_file(const GraphSpec& spec) {
  std::error_code ec;
  if (!fs::is_regular_file(spec.path, ec))
    throw Error(Code::GraphFile, "Graph file '" + spec.path.filename().string() + "' is missing from " +
                                     spec.path.parent_path().string(),
                "the folder is incomplete", "re-export the folder");
  std::vector<std::pair<std::string, std::string>> locations;
  try {
    locations = external_locations(spec.path);
  } catch (const Malformed& m) {
    throw Error(Code::GraphFile, "Graph file '" + spec.path.filename().string() + "' is not a valid ONNX file",
                m.why + " (truncated or damaged)", "re-export the folder");
  }
  for (const auto& [tensor, location] : locations) {
    try {
      check_inside(spec.path.parent_path(), location, "tensor '" + tensor + "'");
    } catch (const Error&) {
      throw Error(Code::GraphFile, "Graph '" + spec.path.filename().string() + "' reads tensor '" + tensor +
                                       "' from outside its folder: '" + location + "'",
                  "external data must stay beside its graph", "do not use this folder; re-export the model yourself");
    }
  }
}

}  // namespace mirrorsd
