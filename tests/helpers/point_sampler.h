// Which fault-injection points an enumerating test visits.
//
// ErrorPoints and CollectiveFailures inject a failure at every I/O call or collective of a
// workflow, one run per point. Most neighbouring points take the same code path (the 40th
// broadcast of a state-dict broadcast fails exactly as the 39th does), and under the sanitizers
// each run costs 3-5 times what it costs in a plain build. scripts/sanitize.sh therefore sets
// FSDP_TEST_POINT_STRIDE=N: a sampler then visits the first point of every label (the call's
// name and the injected fault: every distinct code path) and every Nth point besides. Without
// the variable (the plain builds, `sanitize.sh --all`) every point is visited, but for the
// enumerations that set their own stride (the node-local crash points: thousands of states, each
// restart a collective load and save across two hosts).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>

namespace fsdp {
namespace testing {

class PointSampler {
 public:
  /// `stride`: the test's own default, where visiting every point costs minutes. The variable,
  /// where set, samples at least as sparsely (the larger of the two), and 1 visits every point.
  explicit PointSampler(long stride = 1) : stride_(std::max(1L, stride)) {
    const char* env = std::getenv("FSDP_TEST_POINT_STRIDE");
    if (env == nullptr || *env == '\0') return;
    const long wanted = std::max(1L, std::strtol(env, nullptr, 10));
    stride_ = wanted == 1 ? 1 : std::max(stride_, wanted);
  }

  /// Called once per point, in the enumeration's order (the same on every rank): whether to
  /// visit it.
  bool take(const std::string& label) {
    const long index = seen_++;
    const bool first_of_label = labels_.insert(label).second;
    const bool taken = stride_ <= 1 || first_of_label || index % stride_ == 0;
    taken_ += taken;
    return taken;
  }

  long stride() const { return stride_; }
  long seen() const { return seen_; }
  long taken() const { return taken_; }
  /// "" when every point was visited, else how many were, for the test's summary line.
  std::string note() const {
    if (taken_ == seen_) return "";
    return " (sampled: " + std::to_string(taken_) + " of " + std::to_string(seen_) +
           " points, FSDP_TEST_POINT_STRIDE=" + std::to_string(stride_) + ")";
  }

 private:
  long stride_ = 1;
  long seen_ = 0;
  long taken_ = 0;
  std::set<std::string> labels_;
};

}  // namespace testing
}  // namespace fsdp
