// mirrorsd.json -> what the decode loop needs: per graph its file, tensor names in graph order and KV layout.
// Mirrors mirrorsd/manifest.py (schema version 1); docs/graphs.md is the contract:
//   inputs  = [first (input_ids | hidden_states), attention_mask, position_ids, past KV (key, value per layer)]
//   outputs = [main (hidden_states | logits | topk_ids), (topk_logprobs,) present KV (key, value per layer)]
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace mirrorsd {

constexpr int64_t kSchemaVersion = 1;
constexpr const char* kManifestFile = "mirrorsd.json";

struct TensorSpec {
  std::string name;
  std::string dtype;
};

struct KVSpec {
  int first = 0, end = 0;  // global layer indices [first, end)
  int64_t num_kv_heads = 0, head_dim = 0;
  std::vector<std::string> past_names;     // key, value interleaved, layer by layer (graph order)
  std::vector<std::string> present_names;  // same order
  int layers() const { return end - first; }
};

struct GraphSpec {
  std::string role;
  std::string model;  // "target" or "draft"
  std::filesystem::path path;  // checked: inside the export folder
  std::vector<TensorSpec> inputs, outputs;
  bool has_kv = false;
  KVSpec kv;
  std::vector<std::string> input_names() const;
  std::vector<std::string> output_names() const;
};

struct ModelInfo {
  int64_t num_layers = 0, vocab_size = 0, max_position_embeddings = 0;
};

struct Manifest {
  std::filesystem::path folder;
  ModelInfo target, draft;
  int64_t exit_layer = 0, top_k = 0;
  std::map<std::string, GraphSpec> graphs;  // prefix, exit_head, suffix, draft (+ optional ones, unused here)
  std::vector<int64_t> eos_token_ids;

  const GraphSpec& graph(const std::string& role) const;
  int64_t context_limit() const;  // min of the two models' max_position_embeddings
};

// Reads and checks <folder>/mirrorsd.json; throws Error(Manifest) with what/why/fix on any problem.
Manifest load_manifest(const std::filesystem::path& folder);

// A file name from the manifest, refused when absolute or leaving `folder` (also through symbolic links).
std::filesystem::path check_inside(const std::filesystem::path& folder, const std::string& relative,
                                   const std::string& what);

// "past_key_values.%d.key" with 3 -> "past_key_values.3.key" (Python's `template % layer`).
std::string fill_template(const std::string& tmpl, int layer);

}  // namespace mirrorsd
