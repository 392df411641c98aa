// The C++ side of the Python-FSDP oracle (tests/oracle/run_oracle.py drives it; issue 8).
//
// Run as W processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
//
//   oracle_fsdp --data DIR --out ROOT [--fault drop-grad-rank1|grad-sum|padding] CASE...
//
// For each CASE, STRATEGY:ORIG[:ac] (e.g. FULL_SHARD:1 = FULL_SHARD with use_orig_params; ":ac"
// checkpoints every Block's activations, as Python's apply_activation_checkpointing), it builds
// fsdp::testing::TinyLM, loads the initial weights from DIR/init.safetensors, wraps it (units:
// `frozen` and every Block, the root holding tok/head/scale), trains with torch::optim::Adam over
// the de-duplicated parameters on this rank's rows of each global batch in
// DIR/batches.safetensors, and writes ROOT/W<W>_<STRATEGY>_<orig|flat>[_ac]/ in the format
// tests/oracle/fsdp_oracle.py documents: full.safetensors (rank 0), sharded_r<r>.{json,
// safetensors}, local_r<r>.{json,safetensors}, layout_r<r>.json.
//
// Faults (negative controls; the oracle must then fail):
//   drop-grad-rank1  in the second step rank 1 contributes a zero gradient to the reduction
//                    (its loss is multiplied by 0 before backward; collectives run as usual)
//   grad-sum         every rank's loss is multiplied by W: the reduction sums instead of averaging
//   padding          rank W-1 reports one element more of padding (and one less of data) for
//                    blocks.0's flat parameter, in its LOCAL state dict and its layout
//   optim-state      before the optimizer state dicts are taken, rank 1 scales its shard of
//                    every exp_avg by 1.01 (the model state dicts stay right)
//
// It also writes the optimizer state dicts (issue 9): optim_full.safetensors (rank 0, FULL) and
// optim_sharded_r<r>.{json,safetensors} (SHARDED), "state" flattened to "<fqn>/<state>" keys.
#include <torch/torch.h>

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/errors.h"
#include "fsdp/fsdp.h"
#include "fsdp/model_state_dict.h"
#include "safetensors_io.h"
#include "tiny_lm.h"

namespace st = fsdp::testing::safetensors;
namespace json = fsdp::testing::json;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateDictType;
using fsdp::testing::BlockImpl;
using fsdp::testing::TinyLM;

namespace {

struct Config {
  int64_t steps = 0, batch = 0, seq = 0, vocab = 0;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0;
};

struct Args {
  std::string data, out, fault;
  std::vector<std::string> cases;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "oracle_fsdp: " << why
            << "\nusage: oracle_fsdp --data DIR --out ROOT "
               "[--fault drop-grad-rank1|grad-sum|padding|optim-state] STRATEGY:0|1 ...\n";
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(s + " needs a value");
      return argv[++i];
    };
    if (s == "--data")
      a.data = value();
    else if (s == "--out")
      a.out = value();
    else if (s == "--fault")
      a.fault = value();
    else if (!s.empty() && s[0] == '-')
      usage("unknown option " + s);
    else
      a.cases.push_back(s);
  }
  if (a.data.empty() || a.out.empty() || a.cases.empty()) usage("missing arguments");
  if (!a.fault.empty() && a.fault != "drop-grad-rank1" && a.fault != "grad-sum" &&
      a.fault != "padding" && a.fault != "optim-state")
    usage("unknown fault " + a.fault);
  return a;
}

ShardingStrategy strategy_from(const std::string& s) {
  for (auto x :
       {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
        ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2})
    if (s == fsdp::to_string(x)) return x;
  usage("unknown strategy " + s);
}

int64_t meta_int(const st::File& f, const std::string& k) { return std::stoll(f.meta(k)); }
double meta_double(const st::File& f, const std::string& k) { return std::stod(f.meta(k)); }

void make_dirs(const std::string& path) {
  std::string cur;
  std::istringstream is(path);
  if (!path.empty() && path[0] == '/') cur = "/";
  for (std::string part; std::getline(is, part, '/');) {
    if (part.empty()) continue;
    cur += part + "/";
    ::mkdir(cur.c_str(), 0755);
  }
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode))
    throw std::runtime_error("cannot create directory " + path);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

// Copies the initial weights into the unwrapped model (the tied head weight is tok.weight).
void load_init(TinyLM& model, const st::File& init) {
  torch::NoGradGuard ng;
  size_t used = 0;
  for (const auto& p : model->named_parameters(true)) {
    if (p.key() == "head.weight") continue;  // the same tensor as tok.weight
    const at::Tensor& src = init.at(p.key());
    if (src.sizes() != p.value().sizes() || src.scalar_type() != p.value().scalar_type())
      throw std::runtime_error("init: shape or dtype mismatch for " + p.key());
    p.value().copy_(src);
    ++used;
  }
  for (const auto& b : model->named_buffers(true)) {
    b.value().copy_(init.at(b.key()));
    ++used;
  }
  if (used != init.tensors.size())
    throw std::runtime_error("init: file holds tensors the model does not have");
  if (!model->head->weight.is_same(model->tok->weight))
    throw std::runtime_error("init: tied weight is not shared");
}

std::string shard_md_json(const fsdp::ShardMetadata& m) {
  return "{\"offsets\": " + json::int_list(m.offsets) + ", \"sizes\": " + json::int_list(m.sizes) +
         ", \"rank\": " + std::to_string(m.placement_rank) + "}";
}

// Describes a SHARDED or LOCAL state dict as fsdp_oracle.describe_state_dict does, and collects
// the tensors to save. `fault_key`: shrink the local piece of this key by one element.
std::string describe(const StateDict& sd, std::vector<std::pair<std::string, at::Tensor>>& out,
                     const std::string& fault_key) {
  std::string j = "{\"keys\": [";
  bool first = true;
  for (const auto& [k, v] : sd) {
    j += first ? "\n " : ",\n ";
    first = false;
    if (v.is_sharded_tensor()) {
      const auto& t = v.sharded_tensor();
      std::string local = "[", glob = "[";
      for (size_t i = 0; i < t.local_shards().size(); ++i) {
        fsdp::Shard s = t.local_shards()[i];
        if (k == fault_key) {
          s.metadata.sizes[0] -= 1;
          s.tensor = s.tensor.narrow(0, 0, s.metadata.sizes[0]);
        }
        local += (i ? ", " : "") + shard_md_json(s.metadata);
        out.emplace_back(k + "#" + std::to_string(i), s.tensor.detach().clone().contiguous());
      }
      for (size_t i = 0; i < t.global_metadata().size(); ++i) {
        fsdp::ShardMetadata m = t.global_metadata()[i];
        if (k == fault_key && m.offsets == t.local_shards().at(0).metadata.offsets) m.sizes[0] -= 1;
        glob += (i ? ", " : "") + shard_md_json(m);
      }
      j += "{\"key\": " + json::quote(k) + ", \"type\": \"sharded\", \"dtype\": \"" +
           st::dtype_name(t.dtype()) + "\", \"shape\": " + json::int_list(t.size()) +
           ", \"local\": " + local + "], \"global\": " + glob + "]}";
    } else if (v.is_tensor()) {
      const auto& t = v.tensor();
      j += "{\"key\": " + json::quote(k) + ", \"type\": \"tensor\", \"dtype\": \"" +
           st::dtype_name(t.scalar_type()) + "\", \"shape\": " + json::int_list(t.sizes().vec()) +
           "}";
      out.emplace_back(k, t.detach().clone().contiguous());
    } else {
      j += "{\"key\": " + json::quote(k) + ", \"type\": \"" + fsdp::to_string(v.kind()) + "\"}";
    }
  }
  return j + "\n]}\n";
}

void write_described(FullyShardedDataParallel& model, StateDictType type, const std::string& dir,
                     const std::string& stem, int rank, const std::string& fault_key) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string desc;
  try {
    StateDict sd;
    {
      fsdp::StateDictTypeGuard g(model, type);
      sd = fsdp::state_dict(model);
    }
    desc = describe(sd, tensors, fault_key);
  } catch (const fsdp::Error& e) {  // recorded and compared, as the Python side does
    desc = "{\"error\": " + json::quote(e.what()) + "}\n";
    tensors.clear();
  }
  write_text(dir + "/" + stem + "_r" + std::to_string(rank) + ".json", desc);
  st::write(dir + "/" + stem + "_r" + std::to_string(rank) + ".safetensors", tensors);
}

// A StateValue of a param group as JSON (numbers, bools, None, strings and lists of them), the
// way Python's json.dumps writes the same group.
std::string json_value(const fsdp::StateValue& v) {
  if (v.is_none()) return "null";
  if (v.is_bool()) return v.to_bool() ? "true" : "false";
  if (v.is_int()) return std::to_string(v.to_int());
  if (v.is_string()) return json::quote(v.string());
  if (v.is_double()) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.17g", v.to_double());
    std::string out = buf;
    if (out.find_first_of(".eEn") == std::string::npos) out += ".0";  // json.dumps(1.0) = "1.0"
    return out;
  }
  if (v.is_list()) {
    std::string out = "[";
    for (size_t i = 0; i < v.list().size(); ++i) out += (i ? ", " : "") + json_value(v.list()[i]);
    return out + "]";
  }
  throw std::runtime_error(std::string("param group value of kind ") + fsdp::to_string(v.kind()));
}

// "state" of an optimizer state dict flattened to "<fqn>/<state>" keys.
StateDict flatten_osd(const StateDict& osd) {
  StateDict flat;
  for (const auto& [fqn, st] : osd.at("state").dict())
    for (const auto& [k, v] : st.dict()) flat.insert_or_assign(fqn + "/" + k, v);
  return flat;
}

void write_optim(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                 const std::string& dir, int rank) {
  {
    fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT, fsdp::FullStateDictConfig(),
                               fsdp::FullOptimStateDictConfig().offload_to_cpu(false));
    const StateDict osd = fsdp::optim_state_dict(model, opt);
    if (rank == 0) {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      std::string order = "[";
      for (const auto& [k, v] : flatten_osd(osd)) {
        order += (tensors.empty() ? "" : ", ") + json::quote(k);
        tensors.emplace_back(k, v.tensor().contiguous());
      }
      std::string groups = "[";
      for (const auto& g : osd.at("param_groups").list()) {
        groups += groups.size() > 1 ? ", {" : "{";
        bool first = true;
        for (const auto& [k, v] : g.dict()) {
          groups += (first ? "" : ", ") + json::quote(k) + ": " + json_value(v);
          first = false;
        }
        groups += "}";
      }
      st::write(dir + "/optim_full.safetensors", tensors,
                {{"order", order + "]"}, {"param_groups", groups + "]"}});
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string desc;
  try {
    fsdp::StateDictTypeGuard g(model, StateDictType::SHARDED_STATE_DICT,
                               fsdp::ShardedStateDictConfig(),
                               fsdp::ShardedOptimStateDictConfig().offload_to_cpu(false));
    desc = describe(flatten_osd(fsdp::optim_state_dict(model, opt)), tensors, "");
  } catch (const fsdp::Error& e) {
    desc = "{\"error\": " + json::quote(e.what()) + "}\n";
    tensors.clear();
  }
  write_text(dir + "/optim_sharded_r" + std::to_string(rank) + ".json", desc);
  st::write(dir + "/optim_sharded_r" + std::to_string(rank) + ".safetensors", tensors);
}

std::string describe_layouts(FullyShardedDataParallel& model, bool fault_padding) {
  auto handles = model->handles();
  auto names = model->unit_names();
  std::string j = "{\"units\": {";
  for (size_t u = 0; u < handles.size(); ++u) {
    const fsdp::FlatParamHandle& h = *handles[u];
    const auto& l = h.layout();
    std::string fqns = "[", mask = "[";
    for (size_t i = 0; i < l.fqns.size(); ++i) fqns += (i ? ", " : "") + json::quote(l.fqns[i]);
    for (size_t i = 0; i < l.is_padding_mask.size(); ++i)
      mask += std::string(i ? ", " : "") + (l.is_padding_mask[i] ? "true" : "false");
    int64_t padded =
        h.uses_sharded_strategy() ? l.shard_numel_padded(h.rank()) : l.shard_numel_padded(0);
    if (fault_padding && names[u] == "blocks.0" && h.rank() == h.world_size() - 1) padded += 1;
    j += std::string(u ? "," : "") + "\n " + json::quote(names[u]) + ": {\"fqns\": " + fqns +
         "], \"numels_with_padding\": " + json::int_list(l.numels_with_padding) +
         ", \"is_padding_mask\": " + mask +
         "], \"unpadded_unsharded_numel\": " + std::to_string(l.unpadded_unsharded_numel) +
         ", \"local_numel\": " + std::to_string(h.flat_param().numel()) +
         ", \"shard_numel_padded\": " + std::to_string(padded) + "}";
  }
  return j + "\n}}\n";
}

void run_case(const std::string& spec, const Args& args, const Config& cfg, const st::File& init,
              const st::File& batches, fsdp::dist::ProcessGroup& pg) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos) usage("case must be STRATEGY:0|1[:ac], got " + spec);
  const ShardingStrategy strategy = strategy_from(spec.substr(0, colon));
  const std::string rest = spec.substr(colon + 1);
  const bool orig = rest.substr(0, 1) == "1";
  const bool ac = rest.size() > 1;
  if (ac && rest.substr(1) != ":ac") usage("case must be STRATEGY:0|1[:ac], got " + spec);
  const int rank = pg.rank(), world = pg.size();
  const std::string dir = args.out + "/W" + std::to_string(world) + "_" +
                          fsdp::to_string(strategy) + (orig ? "_orig" : "_flat") +
                          (ac ? "_ac" : "");
  make_dirs(dir);

  TinyLM m(0);
  load_init(m, init);
  FullyShardedDataParallel model(
      m, fsdp::FullyShardedOptions()
             .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<BlockImpl>())
             .units({m->frozen.ptr()})
             .sharding_strategy(strategy)
             .use_orig_params(orig));
  if (ac) fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_module_types<BlockImpl>());
  torch::optim::Adam opt(
      fsdp::testing::unique_params(model->parameters()),
      torch::optim::AdamOptions(cfg.lr).betas(std::make_tuple(cfg.beta1, cfg.beta2)).eps(cfg.eps));
  if (cfg.batch % world) throw std::runtime_error("global batch does not split over the ranks");
  const int64_t b = cfg.batch / world;
  for (int64_t k = 0; k < cfg.steps; ++k) {
    const at::Tensor idx = batches.at("idx_" + std::to_string(k)).narrow(0, rank * b, b);
    const at::Tensor tgt = batches.at("tgt_" + std::to_string(k)).narrow(0, rank * b, b);
    opt.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(
        model->forward(idx).reshape({-1, cfg.vocab}), tgt.reshape({-1}));
    if (args.fault == "drop-grad-rank1" && k == 1 && rank == 1) loss = loss * 0.0;
    if (args.fault == "grad-sum") loss = loss * static_cast<double>(world);
    loss.backward();
    opt.step();
  }

  {
    fsdp::StateDictTypeGuard g(model, StateDictType::FULL_STATE_DICT);
    StateDict full = fsdp::state_dict(model);
    if (rank == 0) {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      std::string order = "[";
      for (const auto& [k, v] : full) {
        order += (tensors.empty() ? "" : ", ") + json::quote(k);
        tensors.emplace_back(k, v.tensor());
      }
      st::write(dir + "/full.safetensors", tensors, {{"order", order + "]"}});
    }
  }
  const bool fault_padding = args.fault == "padding" && rank == world - 1;
  write_described(model, StateDictType::SHARDED_STATE_DICT, dir, "sharded", rank, "");
  write_described(model, StateDictType::LOCAL_STATE_DICT, dir, "local", rank,
                  fault_padding ? "blocks.0._flat_param" : "");
  write_text(dir + "/layout_r" + std::to_string(rank) + ".json",
             describe_layouts(model, args.fault == "padding"));
  if (args.fault == "optim-state" && rank == 1) {
    torch::NoGradGuard ng;
    for (auto& [key, state] : opt.state()) {
      static_cast<torch::optim::AdamParamState&>(*state).exp_avg().mul_(1.01);
    }
  }
  write_optim(model, opt, dir, rank);
  pg.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Args args = parse_args(argc, argv);
  try {
    auto pg = fsdp::dist::init_process_group(fsdp::dist::InitOptions().backend("gloo"));
    const st::File init = st::read(args.data + "/init.safetensors");
    const st::File batches = st::read(args.data + "/batches.safetensors");
    Config cfg;
    cfg.steps = meta_int(batches, "steps");
    cfg.batch = meta_int(batches, "batch");
    cfg.seq = meta_int(batches, "seq");
    cfg.vocab = meta_int(batches, "vocab");
    cfg.lr = meta_double(batches, "lr");
    cfg.beta1 = meta_double(batches, "beta1");
    cfg.beta2 = meta_double(batches, "beta2");
    cfg.eps = meta_double(batches, "eps");
    if (cfg.vocab != TinyLM::Impl::kVocab) throw std::runtime_error("vocab differs from TinyLM's");
    for (const auto& c : args.cases) run_case(c, args, cfg, init, batches, pg);
    fsdp::dist::destroy_process_group();
  } catch (const std::exception& e) {
    const char* r = std::getenv("RANK");
    std::cerr << "oracle_fsdp rank " << (r ? r : "?") << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
