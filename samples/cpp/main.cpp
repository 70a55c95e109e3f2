// mirrorsd C++ sample: target-only greedy decoding and vanilla speculative decoding on a mirrorsd export folder,
// with the ONNX Runtime C++ API. Every tensor name comes from mirrorsd.json.
//
// There is no tokenizer in C++ here: pass prompt token ids, get token ids back (encode and decode with the
// folder's tokenizer/tokenizer.json elsewhere, e.g. `python -c "from tokenizers import Tokenizer; ..."`).
//
//   mirrorsd_sample EXPORT_FOLDER [--mode ar|sd|both] [--gamma 4] [--max-new-tokens 32] [--threads 1] --ids 1 2 3
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "decoding.hpp"
#include "manifest.hpp"
#include "ort_runner.hpp"

namespace {

struct Args {
  std::filesystem::path folder;
  std::string mode = "both";
  int gamma = 4;
  int64_t max_new_tokens = 32;
  int threads = 1;
  std::vector<int64_t> ids;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "error: " << problem << "\n"
            << "usage: mirrorsd_sample EXPORT_FOLDER [--mode ar|sd|both] [--gamma N] [--max-new-tokens N]"
               " [--threads N] --ids ID [ID ...]\n"
               "Prompt and output are token ids: this sample has no tokenizer.\n";
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  if (argc < 2) usage("no export folder");
  a.folder = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    try {
      if (flag == "--mode") a.mode = value();
      else if (flag == "--gamma") a.gamma = std::stoi(value());
      else if (flag == "--max-new-tokens") a.max_new_tokens = std::stoll(value());
      else if (flag == "--threads") a.threads = std::stoi(value());
      else if (flag == "--ids") while (i + 1 < argc && argv[i + 1][0] != '-') a.ids.push_back(std::stoll(argv[++i]));
      else usage("unknown option " + flag);
    } catch (const std::logic_error&) {
      usage("bad number after " + flag);
    }
  }
  if (a.mode != "ar" && a.mode != "sd" && a.mode != "both") usage("--mode is ar, sd or both");
  if (a.ids.empty()) usage("no prompt ids (--ids)");
  if (a.gamma < 1 || a.max_new_tokens < 1 || a.threads < 1) usage("--gamma, --max-new-tokens, --threads must be >= 1");
  return a;
}

void print(const char* label, const mirrorsd::DecodeResult& r) {
  std::cout << label << ":";
  for (int64_t t : r.tokens) std::cout << ' ' << t;
  std::cout << "\n" << label << " stats: " << r.tokens.size() << " tokens in " << r.seconds << " s ("
            << (r.seconds > 0 ? r.tokens.size() / r.seconds : 0.0) << " tok/s), target calls " << r.target_calls;
  if (r.drafted > 0) {
    std::cout << ", draft calls " << r.draft_calls << ", mean accepted tokens "
              << double(r.accepted + r.steps) / double(r.steps) << ", acceptance "
              << double(r.accepted) / double(r.drafted);
  }
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse_args(argc, argv);
  try {
    mirrorsd::Manifest m = mirrorsd::load_manifest(args.folder);
    for (int64_t id : args.ids)
      if (id < 0 || id >= m.vocab_size) usage("prompt id " + std::to_string(id) + " is outside the vocabulary");
    Ort::Env env(ORT_LOGGING_LEVEL_WARNING, "mirrorsd-sample");
    mirrorsd::Network target, draft;
    target.add_stage(m.prefix, std::make_unique<mirrorsd::OrtRunner>(env, m.prefix.file, args.threads));
    target.add_stage(m.suffix, std::make_unique<mirrorsd::OrtRunner>(env, m.suffix.file, args.threads));
    mirrorsd::DecodeSettings settings{args.max_new_tokens, args.gamma, m.eos_token_ids, m.context_limit};
    if (static_cast<int64_t>(args.ids.size()) + 1 > settings.context_limit)
      usage("the prompt is longer than the context");

    mirrorsd::DecodeResult ar, sd;
    if (args.mode != "sd") {
      ar = mirrorsd::decode(target, nullptr, args.ids, settings);
      print("ar", ar);
    }
    if (args.mode != "ar") {
      draft.add_stage(m.draft, std::make_unique<mirrorsd::OrtRunner>(env, m.draft.file, args.threads));
      mirrorsd::GreedyDrafter drafter(draft);
      sd = mirrorsd::decode(target, &drafter, args.ids, settings);
      print("sd", sd);
    }
    if (args.mode == "both") {
      std::cout << "sd identical to ar: " << (sd.tokens == ar.tokens ? "yes" : "no (a floating-point near-tie?)")
                << "\n";
    }
  } catch (const Ort::Exception& e) {
    std::cerr << "onnxruntime error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
