// One opened export folder: the manifest, a session per graph, the target and draft models, and the three decoders
// on top of them (runtime/pipeline.py without text: token ids in and out).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "decoder.hpp"
#include "manifest.hpp"
#include "mirror.hpp"
#include "models.hpp"
#include "ort.hpp"
#include "settings.hpp"

namespace mirrorsd {

using Mode = settings::Mode;

// runtime/config.py's GenerationConfig, the part libmirrorsd implements (names and defaults: settings.hpp).
struct GenerationConfig {
  Mode mode = settings::kMode;
  int64_t max_new_tokens = settings::kMaxNewTokens;
  int gamma = settings::kGamma;
  settings::OnDraftFailure on_draft_failure = settings::kOnDraftFailure;
  MirrorSettings mirror;
};

struct Generation {
  DecodeOutcome outcome;
  int64_t branches_rolled_out = 0;
  std::vector<std::pair<double, double>> target_busy, draft_busy;  // graph call intervals of this generation
};

class Engine {
 public:
  Engine(const std::string& folder, const DeviceRequest& target, const DeviceRequest& draft);
  ~Engine();
  const Manifest& manifest() const { return manifest_; }
  const std::string& target_provider() const { return target_provider_; }
  const std::string& draft_provider() const { return draft_provider_; }
  // "mirrorsd" when any of the model's sessions runs the kernels library's MatMulNBits, else "ort"
  const std::string& target_kernels() const { return target_kernels_; }
  const std::string& draft_kernels() const { return draft_kernels_; }
  int target_threads() const { return target_threads_; }
  int draft_threads() const { return draft_threads_; }

  // Checks the prompt against the vocabulary and the context, then decodes; one generation at a time.
  Generation generate(const std::vector<int64_t>& prompt, const GenerationConfig& config, const Emit& emit);

 private:
  Proposer& proposer(const GenerationConfig& config);
  void check_request(const GenerationConfig& config, int64_t prompt_tokens) const;

  std::shared_ptr<Environment> env_;
  Manifest manifest_;
  Timeline target_timeline_, draft_timeline_;
  std::vector<std::unique_ptr<GraphSession>> sessions_;  // prefix, exit_head, suffix, draft
  std::unique_ptr<TargetModel> target_;
  std::unique_ptr<DraftModel> draft_;
  std::unique_ptr<Proposer> serial_;
  std::unique_ptr<MirrorProposer> mirror_;
  MirrorSettings mirror_settings_;
  std::string target_provider_, draft_provider_;
  std::string target_kernels_ = "ort", draft_kernels_ = "ort";
  int target_threads_ = 0, draft_threads_ = 0;
  std::mutex lock_;
};

}  // namespace mirrorsd
