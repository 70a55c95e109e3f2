#include "engine.hpp"

#include "devices.hpp"
#include "errors.hpp"
#include "graph_files.hpp"

namespace mirrorsd {

Engine::Engine(const std::string& folder, const DeviceRequest& target, const DeviceRequest& draft)
    : env_(environment()), manifest_(load_manifest(folder)) {
  const DeviceRequest placed[] = {
      {resolve_device(target.device, "target"), target.threads, target.openvino_ep_library, target.kernels_library},
      {resolve_device(draft.device, "draft"), draft.threads, draft.openvino_ep_library, draft.kernels_library}};
  for (const char* role : {"prefix", "exit_head", "suffix", "draft"}) {
    const GraphSpec& spec = manifest_.graph(role);
    check_graph_file(spec);  // before ONNX Runtime follows any path the file names
    const bool is_target = spec.model == "target";
    sessions_.push_back(std::make_unique<GraphSession>(env_, spec, placed[is_target ? 0 : 1],
                                                       is_target ? target_timeline_ : draft_timeline_));
    (is_target ? target_provider_ : draft_provider_) = sessions_.back()->provider();
    if (sessions_.back()->mirrorsd_kernels()) (is_target ? target_kernels_ : draft_kernels_) = "mirrorsd";
  }
  target_ = std::make_unique<TargetModel>(*sessions_[0], *sessions_[1], *sessions_[2], manifest_.target.vocab_size);
  draft_ = std::make_unique<DraftModel>(*sessions_[3], manifest_.draft.vocab_size);
  serial_ = std::make_unique<SerialDraft>(*draft_);
}

Engine::~Engine() {
  std::lock_guard<std::mutex> guard(lock_);
  mirror_.reset();  // joins its worker before the draft model goes
}

Proposer& Engine::proposer(const GenerationConfig& config) {
  static Proposer target_only;  // stateless
  if (config.mode == Mode::Ar) return target_only;
  if (config.mode == Mode::Sd) return *serial_;
  if (!mirror_ || !(mirror_settings_ == config.mirror)) {
    mirror_.reset();
    mirror_ = std::make_unique<MirrorProposer>(*draft_, config.mirror);
    mirror_settings_ = config.mirror;
  }
  return *mirror_;
}

Generation Engine::generate(const std::vector<int64_t>& prompt, const GenerationConfig& config, const Emit& emit) {
  const int64_t vocab = manifest_.target.vocab_size, context = manifest_.context_limit();
  if (prompt.empty())
    throw Error(Code::InvalidArgument, "The prompt is empty", "there is nothing to continue", "pass some token ids");
  for (int64_t id : prompt)
    if (id < 0 || id >= vocab)
      throw Error(Code::InvalidArgument, "Prompt id " + std::to_string(id) + " is out of range",
                  "ids must be in 0.." + std::to_string(vocab - 1), "encode text with this export's tokenizer");
  if (config.mirror.runner_up_k > manifest_.draft.vocab_size)
    throw Error(Code::InvalidArgument, "runner_up_k is larger than the vocabulary",
                "it counts the draft's candidate tokens per position", "pass a smaller runner_up_k");
  if (static_cast<int64_t>(prompt.size()) + 1 > context)
    throw Error(Code::InvalidArgument, "The prompt has " + std::to_string(prompt.size()) + " tokens",
                "the exported graphs allow " + std::to_string(context) + " in all", "shorten the prompt");
  std::lock_guard<std::mutex> guard(lock_);  // one generation at a time per model
  DecodeSettings settings;
  settings.max_new_tokens = config.max_new_tokens;
  settings.eos_token_ids = manifest_.eos_token_ids;
  settings.context_limit = context;
  settings.gamma = config.mode == Mode::Ar ? 0 : config.gamma;
  settings.fallback_on_draft_failure = config.fallback_on_draft_failure;
  target_timeline_.intervals.clear();
  draft_timeline_.intervals.clear();
  Proposer& chosen = proposer(config);
  Generation out;
  out.outcome = decode(*target_, chosen, prompt, settings, emit);
  if (config.mode == Mode::Mirror) out.branches_rolled_out = mirror_->branches();
  out.target_busy = target_timeline_.intervals;
  out.draft_busy = draft_timeline_.intervals;
  return out;
}

}  // namespace mirrorsd
