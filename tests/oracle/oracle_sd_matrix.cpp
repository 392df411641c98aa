// The C++ side of the state-dict matrix oracle (tests/oracle/sd_matrix.py drives it; issue 37).
//
// Run as W processes with torchrun's environment:
//
//   oracle_sd_matrix --data DIR --out OUT --python PY --strategy S --orig 0|1 --combos N,N,...
//
// Builds fsdp::testing::matrix::MatrixNet from DIR/init1.safetensors, wraps it with strategy S
// (and use_orig_params), trains 2 steps on this rank's rows of DIR/tokens.safetensors with the
// five optimizers, and writes (tests/oracle/sd_exchange.py's format) OUT/truth (rank 0: the full
// model and optimizer dicts) and, for each combination N of StateDictOptions (the indexing of
// tests/state_dict/test_sd_matrix.cpp, pieces cut as PyTorch's FSDP cuts them:
// ShardLayout::DIM0_CHUNKS):
//   OUT/get_cN_r<rank>   what get_state_dict returned on this rank, or the error it raised;
//   OUT/getflat_cN_r<rank>  the same with the default layout (FLAT_SHARDS), for sharded combos;
//   OUT/set_cN           a model built from DIR/init9.safetensors after set_state_dict of the
//                        dicts *Python's* get returned on each rank (PY/get_cN_r<rank>), as
//                        rank 0's full dicts; or the error (every rank fails alike).
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "fsdp/fsdp.h"
#include "sd_exchange.h"
#include "sd_matrix_model.h"

namespace ckpt = fsdp::checkpoint;
namespace mx = fsdp::testing::matrix;
namespace sdx = fsdp::testing::sdx;
using fsdp::FullyShardedDataParallel;
using fsdp::StateDict;

namespace {

struct Args {
  std::string data, out, python, strategy;
  bool orig = false;
  std::vector<int> combos;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "oracle_sd_matrix: " << why
            << "\nusage: oracle_sd_matrix --data DIR --out OUT --python PY --strategy S "
               "--orig 0|1 --combos N,N,...\n";
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (i + 1 >= argc) usage(s + " needs a value");
    const std::string v = argv[++i];
    if (s == "--data") {
      a.data = v;
    } else if (s == "--out") {
      a.out = v;
    } else if (s == "--python") {
      a.python = v;
    } else if (s == "--strategy") {
      a.strategy = v;
    } else if (s == "--orig") {
      a.orig = v == "1";
    } else if (s == "--combos") {
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) a.combos.push_back(std::stoi(t));
    } else {
      usage("unknown option " + s);
    }
  }
  if (a.data.empty() || a.out.empty() || a.python.empty() || a.strategy.empty())
    usage("missing arguments");
  return a;
}

fsdp::ShardingStrategy strategy_from(const std::string& s) {
  for (auto x : {fsdp::ShardingStrategy::FULL_SHARD, fsdp::ShardingStrategy::SHARD_GRAD_OP,
                 fsdp::ShardingStrategy::NO_SHARD, fsdp::ShardingStrategy::HYBRID_SHARD})
    if (s == fsdp::to_string(x)) return x;
  usage("unknown strategy " + s);
}

// The options of combination i (tests/state_dict/test_sd_matrix.cpp's combo_at).
ckpt::StateDictOptions options_of(int i) {
  return ckpt::StateDictOptions()
      .full_state_dict(i & 1)
      .cpu_offload(i & 2)
      .broadcast_from_rank0(i & 4)
      .flatten_optimizer_state_dict(i & 8)
      .ignore_frozen_params(i & 16)
      .strict(i & 32)
      .keep_submodule_prefixes(i / 64 != 2)
      .shard_layout(fsdp::ShardLayout::DIM0_CHUNKS);
}

struct Model {
  mx::MatrixNet net;
  FullyShardedDataParallel model{nullptr};
  mx::Optimizers optims;
  // The twin PyTorch can take (sd_matrix_model.h's Variant).
  Model(const Args& a, int seed, fsdp::dist::ProcessGroup& pg)
      : net(seed, mx::Variant{false, false, a.orig}) {
    const auto init =
        fsdp::testing::safetensors::read(a.data + "/init" + std::to_string(seed) + ".safetensors");
    StateDict sd;
    for (const auto& key : fsdp::module_state_dict(*net).keys())
      sd.insert_or_assign(key, init.at(key));
    fsdp::load_module_state_dict(*net, sd);
    // Hybrid: shard groups of W ranks (2 x 2 at W=4), as sd_matrix.py's twin (PyTorch's FSDP
    // runs a one-rank shard group as NO_SHARD over it, without reducing across replicas).
    model = FullyShardedDataParallel(
        net, mx::matrix_options(net, strategy_from(a.strategy), a.orig, pg.size(),
                                pg.size() == 4 ? 2 : pg.size()));
    std::vector<std::vector<at::Tensor>> params(mx::unit_names().size());
    for (const auto& pf : model->param_fqns()) params[mx::unit_of(pf.fqns[0])].push_back(pf.param);
    optims = mx::make_optimizers(params);
  }
  StateDict truth() {
    auto [m, o] =
        ckpt::get_state_dict(model, optims.list(), ckpt::StateDictOptions().full_state_dict(true));
    StateDict out;
    out.insert_or_assign("model", m);
    out.insert_or_assign("optim", o);
    return out;
  }
};

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Args a = parse_args(argc, argv);
  fsdp::dist::ProcessGroup pg =
      fsdp::dist::init_process_group(fsdp::dist::InitOptions().timeout(std::chrono::seconds(60)));
  const int rank = pg.rank(), world = pg.size();
  const auto tokens = fsdp::testing::safetensors::read(a.data + "/tokens.safetensors");
  Model src(a, 1, pg);
  for (int s = 0; s < 2; ++s) {
    src.optims.zero_grad();
    const int64_t n = mx::kGlobalRows / world;
    at::Tensor idx = tokens.at("step" + std::to_string(s)).narrow(0, rank * n, n);
    mx::matrix_loss(src.model->forward(idx), idx).backward();
    src.optims.step();
  }
  const StateDict truth = src.truth();
  if (rank == 0) sdx::write(truth, a.out + "/truth");
  for (int k : a.combos) {
    const auto opts = options_of(k);
    const ckpt::Submodules subs =
        k / 64 ? ckpt::Submodules{src.net->blocks[1]} : ckpt::Submodules{};
    // What get_state_dict returns with `o` on this rank, or the error it raised, as OUT/<name>.
    auto write_get = [&](const ckpt::StateDictOptions& o, const std::string& name) {
      const std::string stem =
          a.out + "/" + name + "_c" + std::to_string(k) + "_r" + std::to_string(rank);
      try {
        auto [msd, osd] = ckpt::get_state_dict(src.model, src.optims.list(), o, subs);
        StateDict got;
        got.insert_or_assign("model", msd);
        got.insert_or_assign("optim", osd);
        sdx::write(got, stem);
      } catch (const fsdp::Error& e) {
        sdx::write_error(std::string("fsdp::Error: ") + e.what(), stem);
      }
    };
    write_get(opts, "get");
    // The default layout too (ShardLayout::FLAT_SHARDS: a flat shard's pieces as boxes, not
    // PyTorch's dim-0 chunks): sd_matrix.py assembles every rank's pieces of both into whole
    // tensors and compares those with PyTorch's (issue 62).
    if (!opts.full_state_dict()) {
      write_get(options_of(k).shard_layout(fsdp::ShardLayout::FLAT_SHARDS), "getflat");
    }
    // set: Python's dicts of this rank (those of its get without cpu_offload where PyTorch cannot
    // offload on the CPU: see sd_matrix.py). Every rank must have one, or none tries.
    std::string py_stem = a.python + "/getref_c" + std::to_string(k) + "_r" + std::to_string(rank);
    if (!sdx::has_dict(py_stem))
      py_stem = a.python + "/get_c" + std::to_string(k) + "_r" + std::to_string(rank);
    const auto have = pg.all_gather_bytes(sdx::has_dict(py_stem) ? "1" : "0");
    bool all = true;
    for (const auto& h : have) all = all && h == "1";
    if (!all) continue;
    const StateDict theirs = sdx::read(py_stem);
    Model dst(a, 9, pg);
    const std::string set_stem = a.out + "/set_c" + std::to_string(k);
    try {
      ckpt::set_state_dict(dst.model, dst.optims.list(), theirs.at("model").dict(),
                           theirs.at("optim").dict(), opts);
    } catch (const fsdp::Error& e) {
      if (rank == 0) sdx::write_error(std::string("fsdp::Error: ") + e.what(), set_stem);
      continue;
    }
    const StateDict after = dst.truth();
    if (rank == 0) sdx::write(after, set_stem);
  }
  pg.barrier();
  fsdp::dist::destroy_process_group();
  return 0;
}
