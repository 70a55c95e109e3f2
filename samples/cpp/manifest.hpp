// mirrorsd.json -> the few facts this sample needs: graph files, tensor names in graph order, KV templates.
// See docs/graphs.md: inputs are [first (input_ids or hidden_states), attention_mask, position_ids, past KV...],
// outputs are [main (hidden_states or logits), present KV...].
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.hpp"

namespace mirrorsd {

constexpr int64_t kSchemaVersion = 1;

struct KVInfo {
  std::string past_key, past_value, present_key, present_value;  // templates with one %d (global layer index)
  int first = 0, end = 0;                                       // layers [first, end)
  int64_t num_kv_heads = 0, head_dim = 0;

  static std::string fill(const std::string& tmpl, int layer) {
    size_t at = tmpl.find("%d");
    if (at == std::string::npos) throw std::runtime_error("KV template without %d: " + tmpl);
    return tmpl.substr(0, at) + std::to_string(layer) + tmpl.substr(at + 2);
  }
};

struct GraphInfo {
  std::string role;
  std::filesystem::path file;
  std::vector<std::string> inputs, outputs;  // in graph order
  KVInfo kv;
};

struct Manifest {
  GraphInfo prefix, suffix, draft;
  std::vector<int64_t> eos_token_ids;
  int64_t vocab_size = 0;
  int64_t context_limit = 0;  // min of the target's and the draft's max_position_embeddings
};

inline GraphInfo read_graph(const json::Value& graphs, const std::string& role, const std::filesystem::path& folder) {
  const json::Value& g = graphs.at(role);
  GraphInfo info;
  info.role = role;
  const std::string& file = g.at("file").as_string();
  if (file.empty() || file[0] == '/' || file[0] == '\\' || file.find("..") != std::string::npos)
    throw std::runtime_error("graph '" + role + "' names a file outside the folder: " + file);
  info.file = folder / file;
  for (const auto& t : g.at("inputs").items()) info.inputs.push_back(t.at("name").as_string());
  for (const auto& t : g.at("outputs").items()) info.outputs.push_back(t.at("name").as_string());
  if (info.inputs.size() < 3 || info.outputs.empty())
    throw std::runtime_error("graph '" + role + "' has too few inputs or outputs");
  const json::Value& kv = g.at("kv");
  if (kv.is_null()) throw std::runtime_error("graph '" + role + "' has no KV cache");
  info.kv.past_key = kv.at("past_key").as_string();
  info.kv.past_value = kv.at("past_value").as_string();
  info.kv.present_key = kv.at("present_key").as_string();
  info.kv.present_value = kv.at("present_value").as_string();
  info.kv.first = static_cast<int>(kv.at("layers")[0].as_int());
  info.kv.end = static_cast<int>(kv.at("layers")[1].as_int());
  info.kv.num_kv_heads = kv.at("num_kv_heads").as_int();
  info.kv.head_dim = kv.at("head_dim").as_int();
  return info;
}

inline Manifest load_manifest(const std::filesystem::path& folder) {
  std::ifstream in(folder / "mirrorsd.json", std::ios::binary);
  if (!in)
    throw std::runtime_error("no mirrorsd.json in " + folder.string() + " (export a model with mirrorsd-export)");
  std::stringstream text;
  text << in.rdbuf();
  json::Value root = json::parse(text.str());
  if (root.at("schema_version").as_int() != kSchemaVersion)
    throw std::runtime_error("mirrorsd.json has another schema version; re-export or update this sample");
  Manifest m;
  const json::Value& graphs = root.at("graphs");
  m.prefix = read_graph(graphs, "prefix", folder);
  m.suffix = read_graph(graphs, "suffix", folder);
  m.draft = read_graph(graphs, "draft", folder);
  for (const auto& id : root.at("tokenizer").at("eos_token_ids").items()) m.eos_token_ids.push_back(id.as_int());
  m.vocab_size = root.at("target").at("vocab_size").as_int();
  m.context_limit = std::min(root.at("target").at("max_position_embeddings").as_int(),
                             root.at("draft").at("max_position_embeddings").as_int());
  return m;
}

}  // namespace mirrorsd
