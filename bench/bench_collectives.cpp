// bench_collectives: FlatParamHandle's unshard (all-gather) and gradient reduce-scatter against
// the raw c10d collective moving the same bytes, in the same run, at world size 2 (or
// $FSDP_BENCH_WORLD), for unit sizes of 1 to 256 MB ($FSDP_BENCH_SIZES_MB: the unsharded flat
// parameter's bytes, float32).
//
//   unshard       FlatParamHandle::unshard + reshard   vs  raw_allgather: the backend's flat
//                 all-gather (_allgather_base) where it has one, else the list form into views
//                 of one buffer (LibTorch 1.13's Gloo)
//   reduce_grad   FlatParamHandle::reduce_grad         vs  raw_reduce_scatter: the backend's
//                 _reduce_scatter_base where it has one, else the all-to-all that carries
//                 exactly the bytes a reduce-scatter must move (our emulation adds the sum)
//
// With $FSDP_BENCH_ALGOS=1 (or the older $FSDP_BENCH_RS_ALGOS=1) it also times
// ProcessGroup::reduce_scatter_tensor's emulations on the same bytes against each other
// (rs_alltoall, rs_pairwise: what AUTO picks on Gloo), and all_gather_into_tensor's algorithms
// (ag_native: the backend's own; ag_pairwise: what AUTO picks on Gloo), on preallocated tensors.
//
// Rounds are interleaved (bench_ranks.h); rank 0 prints the ratios and emits every sample.
#include "bench_ranks.h"

namespace {

std::vector<int64_t>& sizes_mb() {
  static std::vector<int64_t> s;
  return s;
}

// Elements per rank of a unit of `mb` megabytes (10^6 bytes) of float32.
int64_t shard_numel(int64_t mb, int world) { return mb * 1000000 / 4 / world; }

// Enough iterations that one sample takes some tens of milliseconds at ~1 GB/s.
int64_t iters_for(int64_t mb) { return std::clamp<int64_t>(64 / mb, 2, 64); }

using fsdp_bench::device;
using fsdp_bench::sync_device;
at::TensorOptions on_device() { return at::TensorOptions().device(device()); }

bool native(const fsdp::dist::ProcessGroup& pg) {
  return fsdp::compat::native_flat_collectives(pg.backend_name());
}
// Whether reduce_grad's reduce-scatter is the backend's own (see BM_RawReduceScatter).
bool native_reduce_scatter(const fsdp::dist::ProcessGroup& pg) {
  return native(pg) && pg.backend_name() != "gloo";
}

void BM_RawAllgather(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::ones({n}, on_device());
  at::Tensor out = at::empty({n * pg.size()}, on_device());
  auto b = pg.backend();
  std::function<void()> op;
  if (native(pg)) {
    op = [&] {
      b->_allgather_base(out, in)->wait();
      sync_device();
    };
  } else {
    op = [&, outs = std::vector<std::vector<at::Tensor>>(1),
          ins = std::vector<at::Tensor>{in}]() mutable {
      if (outs[0].empty())
        for (int r = 0; r < pg.size(); ++r) outs[0].push_back(out.narrow(0, r * n, n));
      b->allgather(outs, ins)->wait();
    };
  }
  fsdp_bench::warm_up(op);
  pg.barrier();
  for (auto _ : st) op();
}

void BM_Unshard(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("w", at::ones({n * pg.size()}, on_device()));
  fsdp::FlatParamHandle h(fsdp::collect_params(m), pg,
                          fsdp::FlatParamHandleOptions().device(device()));
  auto op = [&] {
    h.unshard();
    h.reshard();  // frees: the next unshard allocates again, as in training
    sync_device();
  };
  fsdp_bench::warm_up(op);
  pg.barrier();
  for (auto _ : st) op();
}

// The raw collective reduce_grad's reduce-scatter runs on: the native one on NCCL, the all-to-all
// on Gloo, whose native form (LibTorch 2.x) is an all-reduce of a clone and 3-4x slower than the
// all-to-all (docs/dist.md), so fsdp::dist does not use it.
void BM_RawReduceScatter(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::ones({n * pg.size()}, on_device());
  auto b = pg.backend();
  std::function<void()> op;
  if (native_reduce_scatter(pg)) {
    at::Tensor out = at::empty({n}, on_device());
    op = [b, out, in]() mutable {
      b->_reduce_scatter_base(out, in)->wait();
      sync_device();
    };
  } else {
    at::Tensor out = at::empty({n * pg.size()});
    op = [b, out, in]() mutable {
      std::vector<int64_t> equal;
      b->alltoall_base(out, in, equal, equal)->wait();
    };
  }
  fsdp_bench::warm_up(op);
  pg.barrier();
  for (auto _ : st) op();
}

// What the runtime does after a unit's backward: free the unsharded parameters, flatten the
// gradients into the padded flat gradient (in the parameters' memory, as the runtime's
// post-backward reshard hands it over), reduce-scatter it and keep this rank's shard as the
// sharded gradient. The unshard that precedes it in training is not timed.
void BM_ReduceGrad(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("w", at::ones({n * pg.size()}, on_device()));
  fsdp::FlatParamHandle h(fsdp::collect_params(m), pg,
                          fsdp::FlatParamHandleOptions().device(device()));
  std::vector<at::Tensor> params = h.orig_params();
  const at::Tensor grad = at::ones({n * pg.size()}, on_device());
  auto op = [&] {
    h.set_training_state(fsdp::HandleTrainingState::BACKWARD_POST);
    h.reshard();
    h.reduce_grad();
    h.set_training_state(fsdp::HandleTrainingState::IDLE);
    h.flat_param().mutable_grad().reset();
    sync_device();
  };
  auto untimed = [&] {
    h.unshard();
    params = h.orig_params();
    for (auto& p : params) p.mutable_grad() = grad;  // as autograd leaves them
    // On a GPU the unshard's all-gather is only queued: finished here, or the timed reduction
    // would wait behind it (which read as reduce_grad at half the raw reduce-scatter's speed).
    sync_device();
  };
  for (int i = 0; i < 2; ++i) {
    untimed();
    op();
  }
  pg.barrier();
  for (auto _ : st) {
    st.PauseTiming();
    untimed();
    st.ResumeTiming();
    op();
  }
}

// ProcessGroup::reduce_scatter_tensor with one emulation, on preallocated input and output.
template <fsdp::dist::ReduceScatterAlgo kAlgo>
void BM_ReduceScatterAlgo(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::ones({n * pg.size()}, on_device());
  at::Tensor out = at::empty({n}, on_device());
  auto op = [&] {
    pg.reduce_scatter_tensor(out, in, fsdp::dist::ReduceOp::SUM, kAlgo);
    sync_device();
  };
  fsdp_bench::warm_up(op);
  pg.barrier();
  for (auto _ : st) op();
}

// ProcessGroup::all_gather_into_tensor with one algorithm, on preallocated input and output.
template <fsdp::dist::AllGatherAlgo kAlgo>
void BM_AllGatherAlgo(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const int64_t n = st.range(0);
  at::Tensor in = at::ones({n}, on_device());
  at::Tensor out = at::empty({n * pg.size()}, on_device());
  auto op = [&] {
    pg.all_gather_into_tensor(out, in, kAlgo);
    sync_device();
  };
  fsdp_bench::warm_up(op);
  pg.barrier();
  for (auto _ : st) op();
}

bool compare_algos() {
  for (const char* v : {"FSDP_BENCH_ALGOS", "FSDP_BENCH_RS_ALGOS"}) {
    const char* e = std::getenv(v);
    if (e && std::string(e) == "1") return true;
  }
  return false;
}

void register_all(int world, int rounds) {
  using fsdp::dist::AllGatherAlgo;
  using fsdp::dist::ReduceScatterAlgo;
  for (int64_t mb : sizes_mb()) {
    const int64_t n = shard_numel(mb, world), it = iters_for(mb);
    std::vector<fsdp_bench::Case> cases{{"raw_allgather", BM_RawAllgather, n, it},
                                        {"unshard", BM_Unshard, n, it},
                                        {"raw_reduce_scatter", BM_RawReduceScatter, n, it},
                                        {"reduce_grad", BM_ReduceGrad, n, it}};
    if (compare_algos()) {
      cases.push_back({"rs_alltoall", BM_ReduceScatterAlgo<ReduceScatterAlgo::ALL_TO_ALL>, n, it});
      cases.push_back({"rs_pairwise", BM_ReduceScatterAlgo<ReduceScatterAlgo::PAIRWISE>, n, it});
      cases.push_back({"ag_native", BM_AllGatherAlgo<AllGatherAlgo::NATIVE>, n, it});
      cases.push_back({"ag_pairwise", BM_AllGatherAlgo<AllGatherAlgo::PAIRWISE>, n, it});
    }
    fsdp_bench::register_rounds(cases, rounds);
  }
}

void summarize(const fsdp_bench::RecordingReporter& rep, int world) {
  const bool nat = native(*fsdp_bench::group());
  const bool nat_rs = native_reduce_scatter(*fsdp_bench::group());
  std::printf(
      "\nworld size %d, float32 on %s over %s, medians of interleaved rounds; bandwidth = unit "
      "bytes / time;\nratio = raw c10d time / fsdp time on the same bytes (1.00 = as fast as the "
      "raw collective)\n",
      world, device().str().c_str(), fsdp_bench::group()->backend_name().c_str());
  std::printf("%10s | %-30s | %-30s\n", "unit MB", "unshard vs raw all-gather",
              nat_rs ? "reduce_grad vs raw reduce-scatter" : "reduce_grad vs raw all-to-all");
  for (int64_t mb : sizes_mb()) {
    const int64_t n = shard_numel(mb, world);
    const double bytes = static_cast<double>(n) * world * 4;
    auto fmt = [&](const char* fsdp_case, const char* raw_case) {
      const double f = rep.get(fsdp_case, n), r = rep.get(raw_case, n);
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.2f  (%.0f vs %.0f MB/s)", f > 0 ? r / f : 0.0,
                    f > 0 ? bytes / f / 1e6 : 0.0, r > 0 ? bytes / r / 1e6 : 0.0);
      return std::string(buf);
    };
    std::printf("%10lld | %-30s | %-30s\n", static_cast<long long>(mb),
                fmt("unshard", "raw_allgather").c_str(),
                fmt("reduce_grad", "raw_reduce_scatter").c_str());
    if (compare_algos()) {
      const double a = rep.get("rs_alltoall", n), p = rep.get("rs_pairwise", n);
      std::printf("%10s   reduce_scatter_tensor: all-to-all %.2f ms, pairwise %.2f ms (%.2f)\n", "",
                  a * 1e3, p * 1e3, a > 0 ? p / a : 0.0);
      const double gn = rep.get("ag_native", n), gp = rep.get("ag_pairwise", n);
      std::printf("%10s   all_gather_into_tensor: native %.2f ms, pairwise %.2f ms (%.2f)\n", "",
                  gn * 1e3, gp * 1e3, gn > 0 ? gp / gn : 0.0);
    }
    std::vector<const char*> cases{"raw_allgather", "unshard", "raw_reduce_scatter", "reduce_grad"};
    if (compare_algos()) {
      cases.push_back("rs_alltoall");
      cases.push_back("rs_pairwise");
      cases.push_back("ag_native");
      cases.push_back("ag_pairwise");
    }
    for (const char* c : cases) {
      fsdp_bench::emit({{"bench", "collectives"},
                        {"case", c},
                        {"world", world},
                        {"bytes", bytes},
                        {"unit", "s"},
                        {"raw_kind", nat ? "native" : "emulated"},
                        {"raw_rs_kind", nat_rs ? "native" : "emulated"},
                        {"device", device().str()}},
                       rep.all(c, n));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int world = fsdp_bench::world_from_env();
  const int rounds = fsdp_bench::rounds_from_env(5);
  sizes_mb() = fsdp_bench::env_list("FSDP_BENCH_SIZES_MB", {1, 4, 16, 64, 256});
  return fsdp_bench::run(
      argc, argv, world, [&] { register_all(world, rounds); },
      [world](const fsdp_bench::RecordingReporter& rep) { summarize(rep, world); });
}
