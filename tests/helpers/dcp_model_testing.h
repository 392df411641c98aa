// Shared by the DCP checkpoint tests of a wrapped model: two training steps to save, the load a
// resuming trainer makes, and a rank-0 reference of the full state to compare a load with.
#pragma once

#include <string>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "optim_testing.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

namespace fsdp {
namespace testing {
// Two Adam steps of a wrapped TinyLM on rank-specific tokens; returns {"model", "optim"} as
// get_state_dict gives them (SHARDED). `on_gather` watches get_state_dict's gathers.
inline StateDict train_two_steps(fsdp::FullyShardedDataParallel& model,
                                 torch::optim::Optimizer& opt, int rank,
                                 fsdp::GatherObserver on_gather = {}) {
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    auto idx = fsdp::testing::lm_tokens(2, 1000 * s + rank);
    fsdp::testing::lm_loss(model->forward(idx), idx).backward();
    opt.step();
  }
  auto [msd, osd] = checkpoint::get_state_dict(
      model, opt, checkpoint::StateDictOptions().on_gather(std::move(on_gather)));
  StateDict sd;
  sd.insert_or_assign("model", msd);
  sd.insert_or_assign("optim", osd);
  return sd;
}

// Loads checkpoint `dir` into `model` and `opt` through the unified API, as a resuming trainer
// does: the model's own state dict (any wrapping, world size, layout) is the template.
template <typename M>
void load_checkpoint(M& model, torch::optim::Optimizer& opt, const std::string& dir,
                     const checkpoint::LoadOptions& options = {}) {
  auto [msd, osd] = checkpoint::get_state_dict(model, opt);
  StateDict sd;
  sd.insert_or_assign("model", msd);
  sd.insert_or_assign("optim", osd);
  checkpoint::load(sd, dir, options);
  checkpoint::set_state_dict(model, opt, sd.at("model").dict(), sd.at("optim").dict());
}

// Rank 0 saves the model's and optimizer's full state into `ref` (collective).
template <typename M>
void save_reference_state(M& model, torch::optim::Optimizer& opt, const std::string& ref,
                          int rank) {
  auto [fm, fo] =
      checkpoint::get_state_dict(model, opt, checkpoint::StateDictOptions().full_state_dict(true));
  if (rank != 0) return;
  fsdp::testing::save_pieces(fm, 0, ref, "m_");
  fsdp::testing::save_osd(fo, 0, ref);
}

// The model's and optimizer's full state equal the reference save_reference_state wrote.
template <typename M>
void expect_reference_state(M& model, torch::optim::Optimizer& opt, const std::string& ref,
                            const std::string& what) {
  auto [fm, fo] =
      checkpoint::get_state_dict(model, opt, checkpoint::StateDictOptions().full_state_dict(true));
  fsdp::testing::expect_same(fm, fsdp::testing::load_pieces(1, ref, "m_"), what);
  EXPECT_EQ(fsdp::testing::osd_diff(fo, fsdp::testing::load_osd(1, ref), 0, 0), "") << what;
}

}  // namespace testing
}  // namespace fsdp
