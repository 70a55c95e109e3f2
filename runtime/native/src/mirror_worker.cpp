#include "mirror_worker.hpp"

#include <algorithm>
#include <chrono>
#include <limits>

namespace mirrorsd {
namespace {

// Appends the padding row g of a window's top-k (filled later by the extend forward).
void pad_row(std::vector<int64_t>& ids, std::vector<float>& logprobs, int64_t k) {
  ids.insert(ids.end(), static_cast<size_t>(k), 0);
  logprobs.insert(logprobs.end(), static_cast<size_t>(k), -std::numeric_limits<float>::infinity());
}

Reply failure(Code code, const std::string& error) {
  Reply reply;
  reply.failed = true;
  reply.code = code;
  reply.error = error;
  return reply;
}

}  // namespace

DraftWorker::~DraftWorker() { join(); }

void DraftWorker::start() { thread_ = std::thread([this] { body(); }); }

void DraftWorker::join() {
  if (thread_.joinable()) thread_.join();
}

bool DraftWorker::wait_exit(double seconds) {
  std::unique_lock<std::mutex> guard(exit_lock_);
  if (!(seconds < settings::kDraftTimeoutNeverS)) {  // no limit (see Mailbox::get_for)
    exited_cv_.wait(guard, [this] { return exited_; });
    return true;
  }
  return exited_cv_.wait_for(guard, std::chrono::duration<double>(seconds), [this] { return exited_; });
}

void DraftWorker::body() {
  try {
    Message message = inbox.get();
    while (!std::holds_alternative<StopMsg>(message)) message = serve(std::move(message));
  } catch (const Error& e) {  // every failure must reach the caller
    outbox.put(failure(e.code(), e.what()));
  } catch (const std::exception& e) {
    outbox.put(failure(Code::Internal, e.what()));
  }
  {
    std::lock_guard<std::mutex> guard(exit_lock_);
    exited_ = true;
  }
  exited_cv_.notify_all();
}

// Handle one request; return the next message to handle (speculation consumes messages itself).
Message DraftWorker::serve(Message message) {
  if (auto* prefill = std::get_if<PrefillMsg>(&message)) {
    committed_ = prefill->tokens;
    draft_.reset();
    const std::vector<int64_t> pending = draft_.sync_to(committed_);
    if (!pending.empty()) draft_.prefill(pending);
    return inbox.get();
  }
  if (auto* propose = std::get_if<ProposeMsg>(&message)) {
    committed_ = propose->committed;
    Window window = fresh(propose->gamma);
    bool reused = false;
    while (true) {
      deliver(window, reused);
      Message next = speculate(window);
      const auto* verdict = std::get_if<VerdictMsg>(&next);
      if (verdict == nullptr) return next;
      window = next_window(window, *verdict, reused);
    }
  }
  return inbox.get();  // a stale exit message
}

DraftWorker::Window DraftWorker::fresh(int gamma) {
  const int64_t k = settings_.runner_up_k;
  rollout::Rollout rollout = rollout::fresh(draft_, committed_, gamma, k);
  forwards_since_verdict_ += rollout.forwards;
  Window window{std::move(rollout.tokens), std::move(rollout.top_ids), std::move(rollout.top_logprobs),
                static_cast<int64_t>(committed_.size())};
  pad_row(window.top_ids, window.top_logprobs, k);
  return window;
}

void DraftWorker::deliver(const Window& window, bool reused) {
  Reply reply;
  reply.proposal = Proposal{window.tokens, reused, forwards_since_verdict_};
  outbox.put(std::move(reply));
  forwards_since_verdict_ = 0;
}

// Apply a verdict: adopt the branch it hits if that one is ready, else draft afresh.
DraftWorker::Window DraftWorker::next_window(const Window& window, const VerdictMsg& message, bool& reused) {
  const Verdict& verdict = message.verdict;
  acceptance_.update(verdict);
  committed_.insert(committed_.end(), message.new_tokens.begin(), message.new_tokens.end());
  auto hit = ready_.find(verdict.branch());
  std::optional<Ready> ready;
  if (hit != ready_.end()) ready = std::move(hit->second);
  ready_.clear();
  const size_t g = static_cast<size_t>(message.gamma);
  if (ready && ready->rolled->tokens[ready->row].size() >= g) {
    const int64_t k = settings_.runner_up_k;
    const int64_t keep = window.base_length + verdict.accepted;  // committed + accepted window tokens
    rollout::adopt(draft_, *ready->rolled, ready->row, keep, verdict.correction, g);
    const std::vector<int64_t>& tokens = ready->rolled->tokens[ready->row];
    const std::vector<int64_t>& top_ids = ready->rolled->top_ids[ready->row];
    const std::vector<float>& top_logprobs = ready->rolled->top_logprobs[ready->row];
    Window next{std::vector<int64_t>(tokens.begin(), tokens.begin() + g),
                std::vector<int64_t>(top_ids.begin(), top_ids.begin() + g * k),
                std::vector<float>(top_logprobs.begin(), top_logprobs.begin() + g * k),
                static_cast<int64_t>(committed_.size())};
    pad_row(next.top_ids, next.top_logprobs, k);
    reused = true;
    return next;
  }
  reused = false;
  return fresh(message.gamma);
}

// Roll out branches of `window` until a verdict (or Stop) must be answered; return that message.
Message DraftWorker::speculate(Window& window) {
  ready_.clear();
  const bool cap = settings_.branch_budget == settings::BranchBudget::Cap;
  const size_t g = window.tokens.size();
  std::optional<ExitMsg> exit_msg;
  std::optional<Message> held;
  bool extended = false;
  std::set<Key> spent;
  std::optional<Message> message = inbox.poll();
  while (true) {
    if (message) {
      if (auto* exit = std::get_if<ExitMsg>(&*message)) {
        if (exit->ids.size() == (g + 1) * static_cast<size_t>(exit->k)) exit_msg = std::move(*exit);
      } else if (cap && std::holds_alternative<VerdictMsg>(*message)) {
        held = std::move(message);
      } else {
        return std::move(*message);
      }
      message.reset();
    }
    if (!extended) {
      extend_last(window);
      extended = true;
      message = inbox.poll();
      continue;
    }
    std::vector<Branch> batch;
    if (static_cast<int>(spent.size()) < settings_.branches) {
      const size_t room = static_cast<size_t>(
          std::min<int>(settings_.branch_batch, settings_.branches - static_cast<int>(spent.size())));
      const Candidates own{window.top_ids.data(), window.top_logprobs.data(), settings_.runner_up_k};
      Candidates exit;
      if (exit_msg) exit = Candidates{exit_msg->ids.data(), exit_msg->logprobs.data(), exit_msg->k};
      batch = rank_branches(window.tokens, own, exit_msg ? &exit : nullptr, acceptance_.rate(), spent, room);
    }
    if (!batch.empty()) {
      for (const Branch& b : batch) spent.insert({b.depth, b.token});
      message = roll_out(window, batch, !cap);
    } else if (held) {
      return std::move(*held);
    } else {
      message = inbox.get();  // nothing left worth doing: block until told
    }
  }
}

// One forward on the window's last token: the draft's own candidates after a fully accepted window. The main cache
// holds exactly committed + window[:-1] here (fresh rollout or adopted branch).
void DraftWorker::extend_last(Window& window) {
  const int64_t k = settings_.runner_up_k, g = static_cast<int64_t>(window.tokens.size());
  Rows logits = draft_.extend({window.tokens.back()});
  ++forwards_since_verdict_;
  top_k_logprobs(logits.row(logits.rows - 1), 1, logits.width, k, &window.top_ids[g * k],
                 &window.top_logprobs[g * k]);
}

// Poll between forwards; true (stop) when the verdict wants a branch outside `batch`, or on Stop.
bool DraftWorker::after_forward(const std::vector<Branch>& batch, std::optional<Message>& message, bool abandon) {
  if (message) return false;
  message = inbox.poll();
  if (!message) return false;
  if (const auto* verdict = std::get_if<VerdictMsg>(&*message)) {
    if (!abandon) return false;
    const Key wanted = verdict->verdict.branch();
    return std::none_of(batch.begin(), batch.end(), [&](const Branch& b) { return Key{b.depth, b.token} == wanted; });
  }
  return !std::holds_alternative<ExitMsg>(*message);
}

// Roll out `batch` branches together (rollout::branches), polling the inbox between forwards; a complete batch's
// rows become ready branches. Returns a message that arrived meanwhile.
std::optional<Message> DraftWorker::roll_out(const Window& window, const std::vector<Branch>& batch, bool abandon) {
  std::optional<Message> message;
  auto rolled = std::make_shared<const rollout::Branches>(rollout::branches(
      draft_, window.base_length, static_cast<int64_t>(window.tokens.size()), batch, settings_.runner_up_k, [&] {
        ++forwards_since_verdict_;
        return after_forward(batch, message, abandon);
      }));
  if (!rolled->complete) return message;
  const int64_t rows = static_cast<int64_t>(batch.size());
  branches += rows;
  for (int64_t r = 0; r < rows; ++r) ready_[{batch[r].depth, batch[r].token}] = Ready{rolled, r};
  return message;
}

}  // namespace mirrorsd
