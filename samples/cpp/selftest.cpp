// Checks of the sample's parts that do not need ONNX Runtime: the JSON reader, the manifest reader, and the decode
// loop on fake graphs that follow docs/graphs.md's contract (present = past + new, masks over slots, logical
// positions, global layer indices). Speculative decoding must emit exactly the target-only tokens, and those must
// equal a recompute from scratch (so a KV rollback error cannot hide).
//
//   mirrorsd_selftest [EXPORT_FOLDER]      (with a folder: also read its mirrorsd.json and print a summary)
#include <cstdint>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "decoding.hpp"
#include "json.hpp"
#include "manifest.hpp"

using namespace mirrorsd;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL: " << what << "\n";
    ++failures;
  }
}

void test_json() {
  json::Value v = json::parse(R"( {"a": [1, -2.5e1, true, false, null], "s": "x\"\\\/\n\u00e9\ud83d\ude00",
                                  "o": {"k": {}}, "e": []} )");
  check(v.at("a")[0].as_int() == 1 && v.at("a")[1].as_number() == -25.0, "numbers");
  check(v.at("a")[2].as_bool() && !v.at("a")[3].as_bool() && v.at("a")[4].is_null(), "literals");
  check(v.at("s").as_string() == "x\"\\/\n\xC3\xA9\xF0\x9F\x98\x80", "escapes and surrogate pairs");
  check(v.at("o").at("k").members().empty() && v.at("e").items().empty(), "empty containers");
  check(!v.has("missing") && v.has("o"), "has()");
  for (const char* bad : {"{", "[1,]", "{\"a\" 1}", "\"\\ud800\"", "01x", "[1] 2", "\"a\nb\""}) {
    bool threw = false;
    try {
      json::parse(bad);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    check(threw, std::string("rejects ") + bad);
  }
}

// ---- fake graphs ------------------------------------------------------------------------------------------------
// Each layer stores one number per slot in two heads (head 1 = 2 x head 0, checked on every call, so a rollback
// that mixes up heads fails), head_dim 1. Prefix: stores token ids, outputs hidden = hash of
// the visible tokens. Suffix: stores hidden values, outputs one-hot logits at hash(visible hidden) % vocab. Whole
// (the draft): both in one graph with two layers, and wrong on purpose for about one token in four.
constexpr int64_t kVocab = 37;

int64_t fold(int64_t h, int64_t v) { return (h * 31 + v + 7) % 1000003; }

class FakeRunner : public GraphRunner {
 public:
  enum class Kind { Prefix, Suffix, Whole };
  FakeRunner(Kind kind, GraphInfo info) : kind_(kind), info_(std::move(info)) {}

  Outputs run(const Feeds& feeds, const std::vector<std::string>& output_names) override {
    const HostTensor& first = *feeds.at(0).second;
    const HostTensor& mask = *feeds.at(1).second;
    const HostTensor& pos = *feeds.at(2).second;
    const int64_t s = first.shape[1], total = mask.shape[1], past = total - s;
    Outputs out;
    std::vector<std::vector<float>> layers;  // per layer: past + new values, slot order
    for (size_t i = 3; i < feeds.size(); i += 2) {
      const HostTensor& k = *feeds[i].second;
      if (k.shape[1] != 2 || k.shape[2] != past) throw std::runtime_error("past shape disagrees with the mask");
      for (int64_t j = 0; j < past; ++j)
        if (k.f32[past + j] != 2 * k.f32[j]) throw std::runtime_error("KV heads out of step (bad rollback?)");
      layers.push_back(std::vector<float>(k.f32.begin(), k.f32.begin() + past));
    }
    std::vector<float> main(s * (kind_ == Kind::Prefix ? 1 : kVocab), 0.0f);
    for (int64_t i = 0; i < s; ++i) {
      int64_t logical = 0;
      for (int64_t j = 0; j < past + i; ++j) logical += mask.i64[j];
      if (pos.i64[i] != logical) throw std::runtime_error("position id is not the logical position");
      float x = first.is_float ? first.f32[i] : static_cast<float>(first.i64[i]);
      layers[0].push_back(x);
      int64_t h0 = visible_hash(layers[0], mask, past + i);
      if (kind_ == Kind::Prefix) {
        main[i] = static_cast<float>(h0 % 4096);
        continue;
      }
      int64_t h = h0;
      if (kind_ == Kind::Whole) {
        layers[1].push_back(static_cast<float>(h0 % 4096));
        h = visible_hash(layers[1], mask, past + i);
      }
      int64_t token = h % kVocab;
      if (kind_ == Kind::Whole && (h / kVocab) % 4 == 0) token = (token + 1) % kVocab;  // the draft errs
      main[i * kVocab + token] = 1.0f;
    }
    out[output_names[0]] = kind_ == Kind::Prefix ? HostTensor::floats({1, s, 1}, main)
                                                  : HostTensor::floats({1, s, kVocab}, main);
    for (size_t l = 0; l < layers.size(); ++l) {
      int64_t n = static_cast<int64_t>(layers[l].size());
      std::vector<float> heads = layers[l];
      for (float v : layers[l]) heads.push_back(2 * v);
      out[output_names[1 + 2 * l]] = HostTensor::floats({1, 2, n, 1}, heads);
      out[output_names[2 + 2 * l]] = HostTensor::floats({1, 2, n, 1}, heads);
    }
    return out;
  }

 private:
  static int64_t visible_hash(const std::vector<float>& values, const HostTensor& mask, int64_t query_slot) {
    int64_t h = 1;
    for (int64_t j = 0; j <= query_slot; ++j)
      if (mask.i64[j]) h = fold(h, static_cast<int64_t>(values[j]));
    return h;
  }

  Kind kind_;
  GraphInfo info_;
};

GraphInfo fake_info(const std::string& role, const std::string& first, const std::string& main, int l0, int l1) {
  GraphInfo g;
  g.role = role;
  g.kv = KVInfo{"past_key_values.%d.key", "past_key_values.%d.value", "present.%d.key", "present.%d.value",
                l0, l1, 2, 1};
  g.inputs = {first, "attention_mask", "position_ids"};
  g.outputs = {main};
  for (int l = l0; l < l1; ++l) {
    g.inputs.push_back(KVInfo::fill(g.kv.past_key, l));
    g.inputs.push_back(KVInfo::fill(g.kv.past_value, l));
    g.outputs.push_back(KVInfo::fill(g.kv.present_key, l));
    g.outputs.push_back(KVInfo::fill(g.kv.present_value, l));
  }
  return g;
}

Network fake_target() {
  Network n;
  GraphInfo prefix = fake_info("prefix", "input_ids", "hidden_states", 0, 1);
  GraphInfo suffix = fake_info("suffix", "hidden_states", "logits", 1, 2);  // global layer index 1
  n.add_stage(prefix, std::make_unique<FakeRunner>(FakeRunner::Kind::Prefix, prefix));
  n.add_stage(suffix, std::make_unique<FakeRunner>(FakeRunner::Kind::Suffix, suffix));
  return n;
}

std::vector<int64_t> recompute(const std::vector<int64_t>& prompt, int64_t new_tokens) {
  std::vector<int64_t> seq = prompt, out;
  for (int64_t i = 0; i < new_tokens; ++i) {
    Network fresh = fake_target();
    HostTensor logits = fresh.extend(seq);
    out.push_back(argmax_row(logits, logits.shape[1] - 1));
    seq.push_back(out.back());
  }
  return out;
}

void test_decode_loop() {
  Network target = fake_target();
  Network draft;
  GraphInfo whole = fake_info("draft", "input_ids", "logits", 0, 2);
  draft.add_stage(whole, std::make_unique<FakeRunner>(FakeRunner::Kind::Whole, whole));
  GreedyDrafter drafter(draft);
  const std::vector<std::vector<int64_t>> prompts = {{3}, {1, 2, 3, 4, 5}, {30, 0, 7, 7, 7, 12}};
  for (const auto& prompt : prompts) {
    DecodeSettings settings{40, 4, {}, 1 << 20};
    DecodeResult ar = decode(target, nullptr, prompt, settings);
    check(ar.tokens == recompute(prompt, 40), "cached AR equals recompute");
    for (int gamma : {1, 2, 4, 7}) {
      settings.gamma = gamma;
      DecodeResult sd = decode(target, &drafter, prompt, settings);
      check(sd.tokens == ar.tokens, "SD equals AR at gamma " + std::to_string(gamma));
      check(sd.accepted > 0 && sd.accepted < sd.drafted, "the fake draft is sometimes right, sometimes wrong");
      check(sd.steps < static_cast<int64_t>(ar.tokens.size()), "SD takes fewer target steps");
    }
    settings.eos_token_ids = {ar.tokens[9]};  // stop at the tenth token's value, wherever it first appears
    settings.gamma = 4;
    DecodeResult stop = decode(target, &drafter, prompt, settings);
    size_t first = 0;
    while (ar.tokens[first] != ar.tokens[9]) ++first;
    check(stop.tokens == std::vector<int64_t>(ar.tokens.begin(), ar.tokens.begin() + first + 1), "stops at EOS");
  }
}

void summarize(const std::filesystem::path& folder) {
  Manifest m = load_manifest(folder);
  for (const GraphInfo* g : {&m.prefix, &m.suffix, &m.draft}) {
    std::cout << g->role << ": " << g->file.filename().string() << ", " << g->inputs.size() << " inputs, "
              << g->outputs.size() << " outputs, layers [" << g->kv.first << ", " << g->kv.end << "), first input "
              << g->inputs[0] << ", first output " << g->outputs[0] << "\n";
  }
  std::cout << "vocab " << m.vocab_size << ", context " << m.context_limit << ", eos";
  for (int64_t e : m.eos_token_ids) std::cout << ' ' << e;
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    test_json();
    test_decode_loop();
    if (argc > 1) summarize(argv[1]);
  } catch (const std::exception& e) {
    std::cerr << "FAIL: exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "selftest passed\n";
  return 0;
}
