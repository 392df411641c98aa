// bench_training: the step time (forward, backward, Adam) of a small transformer under
// FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (the DDP equivalent) at world size 2 (or
// $FSDP_BENCH_WORLD), as ratios to one process taking the same step on the whole global batch,
// all measured in the same run.
#include <torch/torch.h>

#include "bench_ranks.h"

namespace {

constexpr int64_t kVocab = 256, kDim = 128, kHeads = 4, kFF = 512, kLayers = 4, kSeq = 32;
constexpr int64_t kGlobalBatch = 8;
constexpr int kIters = 10;

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

void BM_SingleProcess(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  // Rank 0 alone takes the whole batch; the others wait at the barrier below.
  if (pg.rank() == 0) {
    Transformer m;
    torch::optim::Adam opt(m->parameters(), 1e-3);
    auto idx = torch::randint(kVocab, {kGlobalBatch, kSeq});
    auto step = [&] {
      opt.zero_grad();
      step_loss(m->forward(idx), idx).backward();
      opt.step();
    };
    fsdp_bench::warm_up(step, 2);
    for (auto _ : st) step();
  } else {
    for (auto _ : st) {
    }
  }
  pg.barrier();
}

template <fsdp::ShardingStrategy S>
void BM_Fsdp(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Transformer m;
  fsdp::FullyShardedDataParallel model(
      m, fsdp::FullyShardedOptions().sharding_strategy(S).process_group(pg).auto_wrap_policy(
             fsdp::module_type_auto_wrap_policy<torch::nn::TransformerEncoderLayerImpl>()));
  torch::optim::Adam opt(model->parameters(), 1e-3);
  auto idx = torch::randint(kVocab, {kGlobalBatch / pg.size(), kSeq});
  auto step = [&] {
    opt.zero_grad();
    step_loss(model->forward(idx), idx).backward();
    opt.step();
  };
  fsdp_bench::warm_up(step, 2);
  pg.barrier();
  for (auto _ : st) step();
}

void register_all() {
  auto reg = [](const char* name, void (*fn)(benchmark::State&)) {
    benchmark::RegisterBenchmark(name, fn)
        ->Iterations(kIters)
        ->Repetitions(3)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  reg("single_process", BM_SingleProcess);
  reg("FULL_SHARD", BM_Fsdp<fsdp::ShardingStrategy::FULL_SHARD>);
  reg("SHARD_GRAD_OP", BM_Fsdp<fsdp::ShardingStrategy::SHARD_GRAD_OP>);
  reg("NO_SHARD", BM_Fsdp<fsdp::ShardingStrategy::NO_SHARD>);
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  const double base = rep.get("single_process");
  std::printf(
      "\nstep time of a %lld-layer transformer (d=%lld), global batch %lld, world size %d;\n"
      "ratio = step time / one process on the whole batch (same run; < 1 means faster)\n",
      static_cast<long long>(kLayers), static_cast<long long>(kDim),
      static_cast<long long>(kGlobalBatch), world);
  std::printf("%-16s %10.1f ms   1.00\n", "single process", base * 1e3);
  for (const char* s : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    const double t = rep.get(s);
    std::printf("%-16s %10.1f ms   %.2f\n", s, t * 1e3, base > 0 ? t / base : 0.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  return fsdp_bench::run(
      argc, argv, world, register_all,
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
}
