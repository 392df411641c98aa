// bench_scaling: how the costs of FSDP training and checkpointing grow with the model (1M to
// 200M parameters, $FSDP_BENCH_PARAMS) and the world size ($FSDP_BENCH_WORLD), on a stack of
// kLayers Linear(d, d) + ReLU units (each its own FSDP unit) with Adam, float32. Per size:
//
//   step_FULL_SHARD     a training step; rank 0's peak tensor bytes (tensor_memory.h) during it
//                       against the analytic bound below, and its peak RSS for orientation
//   step_NO_SHARD       the same unsharded ($FSDP_BENCH_NO_SHARD=1), against its own bound
//   consolidate_full    get_state_dict(full_state_dict): the whole model and Adam state on every
//                       rank, against
//   raw_allgather       one c10d all-gather of the same bytes (what consolidation must move)
//   save_sharded        checkpoint::save of get_state_dict's flat shards, against
//   raw_write_fsync     every rank writing and fsyncing the same bytes to one file
//
// The analytic bound per rank, in bytes (float32):
//   FULL_SHARD: 4 x (param + grad + Adam's two moments) x (padded shard numel), summed over units
//               + 2 x 4 x the largest unit's unsharded numel (its parameters and its gradient are
//               both whole during its backward) + activations
//   NO_SHARD:   4 x 4 x every parameter + activations + the gradients of two buckets (the one
//               whose all-reduce is in flight and the one filling; bucket_cap_mb, 25 MiB by
//               default, 0 without buckets), which hold the new gradients until they are added to
//               those kept from the last step (zero_grad without set_to_none; else they are the
//               gradients, and the bound is loose by as much)
//   activations: every unit's saved input and ReLU output (2 x B x d floats each) plus the model's
//               input, output and its gradient.
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <optional>

#include "bench_ranks.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/model_state_dict.h"
#include "fsdp/optim_state_dict.h"
#include "tensor_memory.h"

namespace ckpt = fsdp::checkpoint;

namespace {

constexpr int64_t kLayers = 16, kBatch = 8;

std::string& base_dir() {
  static std::string dir;
  return dir;
}

int64_t width_for(int64_t params) {
  // kLayers * (d*d + d) ~ params
  return std::max<int64_t>(8, static_cast<int64_t>(std::sqrt(double(params) / kLayers)));
}
int64_t params_of(int64_t d) { return kLayers * (d * d + d); }

torch::nn::Sequential make_mlp(int64_t d) {
  torch::manual_seed(0);
  torch::nn::Sequential s;
  for (int64_t i = 0; i < kLayers; ++i) {
    s->push_back(torch::nn::Linear(d, d));
    s->push_back(torch::nn::ReLU());
  }
  return s;
}

double analytic_activations(int64_t d, int world) {
  const double per_rank_batch = double(kBatch) / 1;  // each rank steps its own kBatch rows
  (void)world;
  return 4.0 * per_rank_batch * d * (2.0 * kLayers + 3.0);
}

double bound_full_shard(int64_t d, int world) {
  const int64_t unit = d * d + d;
  const int64_t shard = (unit + world - 1) / world;  // FlatParamHandle pads to a multiple of W
  return 4.0 * 4.0 * double(shard) * kLayers + 2.0 * 4.0 * double(unit) +
         analytic_activations(d, world);
}
double bound_no_shard(int64_t d, int world, double bucket_cap_mb) {
  const double grads = 4.0 * double(params_of(d));
  const double buckets = std::min(grads, 2 * bucket_cap_mb * 1024 * 1024);
  return 4.0 * grads + buckets + analytic_activations(d, world);
}

// The model of the current size, wrapped FULL_SHARD, with Adam's state present; rebuilt when the
// size changes, so that every case of one size shares it.
struct Fixture {
  int64_t d = 0;
  std::shared_ptr<fsdp::FullyShardedDataParallel> model;
  std::unique_ptr<torch::optim::Adam> opt;
  at::Tensor input;
  int64_t state_bytes = 0;  // every rank's model + optimizer tensor bytes, summed
  // Whether the save and the raw write have had their untimed rounds at this size (see
  // BM_SaveSharded).
  bool save_warm = false, write_warm = false;
};
Fixture& fixture() {
  static Fixture f;
  return f;
}

template <typename M>
void train_step(M& model, torch::optim::Optimizer& opt, const at::Tensor& x) {
  opt.zero_grad();
  model->forward(x).pow(2).mean().backward();
  opt.step();
}

int64_t tensor_bytes(const fsdp::StateDict& sd);
int64_t value_bytes(const fsdp::StateValue& v) {
  if (v.is_tensor()) return v.tensor().numel() * v.tensor().element_size();
  if (v.is_sharded_tensor()) {
    int64_t n = 0;
    for (const auto& s : v.sharded_tensor().local_shards())
      n += s.tensor.numel() * s.tensor.element_size();
    return n;
  }
  if (v.is_dict()) return tensor_bytes(v.dict());
  if (v.is_list()) {
    int64_t n = 0;
    for (const auto& e : v.list()) n += value_bytes(e);
    return n;
  }
  return 0;
}
int64_t tensor_bytes(const fsdp::StateDict& sd) {
  int64_t n = 0;
  for (const auto& kv : sd) n += value_bytes(kv.second);
  return n;
}

Fixture& fixture_for(int64_t d) {
  auto& pg = *fsdp_bench::group();
  Fixture& f = fixture();
  if (f.d == d) return f;
  f = Fixture{};
  f.d = d;
  auto m = make_mlp(d);
  f.model = std::make_shared<fsdp::FullyShardedDataParallel>(
      m, fsdp::FullyShardedOptions().process_group(pg).auto_wrap_policy(
             fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>()));
  f.opt = std::make_unique<torch::optim::Adam>((*f.model)->parameters(), 1e-4);
  f.input = torch::randn({kBatch, d});
  train_step(*f.model, *f.opt, f.input);  // Adam's state exists from here on
  auto [msd, osd] = ckpt::get_state_dict(**f.model, *f.opt);
  int64_t local = tensor_bytes(msd) + tensor_bytes(osd);
  at::Tensor t = at::full({1}, double(local), at::kDouble);
  pg.all_reduce(t, fsdp::dist::ReduceOp::SUM);
  f.state_bytes = static_cast<int64_t>(t.item<double>());
  return f;
}

// Rank 0's memory per step case, by case and size: {peak tensor bytes, peak RSS, bound}.
std::map<std::pair<std::string, int64_t>, std::array<double, 3>>& memory() {
  static std::map<std::pair<std::string, int64_t>, std::array<double, 3>> m;
  return m;
}

void BM_StepFullShard(benchmark::State& st) {
  const int64_t d = width_for(st.range(0));
  Fixture& f = fixture_for(d);
  train_step(*f.model, *f.opt, f.input);
  auto& mem = fsdp_bench::TensorMemory::install();
  mem.reset_peak();
  fsdp_bench::reset_peak_rss();
  fsdp_bench::group()->barrier();
  for (auto _ : st) train_step(*f.model, *f.opt, f.input);
  if (fsdp_bench::group()->rank() == 0) mem.print_peak_blocks("step_FULL_SHARD");
  memory()[{"step_FULL_SHARD", st.range(0)}] = {double(mem.peak()), double(fsdp_bench::peak_rss()),
                                                bound_full_shard(d, fsdp_bench::group()->size())};
}

void BM_StepNoShard(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t d = width_for(st.range(0));
  fixture() = Fixture{};  // one model at a time: the FULL_SHARD fixture is rebuilt afterwards
  auto& mem = fsdp_bench::TensorMemory::install();
  const int64_t before = mem.live();
  auto m = make_mlp(d);
  auto options = fsdp::FullyShardedOptions()
                     .process_group(pg)
                     .sharding_strategy(fsdp::ShardingStrategy::NO_SHARD)
                     .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>());
  // $FSDP_BENCH_BUCKET_MB: bucket_cap_mb for A/B runs (unset: the library's default).
  if (const char* b = std::getenv("FSDP_BENCH_BUCKET_MB")) options.bucket_cap_mb(std::atof(b));
  fsdp::FullyShardedDataParallel model(m, options);
  torch::optim::Adam opt(model->parameters(), 1e-4);
  at::Tensor x = torch::randn({kBatch, d});
  fsdp_bench::warm_up([&] { train_step(model, opt, x); }, 2);
  mem.reset_peak();
  fsdp_bench::reset_peak_rss();
  pg.barrier();
  for (auto _ : st) train_step(model, opt, x);
  memory()[{"step_NO_SHARD", st.range(0)}] = {
      double(mem.peak() - before), double(fsdp_bench::peak_rss()),
      bound_no_shard(d, pg.size(), options.bucket_cap_mb())};
}

// FSDP_BENCH_GATHER_WINDOW, for A/B runs of FULL consolidation: the gathers' window in bytes (0
// gathers one flat parameter or state tensor at a time, uncoalesced;
// src/state_dict/gather_queue.h).
std::optional<int64_t> gather_window() {
  const char* w = std::getenv("FSDP_BENCH_GATHER_WINDOW");
  if (!w) return std::nullopt;
  return std::stoll(w);
}

void BM_ConsolidateFull(benchmark::State& st) {
  Fixture& f = fixture_for(width_for(st.range(0)));
  const auto opts = ckpt::StateDictOptions().full_state_dict(true);
  const std::optional<int64_t> window = gather_window();
  fsdp_bench::group()->barrier();
  for (auto _ : st) {
    if (window) {  // what get_state_dict(full_state_dict) does, with the window set
      fsdp::StateDictTypeGuard g(
          *f.model, fsdp::StateDictType::FULL_STATE_DICT,
          fsdp::FullStateDictConfig().gather_window_bytes(*window),
          fsdp::FullOptimStateDictConfig().offload_to_cpu(false).gather_window_bytes(*window));
      auto sd =
          std::make_pair(fsdp::state_dict(*f.model), fsdp::optim_state_dict(*f.model, *f.opt));
      benchmark::DoNotOptimize(sd);
    } else {
      auto sd = ckpt::get_state_dict(**f.model, *f.opt, opts);
      benchmark::DoNotOptimize(sd);
    }
  }
}

void BM_RawAllgather(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Fixture& f = fixture_for(width_for(st.range(0)));
  const int64_t n = f.state_bytes / 4 / pg.size();
  at::Tensor in = at::ones({n});
  at::Tensor out = at::ones({n * pg.size()});  // touched once: the timing is the collective alone
  pg.barrier();
  for (auto _ : st) pg.all_gather_into_tensor(out, in);
}

std::string save_dir() { return base_dir() + "/ckpt"; }

void BM_SaveSharded(benchmark::State& st) {
  Fixture& f = fixture_for(width_for(st.range(0)));
  auto op = [&f] {
    auto [msd, osd] = ckpt::get_state_dict(**f.model, *f.opt);
    fsdp::StateDict sd;
    sd.insert_or_assign("model", msd);
    sd.insert_or_assign("optim", osd);
    ckpt::save(sd, save_dir());
  };
  // Two untimed saves per size, as a trainer that saves every N steps is past them: the first
  // writes into fresh files and the second next to the first's (the old checkpoint is only
  // replaced once the new one is complete), and both grow the page cache, which took 1.1-1.3 s
  // where the steady state takes 0.39-0.40 (50M parameters, W=2; the raw write's first round
  // 0.9 s against 0.42). With three rounds they made the median, and the ratio read 0.37.
  if (!f.save_warm) {
    fsdp_bench::warm_up(op, 2);
    f.save_warm = true;
  }
  fsdp_bench::group()->barrier();
  for (auto _ : st) op();
}

void BM_RawWriteFsync(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  Fixture& f = fixture_for(width_for(st.range(0)));
  const int64_t bytes = f.state_bytes / pg.size();
  at::Tensor data = at::ones({bytes / 4});
  const std::string path = base_dir() + "/raw_" + std::to_string(pg.rank());
  auto op = [&] {
    fsdp_bench::write_file_fsync(path, data.data_ptr(), bytes);
    pg.barrier();  // as a save: done when every rank is
  };
  if (!f.write_warm) {  // the same untimed rounds as the save's
    fsdp_bench::warm_up(op, 2);
    f.write_warm = true;
  }
  pg.barrier();
  for (auto _ : st) op();
}

std::vector<int64_t>& sizes() {
  static std::vector<int64_t> s;
  return s;
}

void register_all(int rounds) {
  fsdp_bench::TensorMemory::install();
  const bool no_shard = fsdp_bench::env_int("FSDP_BENCH_NO_SHARD", 0) != 0;
  for (int64_t p : sizes()) {
    if (no_shard) fsdp_bench::register_rounds({{"step_NO_SHARD", BM_StepNoShard, p, 1}}, 1);
    fsdp_bench::register_rounds({{"step_FULL_SHARD", BM_StepFullShard, p, 1},
                                 {"raw_allgather", BM_RawAllgather, p, 1},
                                 {"consolidate_full", BM_ConsolidateFull, p, 1},
                                 {"raw_write_fsync", BM_RawWriteFsync, p, 1},
                                 {"save_sharded", BM_SaveSharded, p, 1}},
                                rounds);
  }
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  std::printf(
      "\nworld size %d, %lld Linear units, Adam, float32; medians of interleaved rounds\n"
      "%10s %9s %9s %9s %9s %9s %11s %11s %8s\n",
      world, static_cast<long long>(kLayers), "params", "step ms", "cons ms", "gather ms",
      "save ms", "write ms", "tensor MB", "bound MB", "ratio");
  for (int64_t p : sizes()) {
    const int64_t d = width_for(p), params = params_of(d);
    const auto mem = memory()[{"step_FULL_SHARD", p}];
    std::printf("%10lld %9.1f %9.1f %9.1f %9.1f %9.1f %11.1f %11.1f %8.2f\n",
                static_cast<long long>(params), rep.get("step_FULL_SHARD", p) * 1e3,
                rep.get("consolidate_full", p) * 1e3, rep.get("raw_allgather", p) * 1e3,
                rep.get("save_sharded", p) * 1e3, rep.get("raw_write_fsync", p) * 1e3, mem[0] / 1e6,
                mem[2] / 1e6, mem[2] > 0 ? mem[0] / mem[2] : 0.0);
    const double state = fixture().d == d ? double(fixture().state_bytes) : 16.0 * params;
    for (const char* c : {"step_FULL_SHARD", "step_NO_SHARD", "raw_allgather", "consolidate_full",
                          "raw_write_fsync", "save_sharded"}) {
      auto s = rep.all(c, p);
      if (s.empty()) continue;
      nlohmann::json m{{"bench", "scaling"}, {"case", c},        {"world", world},
                       {"unit", "s"},        {"params", params}, {"state_bytes", state}};
      auto it = memory().find({c, p});
      if (it != memory().end()) {
        m["peak_tensor_bytes"] = it->second[0];
        m["peak_rss_bytes"] = it->second[1];
        m["bound_bytes"] = it->second[2];
      }
      fsdp_bench::emit(m, s);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  const int rounds = fsdp_bench::rounds_from_env(3);
  sizes() = fsdp_bench::env_list("FSDP_BENCH_PARAMS", {1000000, 8000000, 50000000});
  const char* d = std::getenv("FSDP_BENCH_DIR");
  base_dir() =
      std::string(d ? d : "/var/tmp") + "/fsdp_bench_scaling_" + std::to_string(::getpid());
  ::mkdir(base_dir().c_str(), 0755);
  const int rc = fsdp_bench::run(
      argc, argv, world, [&] { register_all(rounds); },
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
  std::system(("rm -rf " + base_dir()).c_str());
  return rc;
}
