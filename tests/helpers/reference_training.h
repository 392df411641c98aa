// Training a wrapped TinyLM against its unwrapped single-process reference, the check the runtime
// tests share: each rank steps on its rows of a batch, the reference on the whole batch, and the
// full parameters must then agree to float32 rounding.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "tiny_lm.h"

namespace fsdp {
namespace testing {

/// One data-parallel step against its single-process reference: `model` trains on this rank's
/// `rows` rows of `idx` (rank r takes rows [r * rows, (r + 1) * rows)), `ref` on all of them.
inline void step_with_reference(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                                TinyLM& ref, torch::optim::Optimizer& ref_opt,
                                const torch::Tensor& idx, int rank, int64_t rows) {
  const torch::Tensor local = idx.narrow(0, rows * rank, rows);
  opt.zero_grad();
  lm_loss(model->forward(local), local).backward();
  opt.step();
  ref_opt.zero_grad();
  lm_loss(ref->forward(idx), idx).backward();
  ref_opt.step();
}

/// Every parameter of `ref` matches its full value in `got` (full_params) to float32 rounding.
inline void expect_params_close(const std::map<std::string, torch::Tensor>& got, TinyLM& ref,
                                const std::string& what = "") {
  for (const auto& p : ref->named_parameters()) {
    const torch::Tensor& v = got.at(p.key());
    EXPECT_TRUE(torch::allclose(v.cpu(), p.value().cpu(), 1e-5, 1e-6))
        << what << " " << p.key() << " max diff "
        << (v.cpu() - p.value().cpu()).abs().max().item<float>();
  }
}

}  // namespace testing
}  // namespace fsdp
