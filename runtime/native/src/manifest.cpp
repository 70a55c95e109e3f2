#include "manifest.hpp"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "errors.hpp"
#include "json.hpp"

namespace fs = std::filesystem;

namespace mirrorsd {
namespace {

const char* const kReexport = "re-export the folder with mirrorsd-export";
const char* const kRequiredRoles[] = {"prefix", "exit_head", "suffix", "draft"};

[[noreturn]] void damaged(const std::string& where, const std::string& why) {
  throw Error(Code::Manifest, "mirrorsd.json is not usable at " + where, why, kReexport);
}

const json::Value& need(const json::Value& object, const std::string& key, const std::string& where) {
  if (object.kind() != json::Value::Kind::Object) damaged(where, "it should be a JSON object");
  if (!object.has(key)) throw Error(Code::Manifest, "Missing key '" + key + "' in " + where, "the manifest is incomplete",
                                    kReexport);
  return object.at(key);
}

// Runs a JSON accessor, turning its type error into a manifest error that names the place.
template <typename F>
auto typed(const std::string& where, F read) -> decltype(read()) {
  try {
    return read();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    damaged(where, e.what());
  }
}

int64_t integer(const json::Value& object, const std::string& key, const std::string& where) {
  const json::Value& v = need(object, key, where);
  return typed(where + "." + key, [&] { return v.as_int(); });
}

std::string text(const json::Value& object, const std::string& key, const std::string& where) {
  const json::Value& v = need(object, key, where);
  return typed(where + "." + key, [&] { return v.as_string(); });
}

std::vector<TensorSpec> tensors(const json::Value& graph, const std::string& key, const std::string& where) {
  std::vector<TensorSpec> out;
  const json::Value& list = need(graph, key, where);
  const auto& items = typed(where + "." + key, [&]() -> const std::vector<json::Value>& { return list.items(); });
  for (size_t i = 0; i < items.size(); ++i) {
    std::string at = where + "." + key + "[" + std::to_string(i) + "]";
    out.push_back({text(items[i], "name", at), text(items[i], "dtype", at)});
  }
  return out;
}

void expect_dtype(const TensorSpec& t, const std::string& dtype, const std::string& role) {
  if (t.dtype != dtype)
    throw Error(Code::Manifest, "Graph '" + role + "' declares " + t.name + " as " + t.dtype,
                "libmirrorsd drives the graph contract of docs/graphs.md, where it is " + dtype, kReexport);
}

// Checks the order of docs/graphs.md: first, attention_mask, position_ids, then past KV as the templates name it.
void check_io(const GraphSpec& g, const std::string& first_dtype) {
  const size_t kv_pairs = g.has_kv ? static_cast<size_t>(2 * g.kv.layers()) : 0;
  const size_t main_outputs = g.role == "exit_head" ? 2 : 1;
  if (g.inputs.size() != (g.has_kv ? 3 + kv_pairs : 1) || g.outputs.size() != main_outputs + kv_pairs)
    throw Error(Code::Manifest, "Graph '" + g.role + "' has " + std::to_string(g.inputs.size()) + " inputs and " +
                                    std::to_string(g.outputs.size()) + " outputs",
                "its KV layer range implies another count (docs/graphs.md)", kReexport);
  expect_dtype(g.inputs[0], first_dtype, g.role);
  for (size_t i = 0; i < kv_pairs; ++i) {
    if (g.inputs[3 + i].name != g.kv.past_names[i] || g.outputs[main_outputs + i].name != g.kv.present_names[i])
      throw Error(Code::Manifest, "Graph '" + g.role + "' lists KV tensors out of the templates' order",
                  "expected " + g.kv.past_names[i] + " / " + g.kv.present_names[i], kReexport);
    expect_dtype(g.inputs[3 + i], "float32", g.role);
  }
  if (g.has_kv) {
    expect_dtype(g.inputs[1], "int64", g.role);
    expect_dtype(g.inputs[2], "int64", g.role);
  }
  if (g.role == "exit_head") {
    expect_dtype(g.outputs[0], "int64", g.role);
    expect_dtype(g.outputs[1], "float32", g.role);
  } else {
    expect_dtype(g.outputs[0], "float32", g.role);
  }
}

KVSpec read_kv(const json::Value& kv, const std::string& where) {
  KVSpec spec;
  const json::Value& layers = need(kv, "layers", where);
  typed(where + ".layers", [&] {
    spec.first = static_cast<int>(layers[0].as_int());
    spec.end = static_cast<int>(layers[1].as_int());
    return 0;
  });
  spec.num_kv_heads = integer(kv, "num_kv_heads", where);
  spec.head_dim = integer(kv, "head_dim", where);
  if (spec.end <= spec.first || spec.first < 0 || spec.num_kv_heads < 1 || spec.head_dim < 1)
    damaged(where, "its layer range or KV shape is empty");
  if (text(kv, "dtype", where) != "float32") damaged(where + ".dtype", "libmirrorsd keeps float32 KV caches only");
  const std::string templates[4] = {text(kv, "past_key", where), text(kv, "past_value", where),
                                    text(kv, "present_key", where), text(kv, "present_value", where)};
  for (int layer = spec.first; layer < spec.end; ++layer) {
    spec.past_names.push_back(fill_template(templates[0], layer));
    spec.past_names.push_back(fill_template(templates[1], layer));
    spec.present_names.push_back(fill_template(templates[2], layer));
    spec.present_names.push_back(fill_template(templates[3], layer));
  }
  return spec;
}

GraphSpec read_graph(const json::Value& graphs, const std::string& role, const fs::path& folder) {
  const std::string where = "graphs." + role;
  const json::Value& g = need(graphs, role, "graphs");
  GraphSpec spec;
  spec.role = role;
  spec.model = text(g, "model", where);
  spec.path = check_inside(folder, text(g, "file", where), "graph '" + role + "'");
  spec.inputs = tensors(g, "inputs", where);
  spec.outputs = tensors(g, "outputs", where);
  const json::Value& kv = need(g, "kv", where);
  spec.has_kv = !kv.is_null();
  if (spec.has_kv) spec.kv = read_kv(kv, where + ".kv");
  const bool needs_kv = role != "exit_head";
  if (spec.has_kv != needs_kv) damaged(where + ".kv", needs_kv ? "this graph must have a KV cache" : "it must be null");
  check_io(spec, role == "prefix" || role == "draft" ? "int64" : "float32");
  return spec;
}

ModelInfo read_model(const json::Value& root, const std::string& key) {
  const json::Value& m = need(root, key, "manifest");
  ModelInfo info{integer(m, "num_layers", key), integer(m, "vocab_size", key),
                 integer(m, "max_position_embeddings", key)};
  if (info.num_layers < 1 || info.vocab_size < 2 || info.max_position_embeddings < 2)
    damaged(key, "its layer count, vocabulary or context is too small");
  return info;
}

json::Value parse_file(const fs::path& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec))
    throw Error(Code::Manifest, "'" + folder.string() + "' is not a folder",
                "an export folder holds mirrorsd.json and ONNX graphs", "pass the --output folder of mirrorsd-export");
  const fs::path path = folder / kManifestFile;
  std::ifstream in(path, std::ios::binary);
  if (!fs::is_regular_file(path, ec) || !in) {
    const std::string name = (folder.filename().empty() ? folder.parent_path() : folder).filename().string();
    if (fs::is_regular_file(folder / "config.json", ec))  // a model folder: export it into a new folder
      throw Error(Code::Manifest, "'" + folder.string() + "' has no " + kManifestFile,
                  "it is a Hugging Face model folder, not an export",
                  "export it first: mirrorsd-export --model " + folder.string() + " --output exports/" + name +
                      ", then open exports/" + name);
    throw Error(Code::Manifest, "'" + folder.string() + "' has no " + kManifestFile,
                "it is not a mirrorsd export folder",
                "pass an export folder (mirrorsd-export --model MODEL --output NEW_FOLDER writes one)");
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  try {
    return json::parse(buffer.str());
  } catch (const std::exception& e) {
    throw Error(Code::Manifest, path.string() + " is not valid JSON", e.what(), kReexport);
  }
}

}  // namespace

std::vector<std::string> GraphSpec::input_names() const {
  std::vector<std::string> out;
  for (const auto& t : inputs) out.push_back(t.name);
  return out;
}

std::vector<std::string> GraphSpec::output_names() const {
  std::vector<std::string> out;
  for (const auto& t : outputs) out.push_back(t.name);
  return out;
}

const GraphSpec& Manifest::graph(const std::string& role) const {
  auto it = graphs.find(role);
  if (it == graphs.end()) throw Error(Code::Manifest, "The manifest has no '" + role + "' graph", "", kReexport);
  return it->second;
}

int64_t Manifest::context_limit() const {
  return std::min(target.max_position_embeddings, draft.max_position_embeddings);
}

std::string fill_template(const std::string& tmpl, int layer) {
  const size_t at = tmpl.find("%d");
  if (at == std::string::npos || tmpl.find('%', at + 2) != std::string::npos)
    throw Error(Code::Manifest, "The KV name template '" + tmpl + "' is not usable",
                "it must hold exactly one %d (the global layer index)", kReexport);
  return tmpl.substr(0, at) + std::to_string(layer) + tmpl.substr(at + 2);
}

fs::path check_inside(const fs::path& folder, const std::string& relative, const std::string& what) {
  std::string posix = relative;
  std::replace(posix.begin(), posix.end(), '\\', '/');
  const fs::path pure(posix);
  bool climbs = false;
  for (const auto& part : pure) climbs = climbs || part == "..";
  if (relative.empty() || posix[0] == '/' || (relative.size() > 1 && relative[1] == ':') || climbs)
    throw Error(Code::Manifest, "The manifest's " + what + " points outside the export folder: '" + relative + "'",
                "file names must be relative and stay inside the folder",
                "do not use this folder; re-export the model yourself");
  std::error_code ec;
  const fs::path base = fs::weakly_canonical(folder, ec);
  const fs::path resolved = fs::weakly_canonical(folder / pure, ec);
  auto mismatch = std::mismatch(base.begin(), base.end(), resolved.begin(), resolved.end());
  if (ec || mismatch.first != base.end())
    throw Error(Code::Manifest, "The manifest's " + what + " resolves outside the export folder: " + resolved.string(),
                "a symbolic link leads out of the folder", "re-export the model into a fresh folder");
  return resolved;
}

Manifest load_manifest(const fs::path& folder) {
  const json::Value root = parse_file(folder);
  if (root.kind() != json::Value::Kind::Object) damaged("the top level", "it does not hold a JSON object");
  const json::Value& version = need(root, "schema_version", "manifest");
  if (version.kind() != json::Value::Kind::Number || version.as_number() != kSchemaVersion)
    throw Error(Code::Manifest, (folder / kManifestFile).string() + " has another schema version",
                "this libmirrorsd reads version " + std::to_string(kSchemaVersion) + " only",
                "re-export the model with the mirrorsd that matches this library");
  Manifest m;
  m.folder = folder;
  m.target = read_model(root, "target");
  m.draft = read_model(root, "draft");
  m.exit_layer = integer(root, "exit_layer", "manifest");
  m.top_k = integer(root, "top_k", "manifest");
  const json::Value& graphs = need(root, "graphs", "manifest");
  for (const char* role : kRequiredRoles) m.graphs[role] = read_graph(graphs, role, folder);
  const json::Value& eos = need(need(root, "tokenizer", "manifest"), "eos_token_ids", "tokenizer");
  typed("tokenizer.eos_token_ids", [&] {
    for (const auto& id : eos.items()) m.eos_token_ids.push_back(id.as_int());
    return 0;
  });
  const KVSpec &pre = m.graphs["prefix"].kv, &suf = m.graphs["suffix"].kv, &dr = m.graphs["draft"].kv;
  if (pre.first != 0 || pre.end != m.exit_layer || suf.first != m.exit_layer || suf.end != m.target.num_layers ||
      dr.first != 0 || dr.end != m.draft.num_layers)
    damaged("graphs.*.kv.layers", "the prefix, suffix and draft layer ranges do not match exit_layer and the models");
  return m;
}

}  // namespace mirrorsd
