// fsdp::checkpoint's get_/set_ state dict API (issue 10; PyTorch's
// torch/distributed/checkpoint/state_dict.py): a wrapped model and optimizer give the dicts of the
// same model unwrapped; the options (full, cpu_offload, frozen, submodules, strict,
// broadcast_from_rank0, flat optimizer dicts) behave as PyTorch's; each of PyTorch's error
// conditions is provoked.
#include <gtest/gtest.h>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "fsdp/state_dict_utils.h"
#include "memory_watch.h"
#include "multi_rank.h"
#include "optim_testing.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

namespace ckpt = fsdp::checkpoint;
using ckpt::StateDictOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::lm_loss;
using fsdp::testing::lm_options;
using fsdp::testing::lm_tokens;
using fsdp::testing::make_optimizer;
using fsdp::testing::osd_diff;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;
using fsdp::testing::unique_params;

namespace {

constexpr int kSteps = 2;
const StateDictOptions kFull = StateDictOptions().full_state_dict(true);

void fsdp_step(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, int step, int rank) {
  opt.zero_grad();
  auto idx = lm_tokens(2, 1000 * step + rank);
  lm_loss(model->forward(idx), idx).backward();
  opt.step();
}

// The same global batch in one process (FSDP averages the ranks' losses).
void ref_step(TinyLM& ref, torch::optim::Optimizer& opt, int step, int world) {
  opt.zero_grad();
  for (int r = 0; r < world; ++r) {
    auto idx = lm_tokens(2, 1000 * step + r);
    (lm_loss(ref->forward(idx), idx) / world).backward();
  }
  opt.step();
}

// "" if two model dicts of plain tensors have the same keys in the same order, the same dtypes
// and shapes, and values within |x - y| <= atol + rtol |y|; else the first difference.
std::string msd_diff(const StateDict& a, const StateDict& b, double rtol, double atol) {
  if (a.keys() != b.keys()) return "keys differ";
  for (const auto& [k, v] : a) {
    const at::Tensor& x = v.tensor();
    const at::Tensor& y = b.at(k).tensor();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) return k + ": dtype/shape";
    if (!torch::allclose(x, y, rtol, atol)) return k + ": values";
  }
  return "";
}

std::string osd_equal(const StateDict& a, const StateDict& b) { return osd_diff(a, b, 0, 0); }

// "" if two flat dicts have the same keys in the same order and equal values.
std::string flat_equal(const StateDict& a, const StateDict& b) {
  if (a.keys() != b.keys()) return "keys differ";
  for (const auto& [k, v] : a) {
    const auto& w = b.at(k);
    if (v.kind() != w.kind()) return k + ": kind";
    if (v.is_tensor() && !(v.tensor().scalar_type() == w.tensor().scalar_type() &&
                           torch::equal(v.tensor(), w.tensor())))
      return k + ": tensor";
    if ((v.is_double() || v.is_int()) && v.to_double() != w.to_double()) return k + ": number";
    if (v.is_list() && v.list().size() != w.list().size()) return k + ": list";
  }
  return "";
}

struct WorldCase {
  int world;
  bool orig;
};
void PrintTo(const WorldCase& c, std::ostream* os) {
  *os << "W=" << c.world << (c.orig ? " use_orig_params" : " flat");
}

class GetStateDictWorld : public ::testing::TestWithParam<WorldCase> {};

// The headline property: get_state_dict of a wrapped model and optimizer (full form) equals that
// of the same model and optimizer trained unwrapped on the same global batches, keys and order
// included; the default (sharded) form gathers to the same values bit-exactly.
TEST_P(GetStateDictWorld, WrappedEqualsUnwrapped) {
  const WorldCase c = GetParam();
  run_ranks(c.world, [c](ProcessGroup& pg) {
    TinyLM ref(7);
    auto ref_opt = make_optimizer("Adam", unique_params(ref->parameters()));
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, c.orig));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    for (int s = 0; s < kSteps; ++s) {
      ref_step(ref, *ref_opt, s, pg.size());
      fsdp_step(model, *opt, s, pg.rank());
    }
    const auto [want_m, want_o] = ckpt::get_state_dict(ref, *ref_opt, kFull);
    const auto [got_m, got_o] = ckpt::get_state_dict(model, *opt, kFull);
    // Float rounding of the reduction order only (the optimizer suite measures it against
    // hand-written data parallelism; 2 steps of Adam stay below 1e-6 here).
    EXPECT_EQ(msd_diff(got_m, want_m, 1e-5, 2e-6), "");
    EXPECT_EQ(osd_diff(got_o, want_o, 1e-5, 2e-6), "");
    EXPECT_EQ(got_m.keys(), fsdp::module_state_dict(*ref).keys());
    // Negative control: one element off must be seen.
    StateDict bad = want_m;
    bad.insert_or_assign("blocks.1.fc1.weight", want_m.at("blocks.1.fc1.weight").tensor() + 1e-3);
    EXPECT_NE(msd_diff(got_m, bad, 1e-5, 2e-6), "");

    const auto [sh_m, sh_o] = ckpt::get_state_dict(model, *opt);  // SHARDED pieces
    EXPECT_TRUE(sh_m.at("tok.weight").is_sharded_tensor());
    fsdp::testing::expect_same(fsdp::gather_state_dict(sh_m, pg), got_m, "sharded model dict");
    EXPECT_EQ(osd_equal(fsdp::gather_state_dict(sh_o, pg), got_o), "");
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, GetStateDictWorld,
                         ::testing::Values(WorldCase{1, false}, WorldCase{2, false},
                                           WorldCase{3, false}, WorldCase{4, false},
                                           WorldCase{1, true}, WorldCase{2, true},
                                           WorldCase{3, true}, WorldCase{4, true}),
                         [](const auto& info) {
                           return "W" + std::to_string(info.param.world) +
                                  (info.param.orig ? "_orig" : "_flat");
                         });

// A sharded save at W=2 loads at W=3 through set_state_dict (SHARDED pieces, then the piece
// exchange) and into an unwrapped model (full form), giving the same parameters and optimizer.
TEST(CheckpointStateDict, SetStateDictReshardsAndLoadsUnwrapped) {
  fsdp::testing::TempDir tmp, tmp_full;
  run_ranks(2, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    for (int s = 0; s < kSteps; ++s) fsdp_step(model, *opt, s, pg.rank());
    const auto [msd, osd] = ckpt::get_state_dict(model, *opt);
    fsdp::testing::save_pieces(msd, pg.rank(), tmp.path(), "m_");
    fsdp::testing::save_osd(osd, pg.rank(), tmp.path());
    const auto [fm, fo] = ckpt::get_state_dict(model, *opt, kFull);
    if (pg.rank() == 0) {
      fsdp::testing::save_pieces(fm, 0, tmp.path(), "fm_");
      fsdp::testing::save_osd(fo, 0, tmp_full.path());
    }
  });
  run_ranks(3, [&](ProcessGroup& pg) {
    TinyLM m(99);  // other weights: everything must come from the dicts
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::SHARD_GRAD_OP, true));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    const StateDict msd = fsdp::testing::load_pieces(2, tmp.path(), "m_");
    const StateDict osd = fsdp::testing::load_osd(2, tmp.path());
    ckpt::set_state_dict(model, *opt, msd, osd);
    const auto [fm, fo] = ckpt::get_state_dict(model, *opt, kFull);
    fsdp::testing::expect_same(fm, fsdp::testing::load_pieces(1, tmp.path(), "fm_"), "W=3");
    EXPECT_EQ(osd_equal(fo, fsdp::testing::load_osd(1, tmp_full.path())), "");
    (void)pg;
  });
  run_ranks(1, [&](ProcessGroup&) {
    TinyLM ref(99);
    auto opt = make_optimizer("Adam", unique_params(ref->parameters()));
    const StateDict fm = fsdp::testing::load_pieces(1, tmp.path(), "fm_");
    const StateDict fo = fsdp::testing::load_osd(1, tmp_full.path());
    ckpt::set_state_dict(ref, *opt, fm, fo, kFull);
    const auto [m2, o2] = ckpt::get_state_dict(ref, *opt, kFull);
    fsdp::testing::expect_same(m2, fm, "unwrapped");
    EXPECT_EQ(osd_equal(o2, fo), "");
  });
}

// The call sets the model's state-dict type only for itself: the caller's type and configs are
// back afterwards.
TEST(CheckpointStateDict, RestoresTheCallersStateDictType) {
  run_ranks(2, [](ProcessGroup&) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    fsdp::StateDictTypeGuard g(model, StateDictType::LOCAL_STATE_DICT);
    const StateDict sd = ckpt::get_model_state_dict(model, kFull);
    EXPECT_TRUE(sd.contains("tok.weight"));
    const StateDict local = fsdp::state_dict(model);
    EXPECT_TRUE(local.contains("_flat_param")) << "LOCAL is the caller's type again";
  });
}

// ignore_frozen_params drops the frozen projection (and nothing else), wrapped or not, and the
// cpu_offload + full combination leaves values on rank 0 only.
TEST(CheckpointStateDict, FrozenParamsAndCpuOffload) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (bool orig : {false, true}) {
      TinyLM m(7);
      FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, orig));
      TinyLM ref(7);
      const auto opts = StateDictOptions().full_state_dict(true).ignore_frozen_params(true);
      const StateDict got = ckpt::get_model_state_dict(model, opts);
      const StateDict want = ckpt::get_model_state_dict(ref, opts);
      EXPECT_FALSE(got.contains("frozen.weight"));
      EXPECT_FALSE(got.contains("frozen.bias"));
      EXPECT_TRUE(got.contains("tok.weight"));
      EXPECT_EQ(got.size() + 2, fsdp::module_state_dict(*ref).size());
      fsdp::testing::expect_same(got, want, "ignore_frozen_params");

      const StateDict off = ckpt::get_model_state_dict(
          model, StateDictOptions().full_state_dict(true).cpu_offload(true));
      EXPECT_EQ(off.empty(), pg.rank() != 0);
      const StateDict sharded_off =
          ckpt::get_model_state_dict(model, StateDictOptions().cpu_offload(true));
      EXPECT_TRUE(sharded_off.at("tok.weight").is_sharded_tensor());
    }
  });
}

// submodules restricts the keys to the given modules, with or without their prefixes; the same
// for a wrapped and a plain model.
TEST(CheckpointStateDict, SubmodulesWithAndWithoutPrefixes) {
  run_ranks(2, [](ProcessGroup&) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    TinyLM ref(7);
    for (bool keep : {true, false}) {
      const auto opts = StateDictOptions().full_state_dict(true).keep_submodule_prefixes(keep);
      const StateDict got =
          ckpt::get_model_state_dict(model, opts, ckpt::Submodules{m->blocks[1], m->head.ptr()});
      const StateDict want =
          ckpt::get_model_state_dict(ref, opts, ckpt::Submodules{ref->blocks[1], ref->head.ptr()});
      const std::vector<std::string> keys =
          keep ? std::vector<std::string>{"blocks.1.fc1.weight", "blocks.1.fc1.bias",
                                          "blocks.1.fc2.weight", "blocks.1.fc2.bias", "head.weight"}
               : std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                          "weight"};
      EXPECT_EQ(got.keys(), keys);
      fsdp::testing::expect_same(got, want, keep ? "with prefixes" : "without prefixes");
    }
    // A module of another model is not a submodule of this one.
    EXPECT_NE(error_of([&] {
                ckpt::get_model_state_dict(model, kFull, ckpt::Submodules{ref->head.ptr()});
              }).find("submodules[0]"),
              std::string::npos);
  });
}

// strict=false loads what matches and reports the rest; strict names the keys and loads nothing.
TEST(CheckpointStateDict, NonStrictReportsMissingAndUnexpectedKeys) {
  run_ranks(2, [](ProcessGroup&) {
    TinyLM src(3);
    StateDict sd = ckpt::get_model_state_dict(src, kFull);
    sd.erase("blocks.2.fc2.bias");
    sd.insert_or_assign("no.such.weight", torch::zeros({2}));

    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    TinyLM plain(7);
    const StateDict before = ckpt::get_model_state_dict(model, kFull);
    for (torch::nn::Module* target : {static_cast<torch::nn::Module*>(model.get()),
                                      static_cast<torch::nn::Module*>(plain.get())}) {
      const std::string err = error_of([&] { ckpt::set_model_state_dict(*target, sd, kFull); });
      EXPECT_NE(err.find("blocks.2.fc2.bias"), std::string::npos) << err;
      EXPECT_NE(err.find("no.such.weight"), std::string::npos) << err;
    }
    fsdp::testing::expect_same(ckpt::get_model_state_dict(model, kFull), before, "strict: none");

    for (torch::nn::Module* target : {static_cast<torch::nn::Module*>(model.get()),
                                      static_cast<torch::nn::Module*>(plain.get())}) {
      const fsdp::LoadResult r = ckpt::set_model_state_dict(
          *target, sd, StateDictOptions().full_state_dict(true).strict(false));
      EXPECT_EQ(r.missing_keys, std::vector<std::string>{"blocks.2.fc2.bias"});
      EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"no.such.weight"});
      const StateDict now = ckpt::get_model_state_dict(*target, kFull);
      EXPECT_TRUE(torch::equal(now.at("tok.weight").tensor(), sd.at("tok.weight").tensor()));
      EXPECT_TRUE(torch::equal(now.at("blocks.2.fc2.bias").tensor(),
                               before.at("blocks.2.fc2.bias").tensor()));
    }
  });
}

// The optimizer's state is created on demand by a zero-learning-rate step, which changes no
// parameter, restores the learning rate and leaves no gradient; a gradient already present with
// no state is PyTorch's error.
TEST(CheckpointStateDict, OptimizerStateIsInitialisedWithoutChangingParameters) {
  run_ranks(2, [](ProcessGroup& pg) {
    for (const auto& kind : fsdp::testing::optimizer_kinds()) {
      TinyLM m(7);
      FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
      auto opt = make_optimizer(kind, unique_params(model->parameters()));
      const StateDict before = ckpt::get_model_state_dict(model, kFull);
      const double lr = opt->param_groups()[0].options().get_lr();
      const StateDict osd = ckpt::get_optimizer_state_dict(model, *opt, kFull);
      fsdp::testing::expect_same(ckpt::get_model_state_dict(model, kFull), before, kind);
      EXPECT_EQ(opt->param_groups()[0].options().get_lr(), lr) << kind;
      for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << kind;
      if (kind != "SGD") {  // plain SGD has no state
        EXPECT_TRUE(osd.at("state").dict().contains("blocks.0.fc1.weight")) << kind;
      }
      // Training goes on as from a fresh optimizer: compare with one that never saw the init.
      TinyLM m2(7);
      FullyShardedDataParallel model2(m2, lm_options(m2, ShardingStrategy::FULL_SHARD, true));
      auto opt2 = make_optimizer(kind, unique_params(model2->parameters()));
      fsdp_step(model, *opt, 0, pg.rank());
      fsdp_step(model2, *opt2, 0, pg.rank());
      if (kind.rfind("Adam", 0) != 0) {  // Adam's bias correction counts the zero step
        fsdp::testing::expect_same(ckpt::get_model_state_dict(model, kFull),
                                   ckpt::get_model_state_dict(model2, kFull), kind + " trains on");
      }
    }
    TinyLM plain(7);
    auto opt = make_optimizer("Adam", unique_params(plain->parameters()));
    auto idx = lm_tokens(2, 1);
    lm_loss(plain->forward(idx), idx).backward();
    EXPECT_NE(error_of([&] {
                ckpt::get_optimizer_state_dict(plain, *opt);
              }).find("gradients are not None"),
              std::string::npos);
  });
}

// flatten_optimizer_state_dict: "state.<fqn>.<name>" and "param_groups.<fqn>.<key>", loadable
// back (into a wrapped and a plain model); conflicting group values are PyTorch's error.
TEST(CheckpointStateDict, FlatOptimizerStateDictRoundTrips) {
  run_ranks(2, [](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    for (int s = 0; s < kSteps; ++s) fsdp_step(model, *opt, s, pg.rank());
    const auto flat_opts =
        StateDictOptions().full_state_dict(true).flatten_optimizer_state_dict(true);
    const StateDict flat = ckpt::get_optimizer_state_dict(model, *opt, flat_opts);
    const StateDict nested = ckpt::get_optimizer_state_dict(model, *opt, kFull);
    EXPECT_TRUE(flat.at("state.blocks.1.fc1.weight.exp_avg").is_tensor());
    EXPECT_TRUE(flat.at("state.tok.weight.step").is_tensor());
    EXPECT_DOUBLE_EQ(flat.at("param_groups.blocks.1.fc1.weight.lr").to_double(), 0.01);
    EXPECT_TRUE(flat.at("param_groups.tok.weight.betas").is_list());
    EXPECT_FALSE(flat.contains("state"));
    EXPECT_EQ(flat_equal(ckpt::flatten_optim_state_dict(nested), flat), "");
    StateDict fewer = flat;  // negative control
    fewer.erase("state.tok.weight.step");
    EXPECT_NE(flat_equal(ckpt::flatten_optim_state_dict(nested), fewer), "");
    EXPECT_EQ(osd_equal(ckpt::unflatten_optim_state_dict(model, {opt.get()}, flat), nested), "");

    TinyLM m2(9);
    FullyShardedDataParallel model2(m2, lm_options(m2, ShardingStrategy::SHARD_GRAD_OP, false));
    auto opt2 = make_optimizer("Adam", unique_params(model2->parameters()));
    ckpt::set_optimizer_state_dict(model2, *opt2, flat, kFull);
    EXPECT_EQ(osd_equal(ckpt::get_optimizer_state_dict(model2, *opt2, kFull), nested), "");

    TinyLM plain(9);
    auto opt3 = make_optimizer("Adam", unique_params(plain->parameters()));
    ckpt::set_optimizer_state_dict(plain, *opt3, flat, kFull);
    EXPECT_EQ(osd_equal(ckpt::get_optimizer_state_dict(plain, *opt3, kFull), nested), "");

    StateDict conflicting = flat;
    conflicting.insert_or_assign("param_groups.blocks.1.fc1.weight.lr", 0.5);
    EXPECT_NE(error_of([&] {
                ckpt::set_optimizer_state_dict(plain, *opt3, conflicting, kFull);
              }).find("should have the same saved param_group value"),
              std::string::npos);
    StateDict odd = nested;
    StateDict st = odd.at("state").dict().at("tok.weight").dict();
    st.insert_or_assign("note", "text");
    odd.at("state").dict().insert_or_assign("tok.weight", st);
    EXPECT_NE(error_of([&] { ckpt::flatten_optim_state_dict(odd); }).find("only supports"),
              std::string::npos);
  });
}

// Two optimizers over disjoint parameters: their dicts merge into one, and each takes its own
// part back.
TEST(CheckpointStateDict, SeveralOptimizersMergeAndSplit) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto split = [](const std::vector<at::Tensor>& ps) {
      std::vector<at::Tensor> blocks, rest;
      for (size_t i = 0; i < ps.size(); ++i) (i % 2 ? blocks : rest).push_back(ps[i]);
      return std::make_pair(blocks, rest);
    };
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::FULL_SHARD, true));
    auto [a, b] = split(unique_params(model->parameters()));
    auto opt_a = make_optimizer("Adam", a);
    auto opt_b = make_optimizer("SGD_momentum", b);
    for (int s = 0; s < kSteps; ++s) {
      opt_a->zero_grad();
      opt_b->zero_grad();
      auto idx = lm_tokens(2, 1000 * s + pg.rank());
      lm_loss(model->forward(idx), idx).backward();
      opt_a->step();
      opt_b->step();
    }
    const ckpt::Optimizers opts{opt_a.get(), opt_b.get()};
    const auto [msd, osd] = ckpt::get_state_dict(model, opts);
    EXPECT_EQ(osd.at("param_groups").list().size(), 2u);

    TinyLM m2(9);
    FullyShardedDataParallel model2(m2, lm_options(m2, ShardingStrategy::FULL_SHARD, true));
    auto [a2, b2] = split(unique_params(model2->parameters()));
    auto opt_a2 = make_optimizer("Adam", a2);
    auto opt_b2 = make_optimizer("SGD_momentum", b2);
    const ckpt::Optimizers opts2{opt_a2.get(), opt_b2.get()};
    ckpt::set_state_dict(model2, opts2, msd, osd);
    EXPECT_EQ(osd_equal(ckpt::get_optimizer_state_dict(model2, opts2, kFull),
                        ckpt::get_optimizer_state_dict(model, opts, kFull)),
              "");
    // Each optimizer took its own part (the lower-level export takes one optimizer alone).
    {
      fsdp::StateDictTypeGuard g2(model2, StateDictType::FULL_STATE_DICT);
      fsdp::StateDictTypeGuard g1(model, StateDictType::FULL_STATE_DICT);
      EXPECT_EQ(
          osd_equal(fsdp::optim_state_dict(model2, *opt_b2), fsdp::optim_state_dict(model, *opt_b)),
          "");
    }
    // Through this API, one optimizer that holds part of a unit's trainable parameters is
    // PyTorch's error (PyTorch's "... is not in the optimizer state").
    const std::string err =
        error_of([&] { ckpt::get_optimizer_state_dict(model2, *opt_b2, kFull); });
    EXPECT_NE(err.find("is not in the optimizer state"), std::string::npos) << err;
  });
}

// broadcast_from_rank0 at W=3: rank 0 alone holds the full dicts; every rank ends with the
// source's parameters and optimizer state, and the next step matches too.
TEST(CheckpointStateDict, BroadcastFromRank0) {
  run_ranks(3, [](ProcessGroup& pg) {
    for (bool orig : {false, true}) {
      TinyLM m(7);
      FullyShardedDataParallel src(m, lm_options(m, ShardingStrategy::FULL_SHARD, orig));
      auto src_opt = make_optimizer("Adam", unique_params(src->parameters()));
      for (int s = 0; s < kSteps; ++s) fsdp_step(src, *src_opt, s, pg.rank());
      const auto off = StateDictOptions().full_state_dict(true).cpu_offload(true);
      const auto [msd, osd] = ckpt::get_state_dict(src, *src_opt, off);  // rank 0 only
      EXPECT_EQ(msd.empty(), pg.rank() != 0);
      EXPECT_EQ(osd.empty(), pg.rank() != 0) << "the optimizer's too, on ranks > 0";

      TinyLM m2(99);
      FullyShardedDataParallel dst(m2, lm_options(m2, ShardingStrategy::SHARD_GRAD_OP, !orig));
      auto dst_opt = make_optimizer("Adam", unique_params(dst->parameters()));
      ckpt::set_state_dict(dst, *dst_opt, msd, osd,
                           StateDictOptions().full_state_dict(true).broadcast_from_rank0(true));
      fsdp::testing::expect_same(ckpt::get_model_state_dict(dst, kFull),
                                 ckpt::get_model_state_dict(src, kFull), "model");
      EXPECT_EQ(osd_equal(ckpt::get_optimizer_state_dict(dst, *dst_opt, kFull),
                          ckpt::get_optimizer_state_dict(src, *src_opt, kFull)),
                "");
      fsdp_step(src, *src_opt, 5, pg.rank());
      fsdp_step(dst, *dst_opt, 5, pg.rank());
      EXPECT_EQ(msd_diff(ckpt::get_model_state_dict(dst, kFull),
                         ckpt::get_model_state_dict(src, kFull), 1e-6, 1e-7),
                "");
    }
    // Plain replicas: rank 0's values reach every rank.
    TinyLM a(pg.rank() == 0 ? 1 : 2);
    const StateDict mine = pg.rank() == 0 ? ckpt::get_model_state_dict(a, kFull) : StateDict();
    TinyLM b(5);
    ckpt::set_model_state_dict(b, mine,
                               StateDictOptions().full_state_dict(true).broadcast_from_rank0(true));
    fsdp::testing::expect_same(ckpt::get_model_state_dict(b, kFull),
                               ckpt::get_model_state_dict(*TinyLM(1), kFull), "replica");
  });
}

// A model of six equal units: loading from rank 0 must not hold the model (or the optimizer
// state) whole on any rank. Measured with LibTorch's allocator reporting.
struct StackImpl : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  StackImpl() {
    fsdp::testing::seed_cpu(3);
    for (int i = 0; i < 6; ++i)
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(48, 48)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(fsdp::forward(l, x));
    return x;
  }
};
TORCH_MODULE(Stack);

TEST(CheckpointStateDict, BroadcastFromRank0HoldsAboutOneUnit) {
  run_ranks(3, [](ProcessGroup& pg) {
    auto make = [] {
      Stack s;
      fsdp::FullyShardedOptions o;
      for (auto& l : s->layers) o.units().push_back(l.ptr());
      return std::make_pair(s, FullyShardedDataParallel(s, o));
    };
    auto [s1, src] = make();
    auto src_opt = make_optimizer("Adam", src->parameters());
    src_opt->zero_grad();
    src->forward(torch::ones({2, 48}) * (pg.rank() + 1)).sum().backward();
    src_opt->step();
    const auto off = StateDictOptions().full_state_dict(true).cpu_offload(true);
    const auto [msd, osd] = ckpt::get_state_dict(src, *src_opt, off);

    auto [s2, dst] = make();
    auto dst_opt = make_optimizer("Adam", dst->parameters());
    ckpt::get_optimizer_state_dict(dst, *dst_opt);  // state exists before the measurement
    const int64_t unit = 48 * 49 * 4;               // one unit, unsharded, float32
    const int64_t model_bytes = 6 * unit;
    const auto bcast = StateDictOptions().full_state_dict(true).broadcast_from_rank0(true);
    int64_t model_peak = 0, optim_peak = 0, control_peak = 0;
    {
      fsdp::testing::MemoryWatch watch;
      ckpt::set_model_state_dict(dst, msd, bcast);
      model_peak = watch.peak();
    }
    {
      fsdp::testing::MemoryWatch watch;
      ckpt::set_optimizer_state_dict(dst, *dst_opt, osd, bcast);
      optim_peak = watch.peak();
    }
    {  // Negative control: the watch sees a model-sized allocation.
      fsdp::testing::MemoryWatch watch;
      at::Tensor whole = torch::empty({model_bytes / 4});
      control_peak = watch.peak();
    }
    EXPECT_GE(control_peak, model_bytes);
    // The model: one parameter in flight (the largest is 48 x 48), copied into the shard.
    EXPECT_LE(model_peak, unit + 1024);
    // The optimizer (two state tensors per parameter): the new state this rank builds (its shard
    // of the state, replacing the old one) plus one state tensor in flight.
    const int64_t state_shard = 2 * model_bytes / pg.size();
    EXPECT_LE(optim_peak, state_shard + unit + 4096);
    EXPECT_LT(optim_peak, model_bytes) << "less than half of the whole state";
    // The largest figures over the ranks (rank 0 sends from its dict; the others receive).
    at::Tensor peaks = torch::tensor({model_peak, optim_peak}, at::kLong);
    pg.all_reduce(peaks, fsdp::dist::ReduceOp::MAX);
    if (pg.rank() == 0) {
      std::printf(
          "broadcast_from_rank0 at W=%d, largest peak extra bytes on a rank: model %lld (one "
          "unit %lld, whole model %lld); optimizer %lld (a rank's share of the state %lld, "
          "whole state %lld)\n",
          pg.size(), static_cast<long long>(peaks[0].item<int64_t>()), static_cast<long long>(unit),
          static_cast<long long>(model_bytes), static_cast<long long>(peaks[1].item<int64_t>()),
          static_cast<long long>(state_shard), static_cast<long long>(2 * model_bytes));
    }
    fsdp::testing::expect_same(ckpt::get_model_state_dict(dst, kFull),
                               ckpt::get_model_state_dict(src, kFull), "stack");
    EXPECT_EQ(osd_equal(ckpt::get_optimizer_state_dict(dst, *dst_opt, kFull),
                        ckpt::get_optimizer_state_dict(src, *src_opt, kFull)),
              "");
  });
}

// Each of PyTorch's verification errors, provoked.
TEST(CheckpointStateDict, SeedErrorsAreRaised) {
  run_ranks(2, [](ProcessGroup&) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    auto has = [](const std::string& err, const std::string& what) {
      EXPECT_NE(err.find(what), std::string::npos) << "expected '" << what << "' in: " << err;
    };
    has(error_of([&] {
          ckpt::get_model_state_dict(model, StateDictOptions().broadcast_from_rank0(true));
        }),
        "full_state_dict must be True when broadcast_from_rank0 is True");
    has(error_of([&] { ckpt::get_optimizer_state_dict(model, ckpt::Optimizers{}); }),
        "Optimizers are not passed in but optim_only is set to True");
    has(error_of([&] { ckpt::set_model_state_dict(model, StateDict(), kFull); }),
        "model state_dict is empty");
    has(error_of([&] { ckpt::set_optimizer_state_dict(model, *opt, StateDict(), kFull); }),
        "optim state_dict is empty");
    StateDict local;
    {
      fsdp::StateDictTypeGuard g(model, StateDictType::LOCAL_STATE_DICT);
      local = fsdp::state_dict(model);
    }
    has(error_of([&] { ckpt::set_model_state_dict(model, local); }), "contains _flat_param");
    // A plain module holding the wrapped model, and the wrapped model's inner module.
    auto outer = std::make_shared<torch::nn::Module>();
    outer->register_module("inner", model.ptr());
    has(error_of([&] { ckpt::get_model_state_dict(*outer, kFull); }), "'inner'");
    has(error_of([&] { ckpt::get_model_state_dict(*model->module(), kFull); }),
        "the module itself");
    // Empty dicts are fine where the options say values may be absent.
    EXPECT_EQ(ckpt::set_model_state_dict(model, StateDict(), StateDictOptions(kFull).strict(false))
                  .missing_keys.size(),
              0u);
    // An empty model: nothing to save is an error unless the options allow it.
    auto empty = std::make_shared<torch::nn::Module>();
    has(error_of([&] { ckpt::get_model_state_dict(*empty); }), "model state_dict is empty");
    EXPECT_TRUE(ckpt::get_model_state_dict(*empty, StateDictOptions().strict(false)).empty());
  });
}

}  // namespace
