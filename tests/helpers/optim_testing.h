// Optimizer-state-dict helpers for tests: the optimizers under test, a comparison of two dicts
// that reports the first difference, and saving a (SHARDED) dict's pieces to files.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "fsdp/optim_state_dict.h"
#include "state_dict_testing.h"

namespace fsdp {
namespace testing {

/// The optimizer variants the suites run: each state name of the five optimizers occurs.
inline const std::vector<std::string>& optimizer_kinds() {
  static const std::vector<std::string> k{"Adam",
                                          "AdamW_amsgrad",
                                          "SGD",
                                          "SGD_momentum",
                                          "Adagrad",
                                          "RMSprop",
                                          "RMSprop_momentum_centered"};
  return k;
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                               std::vector<at::Tensor> params) {
  namespace o = torch::optim;
  if (kind == "Adam") return std::make_unique<o::Adam>(params, o::AdamOptions(0.01).eps(1e-3));
  if (kind == "AdamW_amsgrad")
    return std::make_unique<o::AdamW>(params, o::AdamWOptions(0.01).eps(1e-3).amsgrad(true));
  if (kind == "SGD") return std::make_unique<o::SGD>(params, o::SGDOptions(0.1));
  if (kind == "SGD_momentum")
    return std::make_unique<o::SGD>(params, o::SGDOptions(0.1).momentum(0.9).nesterov(true));
  if (kind == "Adagrad") return std::make_unique<o::Adagrad>(params, o::AdagradOptions(0.05));
  if (kind == "RMSprop")
    return std::make_unique<o::RMSprop>(params, o::RMSpropOptions(0.01).eps(1e-3));
  if (kind == "RMSprop_momentum_centered")
    return std::make_unique<o::RMSprop>(
        params, o::RMSpropOptions(0.01).eps(1e-3).momentum(0.5).centered(true));
  throw std::runtime_error("unknown optimizer kind " + kind);
}

/// "" if two non-tensor values (numbers, bools, strings, None, lists of them) are equal; else why.
inline std::string value_diff(const StateValue& x, const StateValue& y, const std::string& what) {
  if ((x.is_int() || x.is_double()) && (y.is_int() || y.is_double())) {
    return x.to_double() == y.to_double() ? "" : what + " differs";
  }
  if (x.kind() != y.kind()) return "kind of " + what + " differs";
  if (x.is_bool() && x.to_bool() != y.to_bool()) return what + " differs";
  if (x.is_string() && x.string() != y.string()) return what + " differs";
  if (x.is_list()) {
    if (x.list().size() != y.list().size()) return "length of " + what + " differs";
    for (size_t i = 0; i < x.list().size(); ++i) {
      const std::string d =
          value_diff(x.list()[i], y.list()[i], what + "[" + std::to_string(i) + "]");
      if (!d.empty()) return d;
    }
  }
  return "";
}

/// "" if `a` and `b` have the same FQNs and state names in the same order, value kinds, shapes
/// and dtypes, equal steps, non-tensor states and hyperparameters (lists element by element),
/// param groups listing the same FQNs in the same order, and tensor values within
/// |x - y| <= atol + rtol |y|; otherwise the first difference. Plain tensors only (gather a
/// SHARDED dict first). `max_diff` gets the largest absolute difference seen.
inline std::string osd_diff(const StateDict& a, const StateDict& b, double rtol, double atol,
                            double* max_diff = nullptr) {
  double worst = 0;
  const StateDict& sa = a.at("state").dict();
  const StateDict& sb = b.at("state").dict();
  if (sa.keys() != sb.keys()) {
    std::string m = "state FQNs differ:";
    for (const auto& k : sa.keys()) m += " " + k;
    m += " vs";
    for (const auto& k : sb.keys()) m += " " + k;
    return m;
  }
  for (const auto& [fqn, va] : sa) {
    const StateDict& da = va.dict();
    const StateDict& db = sb.at(fqn).dict();
    if (da.keys() != db.keys()) return "state names of '" + fqn + "' differ";
    for (const auto& [name, x] : da) {
      const StateValue& y = db.at(name);
      if (x.kind() != y.kind()) return "kind of " + fqn + "/" + name + " differs";
      if (x.is_sharded_tensor()) return fqn + "/" + name + " is a ShardedTensor (gather first)";
      if (!x.is_tensor()) {
        const std::string d = value_diff(x, y, fqn + "/" + name);
        if (!d.empty()) return d;
        continue;
      }
      const at::Tensor& tx = x.tensor();
      const at::Tensor& ty = y.tensor();
      if (tx.sizes() != ty.sizes() || tx.scalar_type() != ty.scalar_type()) {
        return "shape or dtype of " + fqn + "/" + name + " differs";
      }
      if (name == "step") {
        if (tx.item<double>() != ty.item<double>()) return "step of " + fqn + " differs";
        continue;
      }
      if (tx.numel() == 0) continue;
      const double d = (tx - ty).abs().max().item<double>();
      worst = std::max(worst, d);
      if (!torch::allclose(tx, ty, rtol, atol)) {
        return fqn + "/" + name + " differs by up to " + std::to_string(d);
      }
    }
  }
  const StateList& ga = a.at("param_groups").list();
  const StateList& gb = b.at("param_groups").list();
  if (ga.size() != gb.size()) return "param group counts differ";
  for (size_t g = 0; g < ga.size(); ++g) {
    const StateDict& x = ga[g].dict();
    const StateDict& y = gb[g].dict();
    const std::string where = "param group " + std::to_string(g);
    if (x.keys() != y.keys()) return "keys of " + where + " differ";
    for (const auto& [k, v] : x) {
      const std::string d = value_diff(v, y.at(k), where + " '" + k + "'");
      if (!d.empty()) return d;
    }
  }
  if (max_diff) *max_diff = worst;
  return "";
}

/// The "state" half of a plain model's optimizer state dict built without the library's export:
/// straight from torch::optim's per-parameter state objects, keyed by the module's own parameter
/// names (a tied parameter under its first), with PyTorch's state names. An independent
/// reference for what the exports must hold.
inline StateDict raw_optim_state(const torch::nn::Module& model, torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  StateDict state;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.named_parameters()) {
    if (!seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
    auto it = opt.state().find(compat::optim_state_key(p.value()));
    if (it == opt.state().end()) continue;
    StateDict d;
    auto put = [&](const char* name, const at::Tensor& t) {
      if (t.defined()) d.insert_or_assign(name, t);
    };
    auto step = [&](int64_t s) {
      d.insert_or_assign("step", at::scalar_tensor(static_cast<double>(s), at::kFloat));
    };
    const o::OptimizerParamState* ps = it->second.get();
    if (auto* a = dynamic_cast<const o::AdamParamState*>(ps)) {
      step(a->step());
      put("exp_avg", a->exp_avg());
      put("exp_avg_sq", a->exp_avg_sq());
      put("max_exp_avg_sq", a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const o::AdamWParamState*>(ps)) {
      step(w->step());
      put("exp_avg", w->exp_avg());
      put("exp_avg_sq", w->exp_avg_sq());
      put("max_exp_avg_sq", w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const o::SGDParamState*>(ps)) {
      put("momentum_buffer", g->momentum_buffer());
    } else if (auto* ag = dynamic_cast<const o::AdagradParamState*>(ps)) {
      step(ag->step());
      put("sum", ag->sum());
    } else if (auto* r = dynamic_cast<const o::RMSpropParamState*>(ps)) {
      step(r->step());
      put("square_avg", r->square_avg());
      put("momentum_buffer", r->momentum_buffer());
      put("grad_avg", r->grad_avg());
    }
    if (!d.empty()) state.insert_or_assign(p.key(), std::move(d));
  }
  return state;
}

/// "" if an exported dict's "state" holds exactly `raw`'s (parameter, state name) pairs with the
/// same values (|x - y| <= atol + rtol |y|, steps exactly); else the first difference.
inline std::string raw_state_diff(const StateDict& osd, const StateDict& raw, double rtol,
                                  double atol) {
  const StateDict& st = osd.at("state").dict();
  for (const auto& [fqn, v] : raw) {
    if (!st.contains(fqn)) return "no state for '" + fqn + "'";
  }
  for (const auto& [fqn, v] : st) {
    if (!raw.contains(fqn)) return "state for '" + fqn + "', which the optimizer has none for";
    const StateDict& want = raw.at(fqn).dict();
    for (const auto& [name, x] : v.dict()) {
      if (!want.contains(name))
        return "state '" + name + "' of '" + fqn + "' is not the optimizer's";
      const at::Tensor& a = x.tensor();
      const at::Tensor& b = want.at(name).tensor();
      if (a.sizes() != b.sizes()) return "shape of " + fqn + "/" + name + " differs";
      if (!torch::allclose(a.to(at::kDouble), b.to(at::kDouble),
                           name == std::string("step") ? 0 : rtol,
                           name == std::string("step") ? 0 : atol)) {
        return fqn + "/" + name + " differs from the optimizer's own state";
      }
    }
    for (const auto& [name, y] : want) {
      if (!v.dict().contains(name)) return "state '" + name + "' of '" + fqn + "' is missing";
    }
  }
  return "";
}

/// Writes a (SHARDED or FULL) optimizer state dict of one rank: its "state" as pieces
/// ("<fqn>|<name>" keys) and its param groups as text.
inline void save_osd(const StateDict& osd, int rank, const std::string& dir) {
  StateDict flat;
  for (const auto& [fqn, v] : osd.at("state").dict()) {
    for (const auto& [name, x] : v.dict()) flat.insert_or_assign(fqn + "|" + name, x);
  }
  save_pieces(flat, rank, dir, "osd_");
  std::ofstream groups(dir + "/osd_groups_" + std::to_string(rank) + ".txt");
  groups.precision(17);
  for (const auto& g : osd.at("param_groups").list()) {
    for (const auto& [k, v] : g.dict()) {
      groups << k;
      if (v.is_double()) groups << " d " << v.to_double();
      if (v.is_bool()) groups << " b " << v.to_bool();
      if (v.is_none()) groups << " n";
      if (v.is_list()) {
        groups << " l " << v.list().size();
        for (const auto& e : v.list()) {
          if (e.is_string())
            groups << " s " << e.string();
          else
            groups << " d " << e.to_double();
        }
      }
      groups << "\n";
    }
    groups << "--\n";
  }
}

/// Every saved rank's pieces (as load_pieces) and rank 0's param groups.
inline StateDict load_osd(int saved_world, const std::string& dir) {
  StateDict flat = load_pieces(saved_world, dir, "osd_");
  StateDict state;
  for (const auto& [k, v] : flat) {
    const auto bar = k.find('|');
    const std::string fqn = k.substr(0, bar);
    if (!state.contains(fqn)) state.insert_or_assign(fqn, StateDict());
    state.at(fqn).dict().insert_or_assign(k.substr(bar + 1), v);
  }
  StateList groups;
  std::ifstream in(dir + "/osd_groups_0.txt");
  StateDict g;
  for (std::string line; std::getline(in, line);) {
    if (line == "--") {
      groups.emplace_back(g);
      g = StateDict();
      continue;
    }
    std::istringstream is(line);
    std::string key, kind;
    is >> key >> kind;
    if (kind == "d") {
      double d;
      is >> d;
      g.insert_or_assign(key, d);
    } else if (kind == "b") {
      bool b;
      is >> b;
      g.insert_or_assign(key, b);
    } else if (kind == "n") {
      g.insert_or_assign(key, StateValue());
    } else {
      size_t n;
      is >> n;
      StateList l;
      for (size_t i = 0; i < n; ++i) {
        std::string t;
        is >> t;
        if (t == "s") {
          std::string s;
          is >> s;
          l.emplace_back(s);
        } else {
          double d;
          is >> d;
          l.emplace_back(d);
        }
      }
      g.insert_or_assign(key, l);
    }
  }
  StateDict osd;
  osd.insert_or_assign("state", state);
  osd.insert_or_assign("param_groups", groups);
  return osd;
}

}  // namespace testing
}  // namespace fsdp
