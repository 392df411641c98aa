// bench_training: the step time (forward, backward, Adam) of a small transformer under
// FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (the DDP equivalent) at world size 2 (or
// $FSDP_BENCH_WORLD), next to two baselines measured in the same run:
//   single_process  one process taking the same step on the whole global batch (the other ranks
//                   idle): the ideal W-rank step is 1/W of it;
//   compute_only    every rank stepping an unwrapped copy on its own share of the batch, with no
//                   communication at all: the step time if communication were fully hidden.
// Peak tensor bytes (tensor_memory.h) and peak RSS of rank 0 during each case are reported too.
// bench/py_training.py runs the same model in PyTorch's Python FSDP and DDP for the peer
// comparison (scripts/bench.sh runs both against LibTorch 2.6).
#include <torch/torch.h>

#include "bench_ranks.h"
#include "tensor_memory.h"

namespace {

// Keep in step with bench/py_training.py.
constexpr int64_t kVocab = 256, kDim = 128, kHeads = 4, kFF = 512, kLayers = 4, kSeq = 32;
constexpr int64_t kGlobalBatch = 8;

int64_t& iters() {
  static int64_t n = 10;
  return n;
}

using fsdp_bench::device;
using fsdp_bench::sync_device;

struct TransformerImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear head{nullptr};
  TransformerImpl() {
    torch::manual_seed(0);
    tok = register_module("tok", torch::nn::Embedding(kVocab, kDim));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < kLayers; ++i) {
      layers->push_back(torch::nn::TransformerEncoderLayer(
          torch::nn::TransformerEncoderLayerOptions(kDim, kHeads).dim_feedforward(kFF).dropout(0)));
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx).transpose(0, 1);  // [seq, batch, dim]
    for (size_t i = 0; i < layers->size(); ++i) {
      auto layer = layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i);
      x = fsdp::forward(layer, x);
    }
    return head(x.transpose(0, 1));
  }
};
TORCH_MODULE(Transformer);

torch::Tensor step_loss(const torch::Tensor& logits, const torch::Tensor& idx) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), idx.reshape({-1}));
}

// Rank 0's peak tensor bytes and peak RSS per case (the last round's).
std::map<std::string, std::pair<int64_t, int64_t>>& memory() {
  static std::map<std::string, std::pair<int64_t, int64_t>> m;
  return m;
}

template <typename Model>
void timed_steps(benchmark::State& st, const std::string& key, Model& model,
                 const torch::Tensor& idx) {
  torch::optim::Adam opt(model->parameters(), 1e-3);
  auto step = [&] {
    opt.zero_grad();
    step_loss(model->forward(idx), idx).backward();
    opt.step();
    sync_device();
  };
  fsdp_bench::warm_up(step, 2);
  fsdp_bench::TensorMemory::install().reset_peak();
  fsdp_bench::reset_peak_rss();
  fsdp_bench::group()->barrier();
  for (auto _ : st) step();
  memory()[key] = {fsdp_bench::TensorMemory::install().peak(), fsdp_bench::peak_rss()};
}

void BM_SingleProcess(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  // Rank 0 alone takes the whole batch; the others wait at the barrier below.
  if (pg.rank() == 0) {
    Transformer m;
    m->to(device());
    torch::optim::Adam opt(m->parameters(), 1e-3);
    auto idx = torch::randint(kVocab, {kGlobalBatch, kSeq}).to(device());
    auto step = [&] {
      opt.zero_grad();
      step_loss(m->forward(idx), idx).backward();
      opt.step();
      sync_device();
    };
    fsdp_bench::warm_up(step, 2);
    for (auto _ : st) step();
  } else {
    for (auto _ : st) {
    }
  }
  pg.barrier();
}

void BM_ComputeOnly(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Transformer m;
  m->to(device());
  auto idx = torch::randint(kVocab, {kGlobalBatch / pg.size(), kSeq}).to(device());
  timed_steps(st, "compute_only", m, idx);
  pg.barrier();
}

// kInflight: FullyShardedOptions::max_inflight_grad_reductions, -1 for its default (1 under
// NO_SHARD: each unit's gradient reduction overlaps the backward of the next; 0 under the sharded
// strategies: reduce and wait inside the post-backward hook). The "FULL_SHARD overlapped" and
// "NO_SHARD reduce_in_hook" cases measure the other choice in the same rounds.
// kForwardPrefetch: forward_prefetch(true) (PyTorch's default, kept here, is false): each unit's
// pre-forward starts gathering the next, so the gather runs while this unit computes ("FULL_SHARD
// forward_prefetch").
template <fsdp::ShardingStrategy S, int kInflight = -1, bool kForwardPrefetch = false>
void BM_Fsdp(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Transformer m;
  auto options =
      fsdp::FullyShardedOptions()
          .sharding_strategy(S)
          .process_group(pg)
          .device_id(device())
          .auto_wrap_policy(
              fsdp::module_type_auto_wrap_policy<torch::nn::TransformerEncoderLayerImpl>());
  if (kInflight >= 0) options.max_inflight_grad_reductions(kInflight);
  options.forward_prefetch(kForwardPrefetch);
  fsdp::FullyShardedDataParallel model(m, options);
  auto idx = torch::randint(kVocab, {kGlobalBatch / pg.size(), kSeq}).to(device());
  std::string name = fsdp::to_string(S);
  if (kInflight == 0) name += " reduce_in_hook";
  if (kInflight == 1) name += " overlapped";
  if (kForwardPrefetch) name += " forward_prefetch";
  timed_steps(st, name, model, idx);
}

const std::vector<std::string> kCases{"single_process",
                                      "compute_only",
                                      "FULL_SHARD",
                                      "SHARD_GRAD_OP",
                                      "NO_SHARD",
                                      "FULL_SHARD overlapped",
                                      "NO_SHARD reduce_in_hook",
                                      "FULL_SHARD forward_prefetch"};

void register_all(int rounds) {
  using fsdp::ShardingStrategy;
  fsdp_bench::TensorMemory::install();
  fsdp_bench::register_rounds(
      {{"single_process", BM_SingleProcess, 0, iters()},
       {"compute_only", BM_ComputeOnly, 0, iters()},
       {"FULL_SHARD", BM_Fsdp<ShardingStrategy::FULL_SHARD>, 0, iters()},
       {"SHARD_GRAD_OP", BM_Fsdp<ShardingStrategy::SHARD_GRAD_OP>, 0, iters()},
       {"NO_SHARD", BM_Fsdp<ShardingStrategy::NO_SHARD>, 0, iters()},
       {"FULL_SHARD overlapped", BM_Fsdp<ShardingStrategy::FULL_SHARD, 1>, 0, iters()},
       {"NO_SHARD reduce_in_hook", BM_Fsdp<ShardingStrategy::NO_SHARD, 0>, 0, iters()},
       {"FULL_SHARD forward_prefetch", BM_Fsdp<ShardingStrategy::FULL_SHARD, -1, true>, 0,
        iters()}},
      rounds);
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  const double base = rep.get("single_process"), compute = rep.get("compute_only");
  const double tokens = kGlobalBatch * kSeq;
  std::printf(
      "\nstep of a %lld-layer transformer (d=%lld), global batch %lld x %lld tokens, world size "
      "%d, LibTorch %s on %s;\nmedians of interleaved rounds; ratio = step time / one process on "
      "the "
      "whole batch (ideal: 1/W)\n",
      static_cast<long long>(kLayers), static_cast<long long>(kDim),
      static_cast<long long>(kGlobalBatch), static_cast<long long>(kSeq), world, TORCH_VERSION,
      device().str().c_str());
  std::printf("%-26s %10s %10s %7s %14s %12s\n", "", "ms/step", "tokens/s", "ratio",
              "peak tensor MB", "peak RSS MB");
  for (const std::string& c : kCases) {
    const double t = rep.get(c);
    const auto mem = memory().count(c) ? memory()[c] : std::pair<int64_t, int64_t>{0, 0};
    std::printf("%-26s %10.1f %10.0f %7.2f %14.1f %12.1f\n", c.c_str(), t * 1e3,
                t > 0 ? tokens / t : 0.0, base > 0 ? t / base : 0.0, mem.first / 1e6,
                mem.second / 1e6);
    nlohmann::json m{{"bench", "training"},     {"case", c},
                     {"world", world},          {"unit", "s"},
                     {"tokens", tokens},        {"model", "transformer4x128"},
                     {"device", device().str()}};
    if (mem.first) m["peak_tensor_bytes"] = mem.first;
    if (mem.second) m["peak_rss_bytes"] = mem.second;
    fsdp_bench::emit(m, rep.all(c));
  }
  if (compute > 0)
    std::printf(
        "communication left exposed (step - compute_only): FULL_SHARD %.1f ms, "
        "NO_SHARD %.1f ms\n",
        (rep.get("FULL_SHARD") - compute) * 1e3, (rep.get("NO_SHARD") - compute) * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  const int rounds = fsdp_bench::rounds_from_env(3);
  iters() = fsdp_bench::env_int("FSDP_BENCH_ITERS", 10);
  return fsdp_bench::run(
      argc, argv, world, [&] { register_all(rounds); },
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
}
