// The CUDA path: models on a GPU, over NCCL or over Gloo, checked against one process on the same
// GPU. These tests need a GPU and a LibTorch built with CUDA; they run only when FSDP_TEST_CUDA=1
// (scripts/gpu-check.sh sets it), because the parent process must not touch CUDA before the
// harness forks the ranks, so it cannot probe for a GPU itself. Elsewhere they are skipped.
//
// FSDP_TEST_BACKEND picks the backend (multi_rank.h). On a machine with one GPU every rank uses
// cuda:0; NCCL then runs over its socket transport (see multi_rank.cpp).
#include <gtest/gtest.h>

#include <cstdlib>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "fsdp/state_dict_utils.h"
#include "multi_rank.h"
#include "offload_testing.h"
#include "reference_training.h"
#include "tiny_lm.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::expect_params_close;
using fsdp::testing::full_params;
using fsdp::testing::lm_loss;
using fsdp::testing::lm_options;
using fsdp::testing::lm_tokens;
using fsdp::testing::run_ranks;
using fsdp::testing::step_with_reference;
using fsdp::testing::TinyLM;
using fsdp::testing::unique_params;

namespace {

const at::Device kGpu(at::kCUDA, 0);

#define FSDP_REQUIRE_CUDA()                                                            \
  do {                                                                                 \
    const char* on = std::getenv("FSDP_TEST_CUDA");                                    \
    if (on == nullptr || std::string(on) != "1") {                                     \
      GTEST_SKIP() << "needs a GPU: run with FSDP_TEST_CUDA=1 (scripts/gpu-check.sh)"; \
    }                                                                                  \
  } while (0)

void require_gpu_in_rank() {
  if (!torch::cuda::is_available()) throw std::runtime_error("FSDP_TEST_CUDA=1 but no GPU");
}

}  // namespace

// Every collective takes tensors on any device: CPU metadata goes through the GPU under NCCL,
// CUDA tensors through the CPU under Gloo (ProcessGroup::device()).
TEST(Cuda, CollectivesStageTensorsThroughTheGroupDevice) {
  FSDP_REQUIRE_CUDA();
  run_ranks(2, [](ProcessGroup& pg) {
    require_gpu_in_rank();
    const bool nccl = pg.backend_name() == "nccl";
    EXPECT_EQ(pg.device(), nccl ? kGpu : at::Device(at::kCPU));
    const int r = pg.rank();
    for (const at::Device dev : {at::Device(at::kCPU), kGpu}) {
      const auto opts = at::TensorOptions().device(dev);
      at::Tensor t = at::full({3}, r + 1.0, opts);
      pg.all_reduce(t);
      EXPECT_EQ(t.device(), dev);
      EXPECT_TRUE(torch::equal(t.cpu(), at::full({3}, 3.0))) << dev;

      at::Tensor in = at::arange(4, opts.dtype(at::kFloat)) + 10 * r;
      at::Tensor all = at::empty({8}, opts);
      pg.all_gather_into_tensor(all, in);
      EXPECT_TRUE(torch::equal(all.cpu(), at::cat({at::arange(4.0), at::arange(4.0) + 10})));

      at::Tensor out = at::empty({2}, at::TensorOptions().device(at::kCPU));  // mixed devices
      pg.reduce_scatter_tensor(out, at::arange(4, opts.dtype(at::kFloat)));
      EXPECT_TRUE(torch::equal(out, (at::arange(2.0) + 2 * r) * 2));

      at::Tensor b = at::full({2}, r == 1 ? 7.0 : 0.0, opts);
      pg.broadcast(b, 1);
      EXPECT_TRUE(torch::equal(b.cpu(), at::full({2}, 7.0)));

      at::Tensor a2a_in = at::arange(2, opts.dtype(at::kLong)) + 2 * r;
      at::Tensor a2a_out = at::empty({2}, opts.dtype(at::kLong));
      pg.all_to_all_single(a2a_out, a2a_in, {}, {});
      EXPECT_TRUE(torch::equal(a2a_out.cpu(), at::tensor({int64_t{r}, int64_t{2 + r}})));
    }
    const auto names = pg.all_gather_bytes(std::string(static_cast<size_t>(3 + 5 * r), 'a' + r));
    ASSERT_EQ(names.size(), 2u);
    EXPECT_EQ(names[0], "aaa");
    EXPECT_EQ(names[1], "bbbbbbbb");
    EXPECT_EQ(pg.broadcast_bytes(r == 1 ? "from one" : "", 1), "from one");
  });
}

// Training on the GPU, each strategy with and without use_orig_params: a model built on the CPU
// moves to device_id, and two SGD steps equal one process on the whole batch on the same GPU.
TEST(Cuda, TrainingMatchesOneProcessOnTheGpu) {
  FSDP_REQUIRE_CUDA();
  run_ranks(2, [](ProcessGroup& pg) {
    require_gpu_in_rank();
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                          ShardingStrategy::NO_SHARD}) {
      for (bool orig : {false, true}) {
        const std::string what =
            std::string(fsdp::to_string(strategy)) + (orig ? " use_orig_params" : "");
        TinyLM m(51);
        TinyLM ref(51);
        ref->to(kGpu);
        FullyShardedDataParallel model(m, lm_options(m, strategy, orig).device_id(kGpu));
        EXPECT_EQ(m->scale.device(), kGpu) << what << ": buffers move to device_id";
        for (auto* h : model->handles()) {
          if (h != nullptr) {
            EXPECT_EQ(h->flat_param().device(), kGpu) << what;
          }
        }
        torch::optim::SGD opt(unique_params(model->parameters()), 0.5);
        torch::optim::SGD ref_opt(unique_params(ref->parameters()), 0.5);
        for (int step = 0; step < 2; ++step) {
          step_with_reference(model, opt, ref, ref_opt, lm_tokens(4, 52 + step).to(kGpu), pg.rank(),
                              2);
        }
        const auto got = full_params(model);
        for (const auto& [k, v] : got) EXPECT_EQ(v.device(), kGpu) << what << " " << k;
        expect_params_close(got, ref, what);
      }
    }
  });
}

// CPU offload with a GPU compute device: the shard and its gradient live on the CPU, the gradient
// in one pinned buffer reused every step (PyTorch's _cpu_grad), and training matches the same
// model without offload.
TEST(Cuda, OffloadKeepsOnePinnedGradientBufferOnTheCpu) {
  FSDP_REQUIRE_CUDA();
  run_ranks(2, [](ProcessGroup& pg) {
    require_gpu_in_rank();
    fsdp::testing::expect_offload_reuses_one_gradient_buffer(pg.rank(),
                                                             ShardingStrategy::FULL_SHARD, kGpu);
  });
}

// PyTorch's _check_on_compute_device: flat parameters moved off the GPU after wrapping (here by
// Module::to) are reported by device at the next unshard, instead of failing inside a collective.
TEST(Cuda, FlatParameterMovedOffItsDeviceIsReported) {
  FSDP_REQUIRE_CUDA();
  run_ranks(2, [](ProcessGroup&) {
    require_gpu_in_rank();
    TinyLM m(55);
    FullyShardedDataParallel model(m, lm_options(m).device_id(kGpu));
    model->to(at::kCPU);
    auto idx = lm_tokens(2, 56).to(kGpu);
    try {
      model->forward(idx);
      ADD_FAILURE() << "forward ran on flat parameters moved to the CPU";
    } catch (const fsdp::StateError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("is on cpu but its compute device is cuda:0"), std::string::npos) << msg;
    }
  });
}

// State dicts and a DCP checkpoint of a GPU model: the sharded model and Adam state saved at W=2
// load into a freshly initialised GPU model bit-exactly, and the FULL state dict agrees.
TEST(Cuda, CheckpointOfAGpuModelRoundTrips) {
  FSDP_REQUIRE_CUDA();
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  run_ranks(2, [&dir](ProcessGroup& pg) {
    require_gpu_in_rank();
    auto train = [&](FullyShardedDataParallel& model, torch::optim::Optimizer& opt) {
      for (int s = 0; s < 2; ++s) {
        opt.zero_grad();
        auto idx = lm_tokens(2, 57 + 10 * s + pg.rank()).to(kGpu);
        lm_loss(model->forward(idx), idx).backward();
        opt.step();
      }
    };
    auto both = [](FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                   const ckpt::StateDictOptions& o) {
      auto [msd, osd] = ckpt::get_state_dict(model, opt, o);
      fsdp::StateDict sd;
      sd.insert_or_assign("model", msd);
      sd.insert_or_assign("optim", osd);
      return sd;
    };
    TinyLM m(58);
    FullyShardedDataParallel model(
        m, lm_options(m, ShardingStrategy::FULL_SHARD, true).device_id(kGpu));
    torch::optim::Adam opt(unique_params(model->parameters()), 0.01);
    train(model, opt);
    ckpt::save(both(model, opt, {}), dir);
    const auto full = both(model, opt, ckpt::StateDictOptions().full_state_dict(true));

    TinyLM m2(59);
    FullyShardedDataParallel model2(
        m2, lm_options(m2, ShardingStrategy::FULL_SHARD, true).device_id(kGpu));
    torch::optim::Adam opt2(unique_params(model2->parameters()), 0.01);
    train(model2, opt2);  // creates the Adam state the checkpoint overwrites
    auto sd = both(model2, opt2, {});
    ckpt::load(sd, dir);
    ckpt::set_state_dict(model2, opt2, sd.at("model").dict(), sd.at("optim").dict());
    const auto full2 = both(model2, opt2, ckpt::StateDictOptions().full_state_dict(true));
    if (pg.rank() == 0) {
      const auto& a = full.at("model").dict();
      const auto& b = full2.at("model").dict();
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [k, v] : a) {
        EXPECT_TRUE(torch::equal(v.tensor().cpu(), b.at(k).tensor().cpu())) << k;
      }
      EXPECT_EQ(full.at("optim").dict().size(), full2.at("optim").dict().size());
    }
    // Training on from the loaded state equals training on from the saved one (to rounding: some
    // CUDA backward kernels sum in no fixed order).
    train(model, opt);
    train(model2, opt2);
    const auto p1 = full_params(model);
    const auto p2 = full_params(model2);
    for (const auto& [k, v] : p1) EXPECT_TRUE(torch::allclose(v, p2.at(k), 1e-6, 1e-7)) << k;
  });
}

// Values stay on the shards' device unless offloaded (issue 37, item 6): gather_state_dict and
// the DIM0_CHUNKS optimizer export put everything on the CPU before.
TEST(Cuda, GatheredAndChunkedValuesStayOnTheGpu) {
  FSDP_REQUIRE_CUDA();
  run_ranks(2, [](ProcessGroup& pg) {
    require_gpu_in_rank();
    TinyLM m(61);
    FullyShardedDataParallel model(
        m, lm_options(m, ShardingStrategy::FULL_SHARD, false).device_id(kGpu));
    torch::optim::Adam opt(unique_params(model->parameters()), 0.01);
    opt.zero_grad();
    auto idx = lm_tokens(2, 61 + pg.rank()).to(kGpu);
    lm_loss(model->forward(idx), idx).backward();
    opt.step();
    const auto chunks = ckpt::StateDictOptions().shard_layout(fsdp::ShardLayout::DIM0_CHUNKS);
    auto [msd, osd] = ckpt::get_state_dict(model, opt, chunks);
    const fsdp::StateValue& exp_avg =
        osd.at("state").dict().at("blocks.0.fc1.weight").dict().at("exp_avg");
    for (const auto& s : exp_avg.sharded_tensor().local_shards()) EXPECT_TRUE(s.tensor.is_cuda());
    const fsdp::StateDict gathered = fsdp::gather_state_dict(msd, pg);
    EXPECT_TRUE(gathered.at("blocks.0.fc1.weight").tensor().is_cuda());
    const fsdp::StateDict offloaded = fsdp::gather_state_dict(msd, pg, {}, /*cpu_offload=*/true);
    EXPECT_TRUE(offloaded.at("blocks.0.fc1.weight").tensor().is_cpu());
    auto [cpu_m, cpu_o] =
        ckpt::get_state_dict(model, opt, ckpt::StateDictOptions(chunks).cpu_offload(true));
    const fsdp::StateValue& off =
        cpu_o.at("state").dict().at("blocks.0.fc1.weight").dict().at("exp_avg");
    for (const auto& s : off.sharded_tensor().local_shards()) EXPECT_TRUE(s.tensor.is_cpu());
  });
}
