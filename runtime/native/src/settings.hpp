// Bounds of the generation settings, as runtime/config.py checks them.
#pragma once

namespace mirrorsd::settings {

constexpr int kCountMin = 1;  // max_new_tokens, gamma, branches, branch_batch, runner_up_k
constexpr double kDraftTimeoutNeverS = 1e9;  // a draft_timeout_s at or above this waits without a limit

}  // namespace mirrorsd::settings
