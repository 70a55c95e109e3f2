// mirrorsd C++ sample: a thin command line over libmirrorsd's C ABI (runtime/native/include/mirrorsd.h).
// Token ids in, token ids out: there is no tokenizer in C++ (encode and decode with the folder's
// tokenizer/tokenizer.json elsewhere).
//
//   mirrorsd_cli EXPORT_FOLDER [--mode ar|sd|mirror|all] [--gamma 4] [--max-new-tokens 32] [--branches 4]
//                [--branch-batch 2] [--runner-up-k 4] [--budget time|cap] [--no-exit-head] [--threads N]
//                [--target-device D] [--draft-device D] [--kernels LIBMIRRORSD_KERN_SO] --ids ID [ID ...]
//
// Prints "<mode>: <ids>" and "<mode> stats: ..." per mode; with --mode all, whether sd and mirror equal ar.
// Exit status: 0 on success, the mirrorsd_status code (1..7) on a library error, 64 on bad usage.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "mirrorsd.h"

namespace {

struct Args {
  std::string folder, mode = "all", budget = "time", target_device = "auto", draft_device = "auto", kernels;
  int gamma = 4, max_new_tokens = 32, branches = 4, branch_batch = 2, runner_up_k = 4, threads = 0;
  bool exit_head = true;
  std::vector<int64_t> ids;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "error: " << problem << "\n"
            << "usage: mirrorsd_cli EXPORT_FOLDER [--mode ar|sd|mirror|all] [--gamma N] [--max-new-tokens N]\n"
               "         [--branches N] [--branch-batch N] [--runner-up-k N] [--budget time|cap] [--no-exit-head]\n"
               "         [--threads N] [--target-device D] [--draft-device D] [--kernels LIBMIRRORSD_KERN_SO]\n"
               "         --ids ID [ID ...]\n"
               "Prompt and output are token ids: there is no tokenizer here. --kernels runs mirrorsd's MatMulNBits\n"
               "kernels (python -m mirrorsd.devices.kernels prints the path) instead of ONNX Runtime's.\n";
  std::exit(64);
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2 || argv[1][0] == '-') usage("no export folder");
  a.folder = argv[1];
  std::map<std::string, int*> numbers{{"--gamma", &a.gamma},       {"--max-new-tokens", &a.max_new_tokens},
                                      {"--branches", &a.branches}, {"--branch-batch", &a.branch_batch},
                                      {"--runner-up-k", &a.runner_up_k}, {"--threads", &a.threads}};
  std::map<std::string, std::string*> words{{"--mode", &a.mode}, {"--budget", &a.budget},
                                            {"--target-device", &a.target_device},
                                            {"--draft-device", &a.draft_device}, {"--kernels", &a.kernels}};
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    try {
      if (numbers.count(flag)) *numbers[flag] = std::stoi(value());
      else if (words.count(flag)) *words[flag] = value();
      else if (flag == "--no-exit-head") a.exit_head = false;
      else if (flag == "--ids")
        while (i + 1 < argc && argv[i + 1][0] != '-') a.ids.push_back(std::stoll(argv[++i]));
      else usage("unknown option " + flag);
    } catch (const std::logic_error&) {
      usage("bad number after " + flag);
    }
  }
  if (a.mode != "ar" && a.mode != "sd" && a.mode != "mirror" && a.mode != "all") usage("--mode is ar, sd, mirror or all");
  if (a.budget != "time" && a.budget != "cap") usage("--budget is time or cap");
  return a;  // everything else (ids, counts) is checked by the library, which says what is wrong
}

int32_t collect(int64_t token, void* user_data) {
  static_cast<std::vector<int64_t>*>(user_data)->push_back(token);
  return 0;  // go on
}

int fail(mirrorsd_status status) {
  std::cerr << "error: " << mirrorsd_last_error() << "\n";
  return static_cast<int>(status);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  mirrorsd_open_options options;
  mirrorsd_open_options_init(&options);
  options.target_device = args.target_device.c_str();
  options.draft_device = args.draft_device.c_str();
  options.target_threads = options.draft_threads = args.threads;
  options.kernels_library = args.kernels.empty() ? nullptr : args.kernels.c_str();  // NULL: ONNX Runtime's kernel
  mirrorsd_model* model = nullptr;
  mirrorsd_status status = mirrorsd_open(args.folder.c_str(), &options, &model);
  if (status != MIRRORSD_OK) return fail(status);
  mirrorsd_model_info info;
  info.struct_size = sizeof info;
  if ((status = mirrorsd_model_get_info(model, &info)) != MIRRORSD_OK) return fail(status);
  std::cout << "# " << args.folder << ": target " << info.target_provider << ", draft " << info.draft_provider
            << ", vocab " << info.vocab_size << ", context " << info.context_limit << ", MatMulNBits kernels "
            << info.target_kernels << "/" << info.draft_kernels << "\n";

  const std::vector<std::pair<std::string, int32_t>> all{{"ar", MIRRORSD_MODE_AR}, {"sd", MIRRORSD_MODE_SD},
                                                         {"mirror", MIRRORSD_MODE_MIRROR}};
  std::map<std::string, std::vector<int64_t>> outputs;
  for (const auto& [name, mode] : all) {
    if (args.mode != "all" && args.mode != name) continue;
    mirrorsd_generate_config config;
    mirrorsd_generate_config_init(&config);
    config.mode = mode;
    config.max_new_tokens = args.max_new_tokens;
    config.gamma = args.gamma;
    config.branches = args.branches;
    config.branch_batch = args.branch_batch;
    config.runner_up_k = args.runner_up_k;
    config.branch_budget = args.budget == "cap" ? MIRRORSD_BUDGET_CAP : MIRRORSD_BUDGET_TIME;
    config.exit_head = args.exit_head ? 1 : 0;
    mirrorsd_stats stats;
    stats.struct_size = sizeof stats;
    std::vector<int64_t>& tokens = outputs[name];
    status = mirrorsd_generate(model, args.ids.data(), static_cast<int32_t>(args.ids.size()), &config, collect,
                               &tokens, &stats);
    if (status != MIRRORSD_OK) {
      const int code = fail(status);  // before close, which clears the error text
      mirrorsd_close(model);
      return code;
    }
    std::cout << name << ":";
    for (int64_t t : tokens) std::cout << ' ' << t;
    std::printf("\n%s stats: %lld tokens, %.1f tok/s, mean accepted %.2f, acceptance %.2f, reuse %.2f, overlap %.2f\n",
                name.c_str(), static_cast<long long>(stats.new_tokens), stats.tokens_per_second,
                stats.mean_accepted_tokens, stats.acceptance_rate, stats.reuse_rate, stats.overlap_ratio);
  }
  if (args.mode == "all")
    for (const char* name : {"sd", "mirror"})
      std::cout << name << " identical to ar: " << (outputs[name] == outputs["ar"] ? "yes" : "no") << "\n";
  mirrorsd_close(model);
  return 0;
}
