// The C ABI of mirrorsd.h: argument checks, error codes and per-thread error text around the C++ engine. No C++
// exception ever crosses this boundary. Handles are looked up in a registry (handles.hpp), so a closed, foreign or
// re-entered handle is an error code, not a crash or a deadlock.
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <thread>

#include "devices.hpp"
#include "engine.hpp"
#include "errors.hpp"
#include "handles.hpp"
#include "mirrorsd.h"
#include "settings.hpp"
#include "stats.hpp"

static_assert(MIRRORSD_DRAFT_TIMEOUT_NEVER_S == mirrorsd::settings::kDraftTimeoutNeverS, "mirrorsd.h and settings");

namespace {

using mirrorsd::Code;
using mirrorsd::Error;

thread_local std::string last_error;

template <typename F>
mirrorsd_status guarded(F body) {
  last_error.clear();
  try {
    body();
    return MIRRORSD_OK;
  } catch (const Error& e) {
    last_error = e.what();
    return static_cast<mirrorsd_status>(e.code());
  } catch (const std::bad_alloc&) {
    last_error = "Out of memory. Why: a buffer could not be allocated. Fix: free memory or use a smaller model.";
  } catch (const std::exception& e) {
    last_error = std::string("Internal error: ") + e.what() + ". Fix: please report it.";
  } catch (...) {
    last_error = "Internal error of an unknown kind. Fix: please report it.";
  }
  return MIRRORSD_ERROR_INTERNAL;
}

[[noreturn]] void invalid(const std::string& what, const std::string& why, const std::string& fix) {
  throw Error(Code::InvalidArgument, what, why, fix);
}

void check_size(uint32_t given, size_t expected, const char* type) {
  if (given != expected)
    invalid(std::string(type) + ".struct_size is " + std::to_string(given) + ", this library expects " +
                std::to_string(expected),
            "the caller was built against another mirrorsd.h (or did not set struct_size)",
            std::string("initialize it with its _init function or set sizeof(") + type + ")");
}

// ABI 1's sizes of the structs ABI 2 grew at their end: a caller built against ABI 1 keeps working.
constexpr size_t kOpenOptionsV1 = offsetof(mirrorsd_open_options, kernels_library);
constexpr size_t kModelInfoV1 = offsetof(mirrorsd_model_info, target_kernels);
constexpr size_t kModelInfoV2 = offsetof(mirrorsd_model_info, target_threads);  // ABI 3 appended the threads

void check_size(uint32_t given, size_t expected, size_t older, const char* type, size_t old = 0) {
  if (given != older && (old == 0 || given != old)) check_size(given, expected, type);
}

// The C ABI's enum values are settings.hpp's (generated from runtime/config.py's tuples).
static_assert(MIRRORSD_MODE_AR == int(mirrorsd::Mode::Ar) && MIRRORSD_MODE_SD == int(mirrorsd::Mode::Sd) &&
              MIRRORSD_MODE_MIRROR == int(mirrorsd::Mode::Mirror), "modes");
static_assert(MIRRORSD_BUDGET_TIME == int(mirrorsd::settings::BranchBudget::Time) &&
              MIRRORSD_BUDGET_CAP == int(mirrorsd::settings::BranchBudget::Cap), "branch budgets");
static_assert(MIRRORSD_DRAFT_FAILURE_RAISE == int(mirrorsd::settings::OnDraftFailure::Raise) &&
              MIRRORSD_DRAFT_FAILURE_FALLBACK == int(mirrorsd::settings::OnDraftFailure::Fallback), "draft failure");

std::string kernels_library(const char* path) {
  if (path == nullptr || *path == '\0') return "";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(Code::Device, std::string("The kernels library '") + path + "' is not a file",
                "kernels_library names mirrorsd's MatMulNBits kernels (libmirrorsd_kern.so), loaded into every "
                "session that runs MatMulNBits",
                "pass the path of libmirrorsd_kern.so (Python: mirrorsd.devices.kernels.usable_library().path), or "
                "NULL for ONNX Runtime's own kernel");
  return path;
}

// 0 = the default; else 1..cores, as runtime/limits.py's check_threads (more only queue on the same cores, and a
// million of them never finish starting).
int threads_or_default(int32_t threads, const char* name) {
  const int cores = mirrorsd::cores();
  if (threads == 0) return mirrorsd::default_threads();
  if (threads < 0 || threads > cores)
    invalid(std::string(name) + " " + std::to_string(threads) + " is out of range",
            "this machine gives the process " + std::to_string(cores) + " cores; more threads only queue",
            "pass 1.." + std::to_string(cores) + ", or 0 (every core)");
  return threads;
}

bool flag(int32_t value, const char* name) {
  if (value != 0 && value != 1)
    invalid(std::string(name) + " must be 0 or 1, got " + std::to_string(value), "it is a yes/no setting",
            "pass 0 or 1");
  return value == 1;
}

mirrorsd::GenerationConfig engine_config(const mirrorsd_generate_config* c) {
  if (c == nullptr) invalid("config is NULL", "generation needs a configuration", "pass mirrorsd_generate_config");
  check_size(c->struct_size, sizeof(mirrorsd_generate_config), "mirrorsd_generate_config");
  if (c->mode < MIRRORSD_MODE_AR || c->mode > MIRRORSD_MODE_MIRROR)
    invalid("Unknown mode " + std::to_string(c->mode), "modes are 0 (ar), 1 (sd), 2 (mirror)", "pick one");
  const std::pair<const char*, int32_t> counts[] = {{"max_new_tokens", c->max_new_tokens}, {"gamma", c->gamma},
                                                    {"branches", c->branches}, {"branch_batch", c->branch_batch},
                                                    {"runner_up_k", c->runner_up_k}};
  for (const auto& [name, value] : counts)
    if (value < mirrorsd::settings::kCountMin)
      invalid(std::string(name) + " must be a positive integer, got " + std::to_string(value),
              "it counts tokens or branches", std::string("pass ") + name + " >= 1");
  if (c->branch_budget != MIRRORSD_BUDGET_TIME && c->branch_budget != MIRRORSD_BUDGET_CAP)
    invalid("Unknown branch_budget " + std::to_string(c->branch_budget), "it is 0 (time) or 1 (cap)", "pick one");
  if (!(c->draft_timeout_s > 0)) {  // NaN fails too; infinity and anything from the "never" bound up: no limit
    char got[64];
    std::snprintf(got, sizeof got, "%g", c->draft_timeout_s);
    invalid(std::string("draft_timeout_s must be a positive number of seconds, got ") + got,
            "it bounds each wait for the draft worker",
            "pass a value such as 120, or 1e9 (MIRRORSD_DRAFT_TIMEOUT_NEVER_S) or more for no limit");
  }
  mirrorsd::GenerationConfig out;
  out.mode = static_cast<mirrorsd::Mode>(c->mode);
  out.max_new_tokens = c->max_new_tokens;
  out.gamma = c->gamma;
  if (c->on_draft_failure != MIRRORSD_DRAFT_FAILURE_RAISE && c->on_draft_failure != MIRRORSD_DRAFT_FAILURE_FALLBACK)
    invalid("Unknown on_draft_failure " + std::to_string(c->on_draft_failure), "it is 0 (raise) or 1 (fallback)",
            "pick one");
  out.on_draft_failure = static_cast<mirrorsd::settings::OnDraftFailure>(c->on_draft_failure);
  out.mirror.branches = c->branches;
  out.mirror.branch_batch = c->branch_batch;
  out.mirror.runner_up_k = c->runner_up_k;
  out.mirror.branch_budget = static_cast<mirrorsd::settings::BranchBudget>(c->branch_budget);
  out.mirror.exit_head = flag(c->exit_head, "exit_head");
  out.mirror.draft_timeout_s = c->draft_timeout_s;
  return out;
}

void fill_stats(mirrorsd_stats* s, int32_t mode, int64_t prompt_tokens, const mirrorsd::Generation& g) {
  const mirrorsd::DecodeOutcome& o = g.outcome;
  const mirrorsd::StepCounters& c = o.counters;
  const int64_t new_tokens = static_cast<int64_t>(o.tokens.size());
  const double decode_time = std::max(o.seconds - o.time_to_first_token_s, 1e-9);
  double target_busy = 0, draft_busy = 0;
  for (const auto& [a, b] : g.target_busy) target_busy += b - a;
  for (const auto& [a, b] : g.draft_busy) draft_busy += b - a;
  const double hidden = mirrorsd::overlap_seconds(g.draft_busy, g.target_busy);
  *s = mirrorsd_stats{};
  s->struct_size = sizeof(mirrorsd_stats);
  s->mode = mode;
  s->finish_reason = static_cast<int32_t>(o.finish);
  s->prompt_tokens = prompt_tokens;
  s->new_tokens = new_tokens;
  s->steps = c.steps, s->drafted = c.drafted, s->accepted = c.accepted, s->windows = c.windows;
  s->reused = c.reused, s->fallbacks = c.fallbacks, s->draft_forwards = c.draft_forwards;
  s->branches_rolled_out = g.branches_rolled_out, s->draft_failures = c.draft_failures;
  s->seconds = o.seconds, s->time_to_first_token_s = o.time_to_first_token_s;
  s->tokens_per_second = new_tokens / std::max(o.seconds, 1e-9);
  s->decode_tokens_per_second = std::max<int64_t>(new_tokens - 1, 0) / decode_time;
  s->mean_accepted_tokens = c.steps ? double(c.accepted + c.steps) / c.steps : 1.0;
  s->acceptance_rate = c.drafted ? double(c.accepted) / c.drafted : 0.0;
  s->reuse_rate = c.windows ? double(c.reused) / c.windows : 0.0;
  s->target_busy_s = target_busy, s->draft_busy_s = draft_busy, s->draft_hidden_s = hidden;
  s->overlap_ratio = draft_busy > 0 ? hidden / draft_busy : 0.0;
}

void copy_text(char* dst, size_t size, const std::string& src) {
  std::strncpy(dst, src.c_str(), size - 1);
  dst[size - 1] = '\0';
}

void fill_info(mirrorsd_model_info& info, const mirrorsd::Engine& engine) {
  const mirrorsd::Manifest& m = engine.manifest();
  info.eos_count = static_cast<int32_t>(std::min<size_t>(m.eos_token_ids.size(), MIRRORSD_MAX_EOS));
  for (int32_t i = 0; i < info.eos_count; ++i) info.eos_token_ids[i] = m.eos_token_ids[i];
  info.vocab_size = m.target.vocab_size;
  info.context_limit = m.context_limit();
  info.target_layers = m.target.num_layers;
  info.exit_layer = m.exit_layer;
  info.draft_layers = m.draft.num_layers;
  info.top_k = m.top_k;
  copy_text(info.target_provider, sizeof info.target_provider, engine.target_provider());
  copy_text(info.draft_provider, sizeof info.draft_provider, engine.draft_provider());
  copy_text(info.target_kernels, sizeof info.target_kernels, engine.target_kernels());
  copy_text(info.draft_kernels, sizeof info.draft_kernels, engine.draft_kernels());
  info.target_threads = engine.target_threads();
  info.draft_threads = engine.draft_threads();
}

}  // namespace

extern "C" {

const char* mirrorsd_version(void) { return "mirrorsd 0.1.0 (C ABI 3)"; }

const char* mirrorsd_last_error(void) { return last_error.c_str(); }

void mirrorsd_open_options_init(mirrorsd_open_options* options) {
  if (options == nullptr) return;
  *options = mirrorsd_open_options{};
  options->struct_size = sizeof(mirrorsd_open_options);
}

void mirrorsd_generate_config_init(mirrorsd_generate_config* config) {
  if (config == nullptr) return;
  *config = mirrorsd_generate_config{};
  config->struct_size = sizeof(mirrorsd_generate_config);
  namespace s = mirrorsd::settings;  // runtime/config.py's GenerationConfig() (mode: no auto here)
  config->mode = static_cast<int32_t>(s::kMode);
  config->max_new_tokens = s::kMaxNewTokens;
  config->gamma = s::kGamma;
  config->branches = s::kBranches;
  config->branch_batch = s::kBranchBatch;
  config->runner_up_k = s::kRunnerUpK;
  config->branch_budget = static_cast<int32_t>(s::kBranchBudget);
  config->exit_head = s::kExitHead ? 1 : 0;
  config->on_draft_failure = static_cast<int32_t>(s::kOnDraftFailure);
  config->draft_timeout_s = s::kDraftTimeoutS;
}

mirrorsd_status mirrorsd_open(const char* folder, const mirrorsd_open_options* options, mirrorsd_model** model) {
  return guarded([&] {
    if (model == nullptr) invalid("model is NULL", "the opened model is returned through it", "pass &model");
    *model = nullptr;
    if (folder == nullptr || *folder == '\0')
      invalid("folder is NULL or empty", "it names the export folder", "pass the --output folder of mirrorsd-export");
    mirrorsd_open_options o;
    mirrorsd_open_options_init(&o);
    if (options != nullptr) {  // the fields the caller's struct has; ABI 2's over ABI 1's stay at their defaults
      check_size(options->struct_size, sizeof(mirrorsd_open_options), kOpenOptionsV1, "mirrorsd_open_options");
      std::memcpy(&o, options, options->struct_size);
    }
    const std::string library = o.openvino_ep_library ? o.openvino_ep_library : "";
    const std::string kernels = kernels_library(o.kernels_library);
    const mirrorsd::DeviceRequest target{o.target_device ? o.target_device : "auto",
                                         threads_or_default(o.target_threads, "target_threads"), library, kernels};
    const mirrorsd::DeviceRequest draft{o.draft_device ? o.draft_device : "auto",
                                        threads_or_default(o.draft_threads, "draft_threads"), library, kernels};
    *model = mirrorsd::handles().add(std::make_unique<mirrorsd::Engine>(folder, target, draft));
  });
}

mirrorsd_status mirrorsd_model_get_info(const mirrorsd_model* model, mirrorsd_model_info* info) {
  return guarded([&] {
    if (info == nullptr) invalid("info is NULL", "the model's description is written into it", "pass &info");
    const std::shared_ptr<mirrorsd::OpenModel> open = mirrorsd::handles().find(model, "mirrorsd_model_get_info");
    const uint32_t size = info->struct_size;
    check_size(size, sizeof(mirrorsd_model_info), kModelInfoV1, "mirrorsd_model_info", kModelInfoV2);
    mirrorsd_model_info full{};
    fill_info(full, *open->engine);
    full.struct_size = size;
    std::memcpy(info, &full, size);  // an ABI 1 caller gets the fields its struct has
  });
}

mirrorsd_status mirrorsd_generate(mirrorsd_model* model, const int64_t* prompt, int32_t prompt_length,
                                  const mirrorsd_generate_config* config, mirrorsd_token_callback on_token,
                                  void* user_data, mirrorsd_stats* stats) {
  return guarded([&] {
    mirrorsd::Generating call(model);  // an open handle, not re-entered from its own callback
    if (prompt == nullptr && prompt_length != 0)
      invalid("prompt is NULL", "it holds the prompt's token ids", "pass an array of prompt_length ids");
    if (prompt_length < 0) invalid("prompt_length is negative", "it counts the prompt's ids", "pass the count");
    const mirrorsd::GenerationConfig engine = engine_config(config);
    if (on_token == nullptr)
      invalid("on_token is NULL", "tokens are delivered only through the callback", "pass a callback");
    if (stats != nullptr) check_size(stats->struct_size, sizeof(mirrorsd_stats), "mirrorsd_stats");
    const std::vector<int64_t> ids(prompt, prompt + prompt_length);
    const mirrorsd::Emit emit = [&](int64_t token) { return on_token(token, user_data) == 0; };
    const mirrorsd::Generation result = call.run([&](mirrorsd::Engine& e) { return e.generate(ids, engine, emit); });
    if (stats != nullptr) fill_stats(stats, config->mode, prompt_length, result);
  });
}

mirrorsd_status mirrorsd_close(mirrorsd_model* model) {
  return guarded([&] {
    if (model != nullptr) mirrorsd::handles().close(model);
  });
}

}  // extern "C"
