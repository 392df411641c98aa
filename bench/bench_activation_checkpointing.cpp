// bench_activation_checkpointing: what activation checkpointing saves and costs (issue 64) on a
// model whose activations dominate: kLayers residual MLP blocks (d -> 4d -> d, tanh), each its
// own FULL_SHARD unit, fed kRows rows per rank, SGD, float32. Two cases, interleaved:
//
//   step_plain   a training step without checkpointing
//   step_ckpt    the same step with every unit checkpointed (checkpoint_units())
//   forward      the plain model's forward alone, without gradients (what the recomputation
//                repeats): the measured ideal of step_ckpt is step_plain + forward
//
// For each, rank 0's tensor bytes (tensor_memory.h) kept from the end of forward to backward
// (what autograd saved: the activations) against the analytic figure, and the peak of the step
// above what was live before it. The analytic activations, in float32 elements:
//   plain: every block keeps tanh's output (what tanh's backward and fc2's need, 4d a row) and
//          its own output (the next block's input, d): 5 x kRows x d per block (fc1's output is
//          freed: tanh's backward needs only its result)
//   ckpt:  every block keeps only its output, the next block's input (its own input is the one
//          before's output, or the model's input, live anyway): kRows x d per block
// The step-time ratio's ideal is one more forward a step: (1 + 2 + 1) / (1 + 2) = 1.33 where
// backward costs twice the forward; here tanh's forward is dearer than its backward, so the
// ideal measured from the forward case is printed beside it.
// (tanh rather than GELU: LibTorch 1.13's GELU allocates through raw_allocate, which the counting
// allocator of tensor_memory.h cannot serve.)
#include <torch/torch.h>

#include <array>
#include <map>

#include "bench_ranks.h"
#include "tensor_memory.h"

namespace {

constexpr int64_t kLayers = 8, kDim = 128, kRows = 1024;

struct MlpBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  MlpBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kDim, 4 * kDim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
};
TORCH_MODULE(MlpBlock);

struct Model {
  std::shared_ptr<fsdp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::SGD> opt;
};

Model make_model(bool checkpointed) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < kLayers; ++i) seq->push_back(MlpBlock());
  Model m;
  m.fsdp = std::make_shared<fsdp::FullyShardedDataParallel>(
      seq, fsdp::FullyShardedOptions()
               .process_group(*fsdp_bench::group())
               .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<MlpBlockImpl>()));
  if (checkpointed) fsdp::apply_activation_checkpointing(*m.fsdp, fsdp::checkpoint_units());
  m.opt = std::make_unique<torch::optim::SGD>((*m.fsdp)->parameters(), 1e-3);
  return m;
}

// Per case: {activation bytes kept from forward to backward, step peak above its start}.
std::map<std::string, std::array<double, 2>>& memory() {
  static std::map<std::string, std::array<double, 2>> m;
  return m;
}

const at::Tensor& input() {
  static const at::Tensor x = torch::randn({kRows, kDim});
  return x;
}

void step(Model& m, const std::string& name) {
  auto& mem = fsdp_bench::TensorMemory::install();
  m.opt->zero_grad();
  const int64_t before = mem.live();
  mem.reset_peak();
  at::Tensor out = (*m.fsdp)->forward(input());
  const int64_t kept = mem.live() - before;
  out.pow(2).mean().backward();
  memory()[name] = {double(kept), double(mem.peak() - before)};
  out = at::Tensor();
  m.opt->step();
}

Model& model(bool checkpointed) {
  static Model plain, ckpt;
  Model& m = checkpointed ? ckpt : plain;
  if (!m.fsdp) {
    m = make_model(checkpointed);
    fsdp_bench::warm_up([&] { step(m, "warm"); }, 2);
  }
  return m;
}

void BM_StepPlain(benchmark::State& st) {
  Model& m = model(false);
  fsdp_bench::group()->barrier();
  for (auto _ : st) step(m, "step_plain");
}
void BM_Forward(benchmark::State& st) {
  Model& m = model(false);
  fsdp_bench::group()->barrier();
  for (auto _ : st) {
    torch::NoGradGuard no_grad;
    benchmark::DoNotOptimize((*m.fsdp)->forward(input()));
  }
}
void BM_StepCkpt(benchmark::State& st) {
  Model& m = model(true);
  fsdp_bench::group()->barrier();
  for (auto _ : st) step(m, "step_ckpt");
}

double analytic(bool checkpointed) { return 4.0 * kLayers * kRows * kDim * (checkpointed ? 1 : 5); }

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  const double t_plain = rep.get("step_plain"), t_ckpt = rep.get("step_ckpt");
  std::printf(
      "\nworld size %d, %lld MLP blocks (d %lld, hidden %lld) as FULL_SHARD units, %lld rows a "
      "rank, SGD, float32; medians of interleaved rounds\n"
      "%-11s %9s %14s %14s %7s %14s\n",
      world, static_cast<long long>(kLayers), static_cast<long long>(kDim),
      static_cast<long long>(4 * kDim), static_cast<long long>(kRows), "case", "step ms",
      "activ. MB", "analytic MB", "ratio", "step peak MB");
  for (const bool c : {false, true}) {
    const std::string name = c ? "step_ckpt" : "step_plain";
    const auto mem = memory()[name];
    std::printf("%-11s %9.1f %14.2f %14.2f %7.3f %14.2f\n", name.c_str(),
                (c ? t_ckpt : t_plain) * 1e3, mem[0] / 1e6, analytic(c) / 1e6, mem[0] / analytic(c),
                mem[1] / 1e6);
    fsdp_bench::emit({{"bench", "activation_checkpointing"},
                      {"case", name},
                      {"world", world},
                      {"unit", "s"},
                      {"activation_bytes", mem[0]},
                      {"analytic_activation_bytes", analytic(c)},
                      {"step_peak_bytes", mem[1]}},
                     rep.all(name));
  }
  const auto p = memory()["step_plain"], k = memory()["step_ckpt"];
  const double t_fwd = rep.get("forward");
  std::printf(
      "forward alone %.1f ms; checkpointed / plain: step time %.2f (ideal: 1.33 by FLOPs, %.2f "
      "measured as (plain + forward) / plain), activations %.3f, step peak %.3f\n",
      t_fwd * 1e3, t_plain > 0 ? t_ckpt / t_plain : 0.0,
      t_plain > 0 ? (t_plain + t_fwd) / t_plain : 0.0, p[0] > 0 ? k[0] / p[0] : 0.0,
      p[1] > 0 ? k[1] / p[1] : 0.0);
  fsdp_bench::emit(
      {{"bench", "activation_checkpointing"}, {"case", "forward"}, {"world", world}, {"unit", "s"}},
      rep.all("forward"));
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  const int rounds = fsdp_bench::rounds_from_env(3);
  return fsdp_bench::run(
      argc, argv, world,
      [&] {
        fsdp_bench::TensorMemory::install();
        fsdp_bench::register_rounds({{"step_plain", BM_StepPlain, 0, 2},
                                     {"step_ckpt", BM_StepCkpt, 0, 2},
                                     {"forward", BM_Forward, 0, 2}},
                                    rounds);
      },
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
}
