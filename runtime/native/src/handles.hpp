// Open models behind opaque handles. A mirrorsd_model* is a number the registry hands out once, never an address,
// so a closed, double-closed or made-up handle is found missing instead of dereferenced. The registry also knows
// which thread generates with each model: a call from inside the model's own token callback (the same thread) is
// refused instead of waiting for itself forever, and closing a model that is in use is refused instead of freeing
// what a generation still reads.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "engine.hpp"
#include "mirrorsd.h"

namespace mirrorsd {

struct OpenModel {
  explicit OpenModel(std::unique_ptr<Engine> e) : engine(std::move(e)) {}
  std::unique_ptr<Engine> engine;
  std::mutex run;              // one generation at a time
  int calls = 0;               // mirrorsd_generate calls in flight, running or waiting (under the registry's lock)
  std::thread::id generating;  // the thread inside a generation, or none (under the registry's lock)
};

class Handles {
 public:
  mirrorsd_model* add(std::unique_ptr<Engine> engine);
  std::shared_ptr<OpenModel> find(const mirrorsd_model* handle, const char* call);  // Error unless open
  std::shared_ptr<OpenModel> enter(const mirrorsd_model* handle);  // find, refuse re-entry, count the call
  void leave(OpenModel& model);
  void mark_generating(OpenModel& model, bool generating);
  void close(mirrorsd_model* handle);  // Error unless open and idle; frees the model outside the lock

 private:
  std::shared_ptr<OpenModel> lookup(const mirrorsd_model* handle, const char* call);  // under lock_

  std::mutex lock_;
  std::unordered_map<uintptr_t, std::shared_ptr<OpenModel>> open_;
  uintptr_t issued_ = 0;
};

Handles& handles();  // the process's registry (never destroyed: models left open at exit stay untouched)

// One mirrorsd_generate call: counted from entry to return; run() holds the model for the generation itself.
class Generating {
 public:
  explicit Generating(const mirrorsd_model* handle) : model_(handles().enter(handle)) {}
  ~Generating() { handles().leave(*model_); }
  Generating(const Generating&) = delete;
  Generating& operator=(const Generating&) = delete;

  template <typename Body>
  auto run(Body body) {
    std::lock_guard<std::mutex> guard(model_->run);
    struct Mark {
      OpenModel& model;
      explicit Mark(OpenModel& m) : model(m) { handles().mark_generating(model, true); }
      ~Mark() { handles().mark_generating(model, false); }
    } mark(*model_);
    return body(*model_->engine);
  }

 private:
  std::shared_ptr<OpenModel> model_;
};

}  // namespace mirrorsd
