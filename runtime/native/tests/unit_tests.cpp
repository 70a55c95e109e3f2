// Unit checks of libmirrorsd's pure parts: the JSON reader, greedy verification, top-k, branch ranking (the formula of
// runtime/verify.py's rank_branches, worked by hand) and the KV cache's bookkeeping (truncate, tile, adopt), which
// must keep every (row, head) block in place. tests/test_native.py builds and runs this program.
#include <cmath>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "json.hpp"
#include "kv_cache.hpp"
#include "verify.hpp"

using namespace mirrorsd;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL: " << what << "\n";
    ++failures;
  }
}

bool near(double a, double b) { return std::fabs(a - b) < 1e-6; }

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

void test_verify() {
  struct Case {
    std::vector<int64_t> window, target;
    int accepted;
    int64_t correction;
  };
  const Case cases[] = {{{5, 6, 7}, {5, 6, 7, 8}, 3, 8},  // all accepted: the bonus
                        {{5, 6, 7}, {5, 9, 7, 8}, 1, 9},  // rejected at the second token
                        {{5}, {6, 5}, 0, 6},             // rejected at once
                        {{}, {4}, 0, 4}};                // no window (ar)
  for (const Case& c : cases) {
    const Verdict v = verify_greedy(c.window, c.target);
    check(v.accepted == c.accepted && v.correction == c.correction, "verify_greedy scenario");
    check(v.bonus() == (c.accepted == static_cast<int>(c.window.size())), "bonus flag");
    check(v.branch() == std::make_pair(c.accepted + 1, c.correction), "branch key (A + 1, c)");
  }
  const float tied[] = {0.5f, 2.0f, 2.0f, -1.0f};
  check(argmax(tied, 4) == 1, "argmax takes the first index on exact ties");
  int64_t ids[2];
  float lps[2];
  top_k_logprobs(tied, 1, 4, 2, ids, lps);
  const double norm = std::log(std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0));
  check(ids[0] == 1 && ids[1] == 2 && near(lps[0], 2.0 - norm) && near(lps[1], 2.0 - norm), "top-k log-probs");
}

void test_rank_branches() {
  // window w1 = 10, w2 = 11; the draft's candidates at d = 1, 2, 3 (row 2 = after the window), a = 0.7
  const std::vector<int64_t> window{10, 11};
  const int64_t ids[] = {10, 20, 11, 21, 30, 31};
  const float lps[] = {std::log(0.9f), std::log(0.05f), std::log(0.8f), std::log(0.1f), std::log(0.6f),
                       std::log(0.3f)};
  const Candidates draft{ids, lps, 2};
  // score(1, 20) = (1 - a) 0.05 / (1 - 0.9) = 0.15; score(2, 21) = a (1 - a) 0.1 / 0.2 = 0.105;
  // score(3, 30) = a^2 0.6 = 0.294; score(3, 31) = a^2 0.3 = 0.147; drafted tokens (1, 10), (2, 11) never appear
  std::vector<Branch> ranked = rank_branches(window, draft, nullptr, 0.7, {}, 10);
  check(ranked.size() == 4, "four candidate branches");
  const std::pair<int, int64_t> order[] = {{3, 30}, {1, 20}, {3, 31}, {2, 21}};
  const double scores[] = {0.294, 0.15, 0.147, 0.105};
  for (size_t i = 0; i < ranked.size() && i < 4; ++i)
    check(ranked[i].depth == order[i].first && ranked[i].token == order[i].second && near(ranked[i].score, scores[i]),
          "rank " + std::to_string(i));
  ranked = rank_branches(window, draft, nullptr, 0.7, {{3, 30}}, 2);
  check(ranked.size() == 2 && ranked[0].token == 20 && ranked[1].token == 31, "exclude and limit");
  // a second source (the exit head) is averaged in: it lists 20 at d = 1 with p = 0.5 and nothing else we know
  const int64_t exit_ids[] = {20, 99, 98, 97, 96, 95};
  const float exit_lps[] = {std::log(0.5f), -50, -50, -50, -50, -50};
  const Candidates exit{exit_ids, exit_lps, 2};
  ranked = rank_branches(window, draft, &exit, 0.7, {}, 1);
  // q1(20) = (0.05 + 0.5) / 2, q1(10) = 0.9 / 2: score = 0.3 * 0.275 / 0.55 = 0.15; (3, 30): 0.49 * 0.3 = 0.147
  check(ranked.size() == 1 && ranked[0].depth == 1 && ranked[0].token == 20 && near(ranked[0].score, 0.15),
        "exit candidates are averaged with the draft's");
}

// A one-layer cache with 2 heads of width 1; slot s of head h holds 100 h + s (+ 1000 r in row r).
std::vector<float> read(KVCache& cache, size_t tensor = 0) {
  std::vector<Value> owned;
  std::vector<OrtValue*> past;
  cache.add_past(owned, past);
  const float* data = float_data(past[tensor]);
  return std::vector<float>(data, data + cache.batch() * 2 * cache.length());
}

void append(KVCache& cache, int64_t slots) {
  std::vector<Value> owned;
  std::vector<OrtValue*> outputs{nullptr};
  const std::vector<float> old = read(cache);
  const int64_t total = cache.length() + slots;
  cache.add_presents(slots, owned, outputs);
  for (size_t t = 1; t < outputs.size(); ++t) {  // what a graph writes: past + new, per (row, head)
    float* present = const_cast<float*>(float_data(outputs[t]));
    for (int64_t r = 0; r < cache.batch(); ++r)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t s = 0; s < total; ++s)
          present[(r * 2 + h) * total + s] = s < cache.length() ? old[(r * 2 + h) * cache.length() + s]
                                                                : static_cast<float>(1000 * r + 100 * h + s);
  }
  cache.commit(slots);
}

void test_kv_cache() {
  KVSpec spec;
  spec.first = 0, spec.end = 1, spec.num_kv_heads = 2, spec.head_dim = 1;
  spec.past_names = {"past_key_values.0.key", "past_key_values.0.value"};
  spec.present_names = {"present.0.key", "present.0.value"};
  KVCache cache(spec, 1);
  append(cache, 5);
  check(read(cache) == std::vector<float>({0, 1, 2, 3, 4, 100, 101, 102, 103, 104}), "append 5 slots");
  cache.truncate(3);  // a rollback: heads move down, nothing is recomputed
  check(read(cache) == std::vector<float>({0, 1, 2, 100, 101, 102}), "truncate keeps each head's first slots");
  KVCache rows = cache.tiled(2, 2);
  append(rows, 2);  // row 1's new slots carry + 1000
  check(read(rows) == std::vector<float>({0, 1, 2, 3, 4, 100, 101, 102, 103, 104,  //
                                          0, 1, 2, 1003, 1004, 100, 101, 102, 1103, 1104}),
        "tiled rows share the prefix and grow on their own");
  cache.adopt_slots(rows, 1, {3, 4}, 1);  // row 1's two new slots land at slot 1 of the main cache
  check(cache.length() == 3 && read(cache) == std::vector<float>({0, 1003, 1004, 100, 1103, 1104}),
        "adopted slots replace everything after the branch point");
  check(read(cache, 1) == read(cache, 0), "keys and values move together");
}

}  // namespace

int main() {
  try {
    test_json();
    test_verify();
    test_rank_branches();
    test_kv_cache();
  } catch (const std::exception& e) {
    std::cerr << "FAIL: exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "unit tests passed\n";
  return 0;
}
