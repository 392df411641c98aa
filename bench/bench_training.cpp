// bench_training: the step time (forward, backward, Adam or $FSDP_BENCH_OPTIM) of a small
// transformer under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (the DDP equivalent) at world size 2 (or
// $FSDP_BENCH_WORLD), next to two baselines measured in the same run:
//   single_process  one process taking the same step on the whole global batch (the other ranks
//                   idle): the ideal W-rank step is 1/W of it;
//   compute_only    every rank stepping an unwrapped copy on its own share of the batch, with no
//                   communication at all: the step time if communication were fully hidden.
// Peak tensor bytes (tensor_memory.h) and peak RSS of rank 0 during each case are reported too.
// bench/py_training.py runs the same model in PyTorch's Python FSDP and DDP for the peer
// comparison (scripts/bench.sh runs both against LibTorch 2.6).
#include <sys/resource.h>

#include <chrono>

#include <torch/torch.h>

#include "bench_ranks.h"
#include "tensor_memory.h"

namespace {

// Keep in step with bench/py_training.py. $FSDP_BENCH_MODEL picks the model (all map token ids
// to logits over the same vocabulary, so the loss and batch are shared):
//   transformer  4 encoder layers of d=128 (FF 512), each an FSDP unit (the default);
//   blocks       48 residual MLP blocks of d=64 (hidden 256), each a unit: many small units, where
//                one collective per unit pays its latency 48 times (issue 42);
//   params       96 Linear(64, 64) layers under one unit (the root): many small parameters.
constexpr int64_t kVocab = 256, kDim = 128, kHeads = 4, kFF = 512, kLayers = 4, kSeq = 32;
constexpr int64_t kSmallDim = 64, kBlocks = 48, kLinears = 96;
constexpr int64_t kGlobalBatch = 8;

int64_t& iters() {
  static int64_t n = 10;
  return n;
}

const std::string& model_kind() {
  static const std::string kind = [] {
    std::string k = fsdp_bench::env_str("FSDP_BENCH_MODEL", "transformer");
    if (k != "transformer" && k != "blocks" && k != "params") {
      std::fprintf(stderr, "FSDP_BENCH_MODEL must be transformer, blocks or params, not %s\n",
                   k.c_str());
      std::exit(2);
    }
    return k;
  }();
  return kind;
}

std::string model_name() {
  if (model_kind() == "blocks") return "blocks48x64";
  if (model_kind() == "params") return "params96x64";
  return "transformer4x128";
}

using fsdp_bench::device;
using fsdp_bench::sync_device;

struct MlpBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  MlpBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kSmallDim, 4 * kSmallDim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * kSmallDim, kSmallDim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(MlpBlock);

struct TransformerImpl : torch::nn::Module {
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear head{nullptr};
  TransformerImpl() {
    torch::manual_seed(0);
    const int64_t dim = model_kind() == "transformer" ? kDim : kSmallDim;
    tok = register_module("tok", torch::nn::Embedding(kVocab, dim));
    layers = register_module("layers", torch::nn::ModuleList());
    if (model_kind() == "transformer") {
      for (int i = 0; i < kLayers; ++i) {
        layers->push_back(torch::nn::TransformerEncoderLayer(
            torch::nn::TransformerEncoderLayerOptions(kDim, kHeads)
                .dim_feedforward(kFF)
                .dropout(0)));
      }
    } else if (model_kind() == "blocks") {
      for (int i = 0; i < kBlocks; ++i) layers->push_back(MlpBlock());
    } else {
      for (int i = 0; i < kLinears; ++i) layers->push_back(torch::nn::Linear(kSmallDim, kSmallDim));
    }
    head = register_module("head", torch::nn::Linear(dim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = tok(idx);
    if (model_kind() == "transformer") {
      x = x.transpose(0, 1);  // [seq, batch, dim]
      for (size_t i = 0; i < layers->size(); ++i) {
        auto layer = layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i);
        x = fsdp::forward(layer, x);
      }
      x = x.transpose(0, 1);
    } else if (model_kind() == "blocks") {
      for (size_t i = 0; i < layers->size(); ++i) {
        auto block = layers->ptr<MlpBlockImpl>(i);
        x = fsdp::forward(block, x);
      }
    } else {
      for (size_t i = 0; i < layers->size(); ++i) {
        x = torch::tanh(layers->ptr<torch::nn::LinearImpl>(i)->forward(x));
      }
    }
    return head(x);
  }
};
TORCH_MODULE(Transformer);

// $FSDP_BENCH_OPTIM: adam (the default) or sgd (plain, no momentum: one kernel per parameter).
// The optimizer is the user's and LibTorch's, not ours: on a GPU, where a step of these models is
// bound by kernel launches, C++ Adam's loop of kernels per tensor against Python's multi-tensor
// (foreach) Adam can outweigh all of the framework's own work. SGD shrinks that difference, so
// the two sides' frameworks can be compared with little else in between.
const std::string& optim_name() {
  static const std::string kind = fsdp_bench::env_str("FSDP_BENCH_OPTIM", "adam");
  return kind;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params) {
  const std::string& kind = optim_name();
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(std::move(params), 1e-3);
  if (kind != "adam") {
    std::fprintf(stderr, "FSDP_BENCH_OPTIM must be adam or sgd, not %s\n", kind.c_str());
    std::exit(2);
  }
  return std::make_unique<torch::optim::Adam>(std::move(params), 1e-3);
}

torch::Tensor step_loss(const torch::Tensor& logits, const torch::Tensor& idx) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), idx.reshape({-1}));
}

// Rank 0's peak tensor bytes and peak RSS per case (the last round's).
std::map<std::string, std::pair<int64_t, int64_t>>& memory() {
  static std::map<std::string, std::pair<int64_t, int64_t>> m;
  return m;
}

// $FSDP_BENCH_PHASES=1: where each case's step goes, on rank 0: the forward, the backward (with
// everything a wrapper does at its end) and the optimizer (zero_grad and step) timed apart, with
// the device synchronized between them, and the minor page faults per step (fresh memory the
// step touched: costly in a VM). py_training.py --phases prints the same for PyTorch's side.
bool phases_on() {
  static const bool on = fsdp_bench::env_int("FSDP_BENCH_PHASES", 0) != 0;
  return on;
}

struct Phases {
  std::vector<double> forward, backward, optim;  // seconds, one per timed step
  double faults_per_step = 0;
};

std::map<std::string, Phases>& phases() {
  static std::map<std::string, Phases> p;
  return p;
}

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

template <typename Model>
void timed_steps(benchmark::State& st, const std::string& key, Model& model,
                 const torch::Tensor& idx) {
  auto opt = make_optimizer(model->parameters());
  auto step = [&] {
    opt->zero_grad();
    step_loss(model->forward(idx), idx).backward();
    opt->step();
    sync_device();
  };
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  Phases& ph = phases()[key];
  auto phased_step = [&] {
    auto t = Clock::now();
    opt->zero_grad();
    double optim = since(t);
    t = Clock::now();
    torch::Tensor loss = step_loss(model->forward(idx), idx);
    sync_device();
    ph.forward.push_back(since(t));
    t = Clock::now();
    loss.backward();
    sync_device();
    ph.backward.push_back(since(t));
    t = Clock::now();
    opt->step();
    sync_device();
    ph.optim.push_back(optim + since(t));
  };
  fsdp_bench::warm_up(step, 2);
  fsdp_bench::TensorMemory::install().reset_peak();
  fsdp_bench::reset_peak_rss();
  fsdp_bench::group()->barrier();
  const long faults = minor_faults();
  int64_t steps = 0;
  for (auto _ : st) {
    if (phases_on()) {
      phased_step();
    } else {
      step();
    }
    ++steps;
  }
  if (steps > 0) ph.faults_per_step = static_cast<double>(minor_faults() - faults) / steps;
  memory()[key] = {fsdp_bench::TensorMemory::install().peak(), fsdp_bench::peak_rss()};
}

double median_ms(const std::vector<double>& v) { return fsdp_bench::median(v) * 1e3; }

void BM_SingleProcess(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  // Rank 0 alone takes the whole batch; the others wait at the barrier below.
  if (pg.rank() == 0) {
    Transformer m;
    m->to(device());
    auto opt = make_optimizer(m->parameters());
    auto idx = torch::randint(kVocab, {kGlobalBatch, kSeq}).to(device());
    auto step = [&] {
      opt->zero_grad();
      step_loss(m->forward(idx), idx).backward();
      opt->step();
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

constexpr int kSweep = 1000;  // kBucketMb: the size is the case's argument

// kInflight: FullyShardedOptions::max_inflight_grad_reductions, -1 for its default (1 under
// NO_SHARD: each unit's gradient reduction overlaps the backward of the next; 0 under the sharded
// strategies: reduce and wait inside the post-backward hook). The "FULL_SHARD overlapped" and
// "NO_SHARD reduce_in_hook" cases measure the other choice in the same rounds.
// kForwardPrefetch: forward_prefetch(true) (PyTorch's default, kept here, is false): each unit's
// pre-forward starts gathering the next, so the gather runs while this unit computes ("FULL_SHARD
// forward_prefetch").
// kBucketMb: FullyShardedOptions::bucket_cap_mb under NO_SHARD, -1 for its default (25, DDP's);
// "NO_SHARD per_unit" (0) is one all-reduce per unit, Python FSDP's NO_SHARD. "NO_SHARD bucket"
// takes the size from the case's argument (the FSDP_BENCH_BUCKETS_MB sweep).
template <fsdp::ShardingStrategy S, int kInflight = -1, bool kForwardPrefetch = false,
          int kBucketMb = -1>
void BM_Fsdp(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Transformer m;
  auto options =
      fsdp::FullyShardedOptions().sharding_strategy(S).process_group(pg).device_id(device());
  if (model_kind() == "transformer") {
    options.auto_wrap_policy(
        fsdp::module_type_auto_wrap_policy<torch::nn::TransformerEncoderLayerImpl>());
  } else if (model_kind() == "blocks") {
    options.auto_wrap_policy(fsdp::module_type_auto_wrap_policy<MlpBlockImpl>());
  }
  if (kInflight >= 0) options.max_inflight_grad_reductions(kInflight);
  options.forward_prefetch(kForwardPrefetch);
  std::string name = fsdp::to_string(S);
  if (kBucketMb >= 0) options.bucket_cap_mb(kBucketMb);
  if (kBucketMb == 0) name += " per_unit";
  if (kBucketMb == kSweep) {
    options.bucket_cap_mb(static_cast<double>(st.range(0)));
    name += " bucket=" + std::to_string(st.range(0)) + "MB";
  }
  fsdp::FullyShardedDataParallel model(m, options);
  auto idx = torch::randint(kVocab, {kGlobalBatch / pg.size(), kSeq}).to(device());
  if (kInflight == 0) name += " reduce_in_hook";
  if (kInflight == 1) name += " overlapped";
  if (kForwardPrefetch) name += " forward_prefetch";
  timed_steps(st, name, model, idx);
}

// The cases of this run, in report order: (name, argument). The bucket sweep's sizes come from
// $FSDP_BENCH_BUCKETS_MB (e.g. "1,5,25,100"; empty: no sweep).
std::vector<std::pair<std::string, int64_t>>& cases() {
  static std::vector<std::pair<std::string, int64_t>> c;
  return c;
}

void register_all(int rounds) {
  using fsdp::ShardingStrategy;
  fsdp_bench::TensorMemory::install();
  std::vector<fsdp_bench::Case> all{
      {"single_process", BM_SingleProcess, 0, iters()},
      {"compute_only", BM_ComputeOnly, 0, iters()},
      {"FULL_SHARD", BM_Fsdp<ShardingStrategy::FULL_SHARD>, 0, iters()},
      {"SHARD_GRAD_OP", BM_Fsdp<ShardingStrategy::SHARD_GRAD_OP>, 0, iters()},
      {"NO_SHARD", BM_Fsdp<ShardingStrategy::NO_SHARD>, 0, iters()},
      {"NO_SHARD per_unit", BM_Fsdp<ShardingStrategy::NO_SHARD, -1, false, 0>, 0, iters()},
      {"FULL_SHARD overlapped", BM_Fsdp<ShardingStrategy::FULL_SHARD, 1>, 0, iters()},
      {"NO_SHARD reduce_in_hook", BM_Fsdp<ShardingStrategy::NO_SHARD, 0>, 0, iters()},
      {"FULL_SHARD forward_prefetch", BM_Fsdp<ShardingStrategy::FULL_SHARD, -1, true>, 0, iters()}};
  std::stringstream sweep(fsdp_bench::env_str("FSDP_BENCH_BUCKETS_MB", ""));
  for (std::string mb; std::getline(sweep, mb, ',');) {
    if (mb.empty()) continue;
    all.push_back({"NO_SHARD bucket", BM_Fsdp<ShardingStrategy::NO_SHARD, -1, false, kSweep>,
                   std::stoll(mb), iters()});
  }
  // $FSDP_BENCH_CASES (comma-separated names) keeps those cases and the sweep only.
  const std::string only = "," + fsdp_bench::env_str("FSDP_BENCH_CASES", "") + ",";
  if (only != ",,") {
    std::vector<fsdp_bench::Case> kept;
    for (const auto& c : all) {
      if (c.arg || only.find("," + c.name + ",") != std::string::npos) kept.push_back(c);
    }
    all = kept;
  }
  for (const auto& c : all) cases().push_back({c.name, c.arg});
  fsdp_bench::register_rounds(all, rounds);
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  const double base = rep.get("single_process"), compute = rep.get("compute_only");
  const double tokens = kGlobalBatch * kSeq;
  std::printf(
      "\nstep of %s (%s), global batch %lld x %lld tokens, world size %d, LibTorch %s on %s;\n"
      "medians of interleaved rounds; ratio = step time / one process on the whole batch (ideal: "
      "1/W)\n",
      model_name().c_str(), optim_name().c_str(), static_cast<long long>(kGlobalBatch),
      static_cast<long long>(kSeq), world, TORCH_VERSION, device().str().c_str());
  std::printf("%-28s %10s %10s %7s %14s %12s\n", "", "ms/step", "tokens/s", "ratio",
              "peak tensor MB", "peak RSS MB");
  for (const auto& [c, arg] : cases()) {
    const double t = rep.get(c, arg);
    const std::string label =
        arg ? c + "=" + std::to_string(arg) + "MB" : c;  // as BM_Fsdp names it
    const auto mem = memory().count(label) ? memory()[label] : std::pair<int64_t, int64_t>{0, 0};
    std::printf("%-28s %10.1f %10.0f %7.2f %14.1f %12.1f\n", label.c_str(), t * 1e3,
                t > 0 ? tokens / t : 0.0, base > 0 ? t / base : 0.0, mem.first / 1e6,
                mem.second / 1e6);
    nlohmann::json m{{"bench", "training"},      {"case", label},
                     {"world", world},           {"unit", "s"},
                     {"tokens", tokens},         {"model", model_name()},
                     {"device", device().str()}, {"optim", optim_name()}};
    if (mem.first) m["peak_tensor_bytes"] = mem.first;
    if (mem.second) m["peak_rss_bytes"] = mem.second;
    fsdp_bench::emit(m, rep.all(c, arg));
  }
  if (phases_on()) {
    std::printf(
        "\nrank 0, medians over every timed step, ms (faults: minor page faults per step)\n");
    std::printf("%-28s %10s %10s %10s %10s\n", "", "forward", "backward", "optim", "faults");
    for (const auto& [c, arg] : cases()) {
      const std::string label = arg ? c + "=" + std::to_string(arg) + "MB" : c;
      const Phases& ph = phases()[label];
      std::printf("%-28s %10.2f %10.2f %10.2f %10.0f\n", label.c_str(), median_ms(ph.forward),
                  median_ms(ph.backward), median_ms(ph.optim), ph.faults_per_step);
    }
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
