#include "handles.hpp"

#include "errors.hpp"

namespace mirrorsd {

Handles& handles() {
  static Handles* registry = new Handles;  // deliberately leaked: usable from any thread until the process ends
  return *registry;
}

mirrorsd_model* Handles::add(std::unique_ptr<Engine> engine) {
  auto model = std::make_shared<OpenModel>(std::move(engine));
  std::lock_guard<std::mutex> guard(lock_);
  const uintptr_t handle = ++issued_;  // never reused, never 0
  open_.emplace(handle, std::move(model));
  return reinterpret_cast<mirrorsd_model*>(handle);
}

std::shared_ptr<OpenModel> Handles::lookup(const mirrorsd_model* handle, const char* call) {
  if (handle == nullptr)
    throw Error(Code::InvalidArgument, "model is NULL", std::string(call) + " needs an opened model",
                "call mirrorsd_open first");
  auto found = open_.find(reinterpret_cast<uintptr_t>(handle));
  if (found == open_.end())
    throw Error(Code::InvalidArgument, std::string(call) + " got a model handle that is not open",
                "it was closed already, or it never came from mirrorsd_open",
                "open the folder again with mirrorsd_open and use the handle it returns");
  return found->second;
}

std::shared_ptr<OpenModel> Handles::find(const mirrorsd_model* handle, const char* call) {
  std::lock_guard<std::mutex> guard(lock_);
  return lookup(handle, call);
}

std::shared_ptr<OpenModel> Handles::enter(const mirrorsd_model* handle) {
  std::lock_guard<std::mutex> guard(lock_);
  std::shared_ptr<OpenModel> model = lookup(handle, "mirrorsd_generate");
  if (model->generating == std::this_thread::get_id())
    throw Error(Code::Busy, "mirrorsd_generate was called from inside the same model's on_token callback",
                "the model is generating, and a second generation would wait for the first, which waits for the "
                "callback to return",
                "return from the callback first (non-zero stops the generation), then call mirrorsd_generate again");
  ++model->calls;
  return model;
}

void Handles::leave(OpenModel& model) {
  std::lock_guard<std::mutex> guard(lock_);
  --model.calls;
}

void Handles::mark_generating(OpenModel& model, bool generating) {
  std::lock_guard<std::mutex> guard(lock_);
  model.generating = generating ? std::this_thread::get_id() : std::thread::id();
}

void Handles::close(mirrorsd_model* handle) {
  std::shared_ptr<OpenModel> model;
  {
    std::lock_guard<std::mutex> guard(lock_);
    model = lookup(handle, "mirrorsd_close");
    if (model->generating == std::this_thread::get_id())
      throw Error(Code::Busy, "mirrorsd_close was called from inside the same model's on_token callback",
                  "the generation that called the callback still uses the model",
                  "return non-zero from the callback to stop, and close the model after mirrorsd_generate returns");
    if (model->calls > 0)
      throw Error(Code::Busy, "mirrorsd_close was called while another thread generates with the model",
                  "closing it would free what that generation still uses",
                  "close the model after every mirrorsd_generate on it has returned");
    open_.erase(reinterpret_cast<uintptr_t>(handle));
  }
  model.reset();  // the engine goes here, outside the lock (it joins the Mirror-SD worker)
}

}  // namespace mirrorsd
