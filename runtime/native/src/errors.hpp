// One error type for the whole library. Like mirrorsd's MirrorSDError, every message says what went wrong, why, and
// what to do; the code becomes the C ABI's mirrorsd_status.
#pragma once

#include <stdexcept>
#include <string>

namespace mirrorsd {

enum class Code {
  InvalidArgument = 1,
  Manifest = 2,
  GraphFile = 3,
  Device = 4,
  Runtime = 5,
  DraftWorker = 6,
  Internal = 7,
  Busy = 8,
};

inline std::string compose(const std::string& what, const std::string& why, const std::string& fix) {
  auto sentence = [](std::string s) {
    while (!s.empty() && (s.back() == '.' || s.back() == ' ')) s.pop_back();
    return s + ".";
  };
  std::string text = sentence(what);
  if (!why.empty()) text += " Why: " + sentence(why);
  if (!fix.empty()) text += " Fix: " + sentence(fix);
  return text;
}

class Error : public std::runtime_error {
 public:
  Error(Code code, const std::string& what, const std::string& why = "", const std::string& fix = "")
      : std::runtime_error(compose(what, why, fix)), code_(code) {}
  Code code() const { return code_; }

 private:
  Code code_;
};

}  // namespace mirrorsd
