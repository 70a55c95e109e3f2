#include "engine.hpp"

#include <algorithm>
#include <cstdio>

#include "devices.hpp"
#include "errors.hpp"
#include "graph_files.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace mirrorsd {
namespace {

constexpr int64_t kBytes = 4;  // float32 KV caches and logits

int64_t machine_memory() {  // physical memory in bytes, or 0 where the OS does not say
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) return static_cast<int64_t>(pages) * page;
#endif
  return 0;
}

// KV bytes per token of one row of `model`'s caches (every graph of that model that carries a cache).
double kv_bytes(const Manifest& manifest, const std::string& model) {
  double bytes = 0;
  for (const auto& [role, spec] : manifest.graphs)
    if (spec.model == model && spec.has_kv && (role == "prefix" || role == "suffix" || role == "draft"))
      bytes += double(spec.kv.layers()) * 2 * spec.kv.num_kv_heads * spec.kv.head_dim * kBytes;
  return bytes;
}

}  // namespace

// The bounds that depend on the export and the machine, as runtime/limits.py's check_generation: runner_up_k within
// the vocabulary, gamma below the context, and the KV caches and logits a request needs within this machine's memory.
void Engine::check_request(const GenerationConfig& config, int64_t prompt_tokens) const {
  const int64_t vocab = manifest_.draft.vocab_size, context = manifest_.context_limit();
  if (config.mode == Mode::Mirror && config.mirror.runner_up_k > vocab)
    throw Error(Code::InvalidArgument,
                "runner_up_k " + std::to_string(config.mirror.runner_up_k) + " is larger than the vocabulary (" +
                    std::to_string(vocab) + ")",
                "it counts the draft's candidate tokens per position",
                "pass runner_up_k 1.." + std::to_string(vocab) + " (default 4)");
  if (config.mode == Mode::Ar) return;
  if (config.gamma >= context)
    throw Error(Code::InvalidArgument,
                "gamma " + std::to_string(config.gamma) + " is not below the context (" + std::to_string(context) +
                    " tokens)",
                "a draft window must fit in the context with the prompt", "pass a gamma such as 4 (the default)");
  // A lower bound of what the decoders allocate: caches at their first size, and the logits of one step.
  const double gamma = config.gamma, capacity = double(std::min(prompt_tokens + config.max_new_tokens, context)) +
                                                     gamma + 2;
  const double candidates = (gamma + 1) * (double(config.mirror.runner_up_k) + double(manifest_.top_k));
  const double branch_rows = config.mode == Mode::Mirror
                                 ? std::min({double(config.mirror.branch_batch), double(config.mirror.branches),
                                             candidates})
                                 : 0.0;
  const double rows = 1 + branch_rows;
  const double logits = (gamma + 1) * kBytes *
                        (double(manifest_.target.vocab_size) + rows * double(manifest_.draft.vocab_size));
  const double need = capacity * (kv_bytes(manifest_, "target") + rows * kv_bytes(manifest_, "draft")) + logits;
  const int64_t have = machine_memory();
  if (have > 0 && need > double(have)) {
    char text[160];
    std::snprintf(text, sizeof text, "This request needs about %.1f GiB for its KV caches and logits",
                  need / double(1LL << 30));
    char why[200];
    std::snprintf(why, sizeof why, "this machine has %.1f GiB (gamma %d, branch_batch %d, context %lld)",
                  double(have) / double(1LL << 30), config.gamma, config.mirror.branch_batch,
                  static_cast<long long>(context));
    throw Error(Code::InvalidArgument, text, why, "lower gamma and branch_batch (defaults 4 and 2)");
  }
}

Engine::Engine(const std::string& folder, const DeviceRequest& target, const DeviceRequest& draft)
    : env_(environment()), manifest_(load_manifest(folder)), target_threads_(target.threads),
      draft_threads_(draft.threads) {
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
  if (static_cast<int64_t>(prompt.size()) + 1 > context)
    throw Error(Code::InvalidArgument, "The prompt has " + std::to_string(prompt.size()) + " tokens",
                "the exported graphs allow " + std::to_string(context) + " in all", "shorten the prompt");
  check_request(config, static_cast<int64_t>(prompt.size()));
  std::lock_guard<std::mutex> guard(lock_);  // one generation at a time per model
  DecodeSettings settings;
  settings.max_new_tokens = config.max_new_tokens;
  settings.eos_token_ids = manifest_.eos_token_ids;
  settings.context_limit = context;
  settings.gamma = config.mode == Mode::Ar ? 0 : config.gamma;
  settings.on_draft_failure = config.on_draft_failure;
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
