// wrap_deferred against eager construction: the same shards bit for bit, at W = 1-4, under every
// strategy, with and without use_orig_params and mixed precision, for models with tied and frozen
// parameters, buffers, nested units and parameters made from temporaries; what it refuses; and
// the memory it saves, counted by LibTorch's CPU allocator.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "fsdp/deferred_init.h"
#include "fsdp/errors.h"
#include "fsdp/fully_sharded.h"
#include "multi_rank.h"
#include "sanitizers.h"
#include "tiny_lm.h"

// Under AddressSanitizer the resident set and the address space are the sanitizer's too: the two
// cases that measure them skip (sanitizers.h).

using fsdp::DeferredInitOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::FullyShardedOptions;
using fsdp::ShardingStrategy;
using fsdp::dist::ProcessGroup;
using fsdp::testing::BlockImpl;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;

namespace {

// Stock modules with buffers (BatchNorm's, an int64 among them), a convolution, a layer norm, an
// embedding tied to a projection, and a parameter and a buffer a user's constructor makes from
// temporaries. Unlike TinyLM it does not seed itself: the generator's state at construction
// decides its values.
struct ZooImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Conv1d conv{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Sequential blocks{nullptr};
  // 64 KiB each, so that a rank keeps whole pages of one and none of the other: bf16 mixed
  // precision once made the kept range half its bytes, and `tail`'s values, written through the
  // fake pages, overwrote the half the plan forgot.
  torch::nn::Linear wide{nullptr}, tail{nullptr};
  torch::Tensor proj, user, table;

  ZooImpl() {
    emb = register_module("emb", torch::nn::Embedding(19, 8));
    conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(8, 6, 3)));
    norm = register_module("norm", torch::nn::BatchNorm1d(6));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    blocks = register_module(
        "blocks", torch::nn::Sequential(fsdp::testing::Block(6, 9), fsdp::testing::Block(6, 7)));
    wide = register_module("wide", torch::nn::Linear(128, 128));
    tail = register_module("tail", torch::nn::Linear(128, 128));
    proj = register_parameter("proj", emb->weight);  // tied
    user = register_parameter("user", torch::randn({5, 7}) * 0.02 + 1);
    table = register_buffer("table", torch::arange(12, torch::kFloat).reshape({3, 4}).sin());
  }
  // Only wrapped and compared here, never run; AnyModule needs a forward.
  torch::Tensor forward(const torch::Tensor& x) { return x; }
};
TORCH_MODULE(Zoo);

FullyShardedOptions zoo_options(ShardingStrategy s, bool orig) {
  return FullyShardedOptions()
      .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<BlockImpl>())
      .sharding_strategy(s)
      .use_orig_params(orig);
}

// Where the two wrapped models differ, "" if nowhere: every unit's local flat parameter (this
// rank's shard, or the whole under NO_SHARD) and every buffer, compared bit for bit.
std::string difference(FullyShardedDataParallel& eager, FullyShardedDataParallel& deferred) {
  const auto a = eager->handles(), b = deferred->handles();
  if (a.size() != b.size()) return "different unit counts";
  for (size_t u = 0; u < a.size(); ++u) {
    if (!a[u] != !b[u]) return "unit " + std::to_string(u) + " has parameters in one only";
    if (!a[u]) continue;
    const at::Tensor x = a[u]->flat_param().detach(), y = b[u]->flat_param().detach();
    if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type() || !at::equal(x, y)) {
      return "unit " + std::to_string(u) + "'s shard (" + eager->unit_names()[u] + ")";
    }
  }
  const auto ba = eager->module()->named_buffers(), bb = deferred->module()->named_buffers();
  if (ba.size() != bb.size()) return "different buffer counts";
  for (const auto& item : ba) {
    if (!at::equal(item.value(), bb[item.key()])) return "buffer " + item.key();
  }
  return "";
}

struct Case {
  ShardingStrategy strategy;
  bool orig;
  bool mixed;
};

std::vector<Case> cases(int world) {
  std::vector<Case> out;
  for (auto s : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                 ShardingStrategy::NO_SHARD, ShardingStrategy::HYBRID_SHARD}) {
    if (s == ShardingStrategy::HYBRID_SHARD && world % 2 != 0) continue;
    for (bool orig : {false, true}) out.push_back({s, orig, false});
  }
  out.push_back({ShardingStrategy::FULL_SHARD, false, true});
  return out;
}

FullyShardedOptions with(FullyShardedOptions o, const Case& c, int world) {
  if (c.strategy == ShardingStrategy::HYBRID_SHARD) o.hybrid_shard_size(world >= 4 ? 2 : world);
  if (c.mixed) o.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
  return o;
}

std::string describe(const Case& c) {
  return std::string(fsdp::to_string(c.strategy)) + (c.orig ? " use_orig_params" : "") +
         (c.mixed ? " bf16" : "");
}

class DeferredInit : public ::testing::TestWithParam<int> {};

// The same shards as the eager model, and the generator where the eager construction leaves it
// (the next random numbers agree), for TinyLM (nested units, a frozen unit, a tied head, a
// buffer) and Zoo, in every case.
TEST_P(DeferredInit, EqualsEagerBitForBitInEveryStrategy) {
  run_ranks(GetParam(), [](ProcessGroup& pg) {
    const int W = pg.size();
    for (const Case& c : cases(W)) {
      SCOPED_TRACE(describe(c));
      fsdp::testing::seed_cpu(5);
      TinyLM lm(3);
      FullyShardedDataParallel eager(lm,
                                     with(fsdp::testing::lm_options(lm, c.strategy, c.orig), c, W));
      const at::Tensor next_eager = torch::rand({6});
      fsdp::testing::seed_cpu(5);
      auto deferred = fsdp::wrap_deferred(
          [] { return TinyLM(3); },
          [&](TinyLM& m) { return with(fsdp::testing::lm_options(m, c.strategy, c.orig), c, W); });
      EXPECT_TRUE(at::equal(torch::rand({6}), next_eager));
      EXPECT_EQ(difference(eager, deferred), "");

      fsdp::testing::seed_cpu(11);
      Zoo zoo;
      FullyShardedDataParallel zoo_eager(zoo, with(zoo_options(c.strategy, c.orig), c, W));
      const at::Tensor zoo_next = torch::rand({6});
      fsdp::testing::seed_cpu(11);
      auto zoo_deferred =
          fsdp::wrap_deferred([] { return Zoo(); }, with(zoo_options(c.strategy, c.orig), c, W));
      EXPECT_TRUE(at::equal(torch::rand({6}), zoo_next));
      EXPECT_EQ(difference(zoo_eager, zoo_deferred), "");
    }
  });
}

// Negative control: the comparison above can fail. Another seed gives other shards on every rank.
TEST_P(DeferredInit, ComparisonSeesAnotherSeed) {
  run_ranks(GetParam(), [](ProcessGroup&) {
    fsdp::testing::seed_cpu(11);
    Zoo zoo;
    FullyShardedDataParallel eager(zoo, zoo_options(ShardingStrategy::FULL_SHARD, false));
    fsdp::testing::seed_cpu(12);
    auto deferred =
        fsdp::wrap_deferred([] { return Zoo(); }, zoo_options(ShardingStrategy::FULL_SHARD, false));
    EXPECT_NE(difference(eager, deferred), "");
  });
}

// sync_module_states: every rank's constructor draws from a seed of its own, and every rank ends
// with the shards of rank 0's model, in every case. Negative control: without it the other
// ranks keep what their own seeds gave them.
TEST_P(DeferredInit, SyncModuleStatesGivesEveryRankRankZerosModel) {
  run_ranks(GetParam(), [](ProcessGroup& pg) {
    const int W = pg.size(), rank = pg.rank();
    auto make = [rank] {
      fsdp::testing::seed_cpu(rank == 0 ? 11 : 40 + rank);
      return Zoo();
    };
    for (const Case& c : cases(W)) {
      SCOPED_TRACE(describe(c));
      fsdp::testing::seed_cpu(11);
      Zoo zoo;
      FullyShardedDataParallel eager(zoo, with(zoo_options(c.strategy, c.orig), c, W));
      auto synced = fsdp::wrap_deferred(
          make, with(zoo_options(c.strategy, c.orig), c, W).sync_module_states(true));
      EXPECT_EQ(difference(eager, synced), "");
      auto own = fsdp::wrap_deferred(make, with(zoo_options(c.strategy, c.orig), c, W));
      if (rank != 0) {
        EXPECT_NE(difference(eager, own), "");
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, DeferredInit, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// fc2's weight is derived from fc1's values, after fc3's initialisation. At W=2 rank 1's shard
// holds fc2 and the second half of fc3 but none of fc1, whose memory it never keeps: fc3's first
// half overwrites it before fc2 reads it. verify sees fc2.weight come out differently in two runs
// and every rank throws, naming it. Without verify rank 1's shard silently differs from the eager
// one, which is why verify is on by default.
struct DerivedImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc3{nullptr}, fc2{nullptr};
  DerivedImpl() {
    const auto square = torch::nn::LinearOptions(64, 64).bias(false);  // 16 KiB: four pages
    fc1 = register_module("fc1", torch::nn::Linear(square));
    fc3 = register_module("fc3", torch::nn::Linear(square));
    fc2 = register_module("fc2", torch::nn::Linear(square));
    torch::NoGradGuard no_grad;
    fc2->weight.copy_(fc1->weight * 2);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(fc3(fc1(x))); }
};
TORCH_MODULE(Derived);

TEST(DeferredInitRules, AConstructorThatReadsAnotherParameterIsRefusedNamingIt) {
  run_ranks(2, [](ProcessGroup& pg) {
    const auto options = FullyShardedOptions();
    try {
      fsdp::wrap_deferred([] { return Derived(); }, options);
      ADD_FAILURE() << "expected a ValueError";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("'fc2.weight'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
    fsdp::testing::seed_cpu(3);
    Derived eager_model;
    FullyShardedDataParallel eager(eager_model, options);
    fsdp::testing::seed_cpu(3);
    auto unchecked =
        fsdp::wrap_deferred([] { return Derived(); }, options, DeferredInitOptions().verify(false));
    if (pg.rank() == 0) {
      EXPECT_EQ(difference(eager, unchecked), "");
    } else {
      EXPECT_NE(difference(eager, unchecked), "");
    }
  });
}

// With sync_module_states the same constructor is fine: rank 0 builds it whole, the others take
// its values.
TEST(DeferredInitRules, SyncModuleStatesAcceptsAConstructorThatReadsAnotherParameter) {
  run_ranks(2, [](ProcessGroup&) {
    fsdp::testing::seed_cpu(3);
    Derived eager_model;
    FullyShardedDataParallel eager(eager_model, FullyShardedOptions());
    fsdp::testing::seed_cpu(3);
    auto synced = fsdp::wrap_deferred([] { return Derived(); },
                                      FullyShardedOptions().sync_module_states(true));
    EXPECT_EQ(difference(eager, synced), "");
  });
}

TEST(DeferredInitRules, AFailingConstructorIsAnErrorOnEveryRank) {
  run_ranks(2, [](ProcessGroup& pg) {
    // Only rank 1's constructor throws; rank 0 must not wait for it in the wrap.
    const int rank = pg.rank();
    try {
      fsdp::wrap_deferred([rank] {
        if (rank == 1) throw fsdp::ValueError("no such layer size");
        return Zoo();
      });
      ADD_FAILURE() << "expected a ValueError";
    } catch (const fsdp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("no such layer size"), std::string::npos) << e.what();
    }
    // A constructor that builds another model on its second run.
    int runs = 0;
    EXPECT_THROW(fsdp::wrap_deferred([&runs] {
                   return torch::nn::Sequential(torch::nn::Linear(4, 4 + (runs++ > 0)));
                 }),
                 fsdp::ValueError);
  });
}

// A parameter whose fake memory the kernel will not map (here: an address-space limit just above
// what the process uses; in practice vm.max_map_count) is an IOError saying so, not a silent
// fall back to allocating it: that would be the whole model this is here to avoid.
struct HugeImpl : torch::nn::Module {
  torch::Tensor w;
  HugeImpl() { w = register_parameter("w", torch::empty({int64_t{1} << 28})); }  // 1 GiB
  torch::Tensor forward(const torch::Tensor& x) { return x * w[0]; }
};
TORCH_MODULE(Huge);

int64_t status_kib(const char* field);

TEST(DeferredInitRules, AnAllocationTheKernelWillNotMapIsAnIOError) {
#if FSDP_TEST_ASAN
  GTEST_SKIP() << "AddressSanitizer's shadow memory needs the address space this test limits";
#endif
  run_ranks(1, [](ProcessGroup&) {
    const rlimit limit{static_cast<rlim_t>((status_kib("VmSize:") << 10) + (int64_t{256} << 20)),
                       RLIM_INFINITY};
    ASSERT_EQ(::setrlimit(RLIMIT_AS, &limit), 0);
    try {
      fsdp::wrap_deferred([] { return Huge(); });
      ADD_FAILURE() << "expected an IOError";
    } catch (const fsdp::IOError& e) {
      EXPECT_NE(std::string(e.what()).find("cannot map 1073741824 bytes"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("vm.max_map_count"), std::string::npos) << e.what();
    }
  });
}

// Resident memory of this process: VmRSS now, and VmHWM, its peak since reset_peak().
int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field)));
  }
  return -1;
}
bool reset_peak() { return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5"); }

// A model of sixteen 4 MiB units (64 MiB) built and wrapped at W=4, in fresh processes, measured as
// the kernel counts resident memory: the peak above what the process held before. Deferred, each
// rank holds its share (the kept elements, each unit's handed over to its shard as the unit is
// wrapped), at most a unit more, and the 4 MiB buffer behind the dropped parameters; eagerly,
// the whole model.
struct StackImpl : torch::nn::Module {
  torch::nn::Sequential layers{nullptr};
  StackImpl() {
    layers = register_module("layers", torch::nn::Sequential());
    for (int i = 0; i < 16; ++i) {
      layers->push_back(torch::nn::Linear(torch::nn::LinearOptions(1024, 1024).bias(false)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
};
TORCH_MODULE(Stack);

enum class Build { EAGER, DEFERRED, SYNCED };  // SYNCED: deferred with sync_module_states

int64_t peak_growth(Build build) {
  auto options = FullyShardedOptions().auto_wrap_policy(
      fsdp::module_type_auto_wrap_policy<torch::nn::LinearImpl>());
  if (!reset_peak()) return -1;
  const int64_t before = status_kib("VmRSS:");
  fsdp::testing::seed_cpu(1);
  if (build != Build::EAGER) {
    options.sync_module_states(build == Build::SYNCED);
    auto model = fsdp::wrap_deferred([] { return Stack(); }, options);
  } else {
    Stack model;
    FullyShardedDataParallel wrapped(model, options);
  }
  return (status_kib("VmHWM:") - before) * 1024;
}

TEST(DeferredInitMemory, EachRankHoldsItsShareAndOneUnitNeverTheModel) {
#if FSDP_TEST_ASAN
  GTEST_SKIP() << "AddressSanitizer's quarantine keeps freed memory resident";
#endif
  for (const Build build : {Build::DEFERRED, Build::SYNCED, Build::EAGER}) {
    run_ranks(4, [build](ProcessGroup& pg) {
      constexpr int64_t model = int64_t{16} << 22, unit = model / 16;
      const int64_t peak = peak_growth(build);
      if (peak < 0) GTEST_SKIP() << "/proc/self/clear_refs is not writable here";
      // The share, one unit, the 4 MiB buffer, and 4 MiB for the allocator and the process.
      const int64_t bound = model / pg.size() + unit + (int64_t{8} << 20);
      const char* name = build == Build::EAGER      ? "eager"
                         : build == Build::DEFERRED ? "deferred"
                                                    : "deferred, rank 0's values";
      std::printf("rank %d, %s: peak resident growth %.1f MiB (model %.0f MiB, bound %.0f MiB)\n",
                  pg.rank(), name, peak / 1048576.0, model / 1048576.0, bound / 1048576.0);
      // Rank 0 of the synced build holds the whole model, as in PyTorch's rank-0 path; eagerly
      // every rank does (the negative control: the measurement sees a whole model).
      if (build == Build::EAGER || (build == Build::SYNCED && pg.rank() == 0)) {
        EXPECT_GE(peak, model);
      } else {
        EXPECT_LE(peak, bound);
      }
    });
  }
}

}  // namespace
