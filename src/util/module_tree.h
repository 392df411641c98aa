// Internal: names in a module tree, as the wrapper (runtime/) and flattening (flat_param/) walk
// it: which modules and parameters lie under which module, so that both skip an ignored module's
// subtree by the same rule; and its parameters each once.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace fsdp {
namespace detail {

/// Whether the module or parameter named `fqn` is the module named `root` or lies under it.
/// Everything lies under the root module, "".
inline bool under(const std::string& fqn, const std::string& root) {
  return root.empty() || fqn == root || fqn.rfind(root + ".", 0) == 0;
}

/// Whether `fqn` lies under any of `roots` (e.g. the names of the ignored modules).
inline bool under_any(const std::string& fqn, const std::vector<std::string>& roots) {
  for (const auto& r : roots) {
    if (under(fqn, r)) return true;
  }
  return false;
}

/// `module`'s parameters in its order, each tensor once. Module::parameters() lists a weight tied
/// between two submodules under both, yet it is one tensor to broadcast, count or fill.
inline std::vector<at::Tensor> distinct_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace detail
}  // namespace fsdp
