// The check of PyTorch's _cpu_grad behaviour, shared by the CPU test (test_runtime_edges)
// and the GPU one (test_cuda): under offload every unit's sharded gradient is one CPU buffer kept
// for the unit's life (pinned when computing on a GPU); after zero_grad(set_to_none) the next
// backward writes into the same buffer, and training matches training without offload.
#pragma once

#include <gtest/gtest.h>

#include "tiny_lm.h"

namespace fsdp {
namespace testing {

inline void expect_offload_reuses_one_gradient_buffer(int rank, ShardingStrategy strategy,
                                                      const at::Device& device) {
  const bool gpu = device.is_cuda();
  auto options = [&](TinyLM& lm) {
    auto o = lm_options(lm, strategy);
    if (gpu) o.device_id(device);
    return o;
  };
  TinyLM m(46);
  TinyLM plain_m(46);
  FullyShardedDataParallel model(m,
                                 options(m).cpu_offload(fsdp::CPUOffload().offload_params(true)));
  FullyShardedDataParallel plain(plain_m, options(plain_m));
  torch::optim::SGD opt(model->parameters(), 0.5);
  torch::optim::SGD plain_opt(plain->parameters(), 0.5);
  const std::string what = fsdp::to_string(strategy);
  std::vector<at::Tensor> first;
  for (int step = 0; step < 3; ++step) {
    auto idx = lm_tokens(2, 47 + step + 5 * rank).to(device);
    zero_grad_set_to_none(opt);
    zero_grad_set_to_none(plain_opt);
    lm_loss(model->forward(idx), idx).backward();
    lm_loss(plain->forward(idx), idx).backward();
    size_t i = 0;
    for (auto* h : model->handles()) {
      if (h == nullptr || !h->flat_param().requires_grad()) continue;
      EXPECT_TRUE(h->flat_param().device().is_cpu()) << what;
      const at::Tensor g = h->flat_param().grad();
      ASSERT_TRUE(g.defined()) << what;
      EXPECT_TRUE(g.device().is_cpu()) << what;
      EXPECT_EQ(g.is_pinned(), gpu) << what;
      if (step == 0) {
        first.push_back(g);  // held: a fresh allocation could not reuse its memory
      } else {
        EXPECT_TRUE(g.is_same(first.at(i))) << what << " step " << step;
      }
      ++i;
    }
    EXPECT_FALSE(first.empty());
    opt.step();
    plain_opt.step();
  }
  const auto got = full_params(model);
  const auto want = full_params(plain);
  for (const auto& [k, v] : want) {
    // Bit-identical on the CPU; on a GPU the offloaded optimizer step runs on the CPU.
    const at::Tensor a = got.at(k).to(v.device());
    EXPECT_TRUE(gpu ? torch::allclose(a, v, 1e-6, 1e-7) : torch::equal(a, v)) << what << " " << k;
  }
}

}  // namespace testing
}  // namespace fsdp
