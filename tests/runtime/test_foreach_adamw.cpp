// fsdp::ForeachAdamW against LibTorch's own AdamW: the same parameters, gradients and options
// stepped by both must give bit-identical parameters and state (on the CPU every `_foreach_*`
// operation is the per-tensor one), including odd tensors (0-d, empty, one element), two groups
// with different options, weight decay off and on, amsgrad, and a parameter that skips steps (its
// own step count, so its own bias correction). The optimizer state dict PyTorch's API produces is
// the AdamW one. Negative control: a different learning rate in one group is told apart.
// AdamWKernel::kFused (ATen's `_fused_adamw_`, LibTorch 2.4 on) agrees with LibTorch's AdamW within
// float rounding on the same cases; before 2.4 asking for it is a ValueError that says why.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <vector>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/compat.h"
#include "fsdp/compat_optim.h"
#include "fsdp/errors.h"
#include "fsdp/foreach_adamw.h"

namespace {

namespace to = torch::optim;

std::vector<at::Tensor> make_params() {
  torch::manual_seed(3);
  std::vector<at::Tensor> ps = {torch::randn({7, 3}), torch::randn({}), torch::randn({0}),
                                torch::randn({1}), torch::randn({5})};
  for (auto& p : ps) p.set_requires_grad(true);
  return ps;
}

std::vector<to::OptimizerParamGroup> groups_of(const std::vector<at::Tensor>& ps, double lr2,
                                               bool amsgrad) {
  std::vector<to::OptimizerParamGroup> g;
  g.emplace_back(std::vector<at::Tensor>{ps[0], ps[1], ps[2]},
                 std::make_unique<to::AdamWOptions>(
                     to::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1).amsgrad(amsgrad)));
  g.emplace_back(std::vector<at::Tensor>{ps[3], ps[4]},
                 std::make_unique<to::AdamWOptions>(
                     to::AdamWOptions(lr2).weight_decay(0).eps(1e-6).amsgrad(amsgrad)));
  return g;
}

// Steps `opt` 6 times over `ps` with gradients drawn from a fixed seed; ps[4] has no gradient at
// steps 2 and 3, so it ends two steps behind the others.
void train(to::Optimizer& opt, std::vector<at::Tensor>& ps) {
  torch::manual_seed(11);
  for (int s = 0; s < 6; ++s) {
    opt.zero_grad();
    for (size_t i = 0; i < ps.size(); ++i) {
      // No gradient at all (1.13's zero_grad() keeps zeroed ones, 2.x's drops them).
      const bool skip = i == 4 && (s == 2 || s == 3);
      ps[i].mutable_grad() = skip ? at::Tensor() : torch::randn(ps[i].sizes());
    }
    opt.step();
  }
}

void expect_same(to::Optimizer& a, const std::vector<at::Tensor>& pa, to::Optimizer& b,
                 const std::vector<at::Tensor>& pb) {
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
    auto& sa =
        static_cast<to::AdamWParamState&>(*a.state().at(fsdp::compat::optim_state_key(pa[i])));
    auto& sb =
        static_cast<to::AdamWParamState&>(*b.state().at(fsdp::compat::optim_state_key(pb[i])));
    EXPECT_EQ(sa.step(), sb.step()) << i;
    EXPECT_TRUE(torch::equal(sa.exp_avg(), sb.exp_avg())) << i;
    EXPECT_TRUE(torch::equal(sa.exp_avg_sq(), sb.exp_avg_sq())) << i;
    EXPECT_EQ(sa.max_exp_avg_sq().defined(), sb.max_exp_avg_sq().defined()) << i;
    if (sa.max_exp_avg_sq().defined()) {
      EXPECT_TRUE(torch::equal(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())) << i;
    }
  }
}

TEST(ForeachAdamW, StepsBitForBitAsLibTorchsAdamW) {
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adamw");
    auto pa = make_params(), pb = make_params();
    to::AdamW reference(groups_of(pa, 3e-2, amsgrad));
    fsdp::ForeachAdamW foreach (groups_of(pb, 3e-2, amsgrad));
    train(reference, pa);
    train(foreach, pb);
    expect_same(reference, pa, foreach, pb);
    auto& s4 = static_cast<to::AdamWParamState&>(
        *foreach.state().at(fsdp::compat::optim_state_key(pb[4])));
    EXPECT_EQ(s4.step(), 4);  // the parameter that skipped two steps
    EXPECT_FALSE(torch::equal(pb[0], make_params()[0])) << "the step should move the parameters";
  }
  // Negative control: the second group's learning rate differs, and the comparison sees it.
  auto pa = make_params(), pb = make_params();
  to::AdamW reference(groups_of(pa, 3e-2, false));
  fsdp::ForeachAdamW other(groups_of(pb, 3.1e-2, false));
  train(reference, pa);
  train(other, pb);
  EXPECT_TRUE(torch::equal(pa[0], pb[0]));
  EXPECT_FALSE(torch::equal(pa[4], pb[4]));
}

// Within float rounding: the fused kernel computes the first moment as a lerp and the bias
// corrections in float, so bits differ; 6 steps of unit-sized gradients stay within 1e-5.
bool close(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && torch::allclose(a, b, /*rtol=*/1e-5, /*atol=*/1e-6);
}

void expect_close(to::Optimizer& a, const std::vector<at::Tensor>& pa, to::Optimizer& b,
                  const std::vector<at::Tensor>& pb) {
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(close(pa[i], pb[i])) << "parameter " << i << "\n" << pa[i] << "\n" << pb[i];
    auto& sa =
        static_cast<to::AdamWParamState&>(*a.state().at(fsdp::compat::optim_state_key(pa[i])));
    auto& sb =
        static_cast<to::AdamWParamState&>(*b.state().at(fsdp::compat::optim_state_key(pb[i])));
    EXPECT_EQ(sa.step(), sb.step()) << i;
    EXPECT_TRUE(close(sa.exp_avg(), sb.exp_avg())) << i;
    EXPECT_TRUE(close(sa.exp_avg_sq(), sb.exp_avg_sq())) << i;
    if (sa.max_exp_avg_sq().defined()) {
      EXPECT_TRUE(close(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())) << i;
    }
  }
}

TEST(ForeachAdamW, FusedStepsAsLibTorchsAdamWWithinRounding) {
  if (!fsdp::compat::kHasFusedAdamW) {
    auto ps = make_params();
    try {
      fsdp::ForeachAdamW opt(groups_of(ps, 3e-2, false), {}, fsdp::AdamWKernel::kFused);
      ADD_FAILURE() << "expected a ValueError: this LibTorch has no _fused_adamw_";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("needs LibTorch 2.4 or later"), std::string::npos)
          << e.what();
    }
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no _fused_adamw_ (2.4 on); its refusal "
                 << "was checked";
  }
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adamw");
    auto pa = make_params(), pb = make_params();
    to::AdamW reference(groups_of(pa, 3e-2, amsgrad));
    fsdp::ForeachAdamW fused(groups_of(pb, 3e-2, amsgrad), {}, fsdp::AdamWKernel::kFused);
    EXPECT_EQ(fused.kernel(), fsdp::AdamWKernel::kFused);
    train(reference, pa);
    train(fused, pb);
    expect_close(reference, pa, fused, pb);
    EXPECT_FALSE(torch::equal(pb[0], make_params()[0])) << "the step should move the parameters";
  }
  // Negative control: a 1% different learning rate in the second group is outside the tolerance.
  auto pa = make_params(), pb = make_params();
  to::AdamW reference(groups_of(pa, 3e-2, false));
  fsdp::ForeachAdamW other(groups_of(pb, 3.03e-2, false), {}, fsdp::AdamWKernel::kFused);
  train(reference, pa);
  train(other, pb);
  EXPECT_TRUE(close(pa[0], pb[0]));
  EXPECT_FALSE(close(pa[4], pb[4]));
}

// A sparse gradient is refused as LibTorch's AdamW refuses it, as a ValueError naming the
// parameter and its group.
TEST(ForeachAdamW, ASparseGradientIsAValueErrorNamingTheParameter) {
  auto ps = make_params();
  fsdp::ForeachAdamW opt(groups_of(ps, 3e-2, false));
  ps[3].mutable_grad() = torch::ones({1}).to_sparse();
  try {
    opt.step();
    ADD_FAILURE() << "expected a ValueError";
  } catch (const fsdp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 0 of group 1 has a sparse gradient"),
              std::string::npos)
        << e.what();
  }
}

// The optimizer state dict (PyTorch's get_state_dict, a plain module) of a ForeachAdamW is that of
// an AdamW stepped the same way: same keys, values and hyperparameters.
TEST(ForeachAdamW, ItsStateDictIsAnAdamWs) {
  auto run = [](bool foreach) {
    torch::manual_seed(5);
    torch::nn::Linear model(4, 3);
    const auto opts = to::AdamWOptions(1e-2).weight_decay(0.05);
    std::unique_ptr<to::Optimizer> opt;
    if (foreach) {
      opt = std::make_unique<fsdp::ForeachAdamW>(model->parameters(), opts);
    } else {
      opt = std::make_unique<to::AdamW>(model->parameters(), opts);
    }
    for (int s = 0; s < 3; ++s) {
      opt->zero_grad();
      model(torch::randn({2, 4})).pow(2).sum().backward();
      opt->step();
    }
    return fsdp::checkpoint::get_optimizer_state_dict(*model, *opt);
  };
  const fsdp::StateDict a = run(false), b = run(true);
  ASSERT_EQ(a.keys(), b.keys());
  const fsdp::StateDict& sa = a.at("state").dict();
  const fsdp::StateDict& sb = b.at("state").dict();
  ASSERT_EQ(sa.keys(), sb.keys());
  for (const auto& [name, per_param] : sa) {
    for (const auto& [k, v] : per_param.dict())
      EXPECT_TRUE(torch::equal(v.tensor(), sb.at(name).dict().at(k).tensor())) << name << "." << k;
  }
  EXPECT_EQ(a.at("param_groups").list().size(), b.at("param_groups").list().size());
  EXPECT_EQ(a.at("param_groups").list()[0].dict().at("weight_decay").to_double(), 0.05);
  EXPECT_EQ(b.at("param_groups").list()[0].dict().at("weight_decay").to_double(), 0.05);
}

}  // namespace
