// Optimizer-state-dict helpers for tests: the optimizers under test, a comparison of two dicts
// that reports the first difference, and saving a (SHARDED) dict's pieces to files.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
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

/// "" if `a` and `b` have the same FQNs, state names, value kinds, shapes and dtypes, equal steps
/// and hyperparameters, params listing the same FQNs per group, and tensor values within
/// |x - y| <= atol + rtol |y|; otherwise the first difference. `max_diff` gets the largest
/// absolute difference seen.
inline std::string osd_diff(const StateDict& a, const StateDict& b, double rtol, double atol,
                            double* max_diff = nullptr) {
  double worst = 0;
  auto keys_sorted = [](const StateDict& d) {
    auto k = d.keys();
    std::sort(k.begin(), k.end());
    return k;
  };
  const StateDict& sa = a.at("state").dict();
  const StateDict& sb = b.at("state").dict();
  if (keys_sorted(sa) != keys_sorted(sb)) {
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
      if (!x.is_tensor()) continue;
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
    if (x.keys() != y.keys()) return "keys of param group " + std::to_string(g) + " differ";
    std::vector<std::string> px, py;
    for (const auto& v : x.at("params").list()) px.push_back(v.string());
    for (const auto& v : y.at("params").list()) py.push_back(v.string());
    std::sort(px.begin(), px.end());
    std::sort(py.begin(), py.end());
    if (px != py) return "params of param group " + std::to_string(g) + " differ";
    for (const auto& [k, v] : x) {
      if (k == "params") continue;
      if (v.kind() != y.at(k).kind()) return "kind of hyperparameter " + k + " differs";
      if ((v.is_double() && v.to_double() != y.at(k).to_double()) ||
          (v.is_bool() && v.to_bool() != y.at(k).to_bool())) {
        return "hyperparameter " + k + " differs";
      }
    }
  }
  if (max_diff) *max_diff = worst;
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
