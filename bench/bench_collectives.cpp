// bench_collectives: FlatParamHandle's unshard and gradient reduce-scatter against the raw c10d
// collectives moving the same bytes, in the same run, at world size 2 (or $FSDP_BENCH_WORLD).
//
// The process forks its ranks, which rendezvous over a TCPStore on loopback and run identical
// Google Benchmark suites with fixed iteration counts (every rank must issue the same collectives).
// Rank 0 reports, then prints each fsdp operation's time as a ratio to its raw baseline:
//   unshard            vs c10d allgather (list form into views of one buffer: what 1.13 Gloo has)
//   reduce_grad        vs c10d allreduce of the full gradient (the DDP equivalent)
//   reduce_scatter/*   both emulations, for choosing kAllToAll vs kAllReduce by size
#include "bench_ranks.h"

namespace {

// Per-rank shard sizes in float32 elements: 1 KiB, 64 KiB, 1 MiB, 8 MiB per rank.
const std::vector<int64_t> kShardNumels{256, 16 << 10, 256 << 10, 2 << 20};

int64_t iters_for(int64_t numel) {
  return numel >= (2 << 20) ? 10 : numel >= (256 << 10) ? 40 : 200;
}

void set_bytes(benchmark::State& st, int64_t total_bytes) {
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * total_bytes);
  st.counters["MB"] = static_cast<double>(total_bytes) / 1e6;
}

void BM_RawAllgather(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::randn({n});
  at::Tensor out = at::empty({n * pg.size()});
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < pg.size(); ++r) outs[0].push_back(out.narrow(0, r * n, n));
  std::vector<at::Tensor> ins{in};
  fsdp_bench::warm_up([&] { pg.backend()->allgather(outs, ins)->wait(); });
  pg.barrier();
  for (auto _ : st) pg.backend()->allgather(outs, ins)->wait();
  set_bytes(st, n * pg.size() * 4);
}

void BM_Unshard(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("w", torch::randn({n * pg.size()}));
  fsdp::FlatParamHandle h(fsdp::collect_params(m), pg);
  fsdp_bench::warm_up([&] {
    h.unshard();
    h.reshard();
  });
  pg.barrier();
  for (auto _ : st) {
    h.unshard();
    h.reshard();  // frees: the next unshard allocates again, as in training
  }
  set_bytes(st, n * pg.size() * 4);
}

void BM_RawAllreduce(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0) * pg.size();
  at::Tensor t = at::randn({n});
  std::vector<at::Tensor> ts{t};
  fsdp_bench::warm_up([&] { pg.backend()->allreduce(ts)->wait(); });
  pg.barrier();
  for (auto _ : st) pg.backend()->allreduce(ts)->wait();
  set_bytes(st, n * 4);
}

void BM_RawAlltoall(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0) * pg.size();
  at::Tensor in = at::randn({n});
  at::Tensor out = at::empty({n});
  std::vector<int64_t> splits;
  fsdp_bench::warm_up([&] { pg.backend()->alltoall_base(out, in, splits, splits)->wait(); });
  pg.barrier();
  for (auto _ : st) pg.backend()->alltoall_base(out, in, splits, splits)->wait();
  set_bytes(st, n * 4);
}

template <fsdp::dist::ReduceScatterAlgo Algo>
void BM_ReduceScatter(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::randn({n * pg.size()});
  at::Tensor out = at::empty({n});
  fsdp_bench::warm_up([&] { pg.reduce_scatter_tensor(out, in, fsdp::dist::ReduceOp::AVG, Algo); });
  pg.barrier();
  for (auto _ : st) pg.reduce_scatter_tensor(out, in, fsdp::dist::ReduceOp::AVG, Algo);
  set_bytes(st, n * pg.size() * 4);
}

void BM_ReduceGrad(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("w", torch::randn({n * pg.size()}));
  fsdp::FlatParamHandle h(fsdp::collect_params(m), pg);
  at::Tensor grad = at::randn({h.layout().padded_unsharded_numel});
  fsdp_bench::warm_up([&] { h.reduce_flat_grad(grad); });
  h.flat_param().mutable_grad().reset();
  pg.barrier();
  for (auto _ : st) {
    h.reduce_flat_grad(grad);
    h.flat_param().mutable_grad().reset();
  }
  set_bytes(st, n * pg.size() * 4);
}

void register_all() {
  for (int64_t n : kShardNumels) {
    const int64_t it = iters_for(n);
    benchmark::RegisterBenchmark("raw_allgather", BM_RawAllgather)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("unshard", BM_Unshard)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("raw_allreduce", BM_RawAllreduce)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("raw_alltoall", BM_RawAlltoall)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("reduce_scatter/alltoall",
                                 BM_ReduceScatter<fsdp::dist::ReduceScatterAlgo::kAllToAll>)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("reduce_scatter/allreduce",
                                 BM_ReduceScatter<fsdp::dist::ReduceScatterAlgo::kAllReduce>)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
    benchmark::RegisterBenchmark("reduce_grad", BM_ReduceGrad)
        ->Arg(n)
        ->Iterations(it)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true)
        ->UseRealTime();
  }
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  auto t = [&](const char* name, int64_t n) { return rep.get(name, n); };
  std::printf(
      "\nworld size %d, float32; ratio = fsdp time / raw c10d time on the same bytes (1.00 = no "
      "overhead)\n",
      world);
  std::printf("%12s | %-26s | %-26s | %-30s\n", "shard bytes", "unshard / raw allgather",
              "reduce_grad / raw allreduce", "rs alltoall / rs allreduce");
  for (int64_t n : kShardNumels) {
    const double total_mb = n * world * 4 / 1e6;
    auto fmt = [&](double a, double b) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.2f  (%.0f vs %.0f MB/s)", b > 0 ? a / b : 0.0,
                    a > 0 ? total_mb / a : 0.0, b > 0 ? total_mb / b : 0.0);
      return std::string(buf);
    };
    std::printf("%12lld | %-26s | %-26s | %-30s\n", static_cast<long long>(n * 4),
                fmt(t("unshard", n), t("raw_allgather", n)).c_str(),
                fmt(t("reduce_grad", n), t("raw_allreduce", n)).c_str(),
                fmt(t("reduce_scatter/alltoall", n), t("reduce_scatter/allreduce", n)).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  return fsdp_bench::run(
      argc, argv, world, register_all,
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
}
