// The forms of an optimizers' state dict in the get_/set_ API
// (torch/distributed/checkpoint/state_dict.py: _flatten_optim_state_dict,
// _unflatten_optim_state_dict, _split_optim_state_dict).
#include "state_dict/optim_dict_forms.h"

#include <map>
#include <set>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

using fsdp::detail::msg;
using fsdp::detail::quote;
using optim_forms::kGroups;
using optim_forms::kParams;
using optim_forms::kState;

// True if two hyperparameter values are the same (numbers, strings, lists of them).
bool same_value(const StateValue& a, const StateValue& b) {
  if ((a.is_int() || a.is_double()) && (b.is_int() || b.is_double()))
    return a.to_double() == b.to_double();
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case StateValue::Kind::NONE:
      return true;
    case StateValue::Kind::BOOL:
      return a.to_bool() == b.to_bool();
    case StateValue::Kind::STRING:
      return a.string() == b.string();
    case StateValue::Kind::LIST:
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i)
        if (!same_value(a.list()[i], b.list()[i])) return false;
      return true;
    default:
      return false;
  }
}

std::string value_text(const StateValue& v) {
  if (v.is_int()) return std::to_string(v.to_int());
  if (v.is_double()) return std::to_string(v.to_double());
  if (v.is_bool()) return v.to_bool() ? "True" : "False";
  if (v.is_string()) return v.string();
  if (v.is_list()) {
    std::string out = "[";
    for (size_t i = 0; i < v.list().size(); ++i) out += (i ? ", " : "") + value_text(v.list()[i]);
    return out + "]";
  }
  return to_string(v.kind());
}

}  // namespace

StateDict flatten_optim_state_dict(const StateDict& osd) {
  StateDict out;
  for (const auto& [fqn, st] : osd.at(kState).dict()) {
    for (const auto& [name, v] : st.dict()) {
      // Python's bool is an int, so PyTorch's isinstance(v, (Tensor, int, float)) takes it.
      if (!v.is_tensor() && !v.is_sharded_tensor() && !v.is_int() && !v.is_double() &&
          !v.is_bool()) {
        throw ValueError(
            msg("Flattening optimizer state_dict only supports tensor, int, float states now. Type "
                "is ",
                to_string(v.kind()), " (state ", quote(fqn), ", ", quote(name), ")."));
      }
      out.insert_or_assign(std::string(kState) + "." + fqn + "." + name, v);
    }
  }
  for (const auto& g : osd.at(kGroups).list()) {
    for (const auto& p : g.dict().at(kParams).list()) {
      for (const auto& [k, v] : g.dict()) {
        if (k == kParams) continue;
        out.insert_or_assign(std::string(kGroups) + "." + p.string() + "." + k, v);
      }
    }
  }
  return out;
}

namespace optim_forms {

StateDict split_for(const DescribeOptimizer& describe, torch::optim::Optimizer& opt,
                    const StateDict& osd) {
  if (!osd.contains(kState) || !osd.at(kState).is_dict() || !osd.contains(kGroups) ||
      !osd.at(kGroups).is_list()) {
    throw ValueError(
        "optimizer state dict: expected a \"state\" dict and a \"param_groups\" list (or the "
        "flat form of flatten_optimizer_state_dict)");
  }
  const StateDict& state = osd.at(kState).dict();
  bool all_ids = !state.empty();
  for (const auto& [k, v] : state)
    all_ids = all_ids && !k.empty() && k.find_first_not_of("0123456789") == std::string::npos;
  if (all_ids) return osd;  // keyed by parameter IDs: one optimizer's own dict
  const fsdp::detail::OptModel om = describe(opt);
  std::set<std::string> mine;
  for (const auto& g : om.groups)
    for (size_t e : g) mine.insert(om.entries[e].fqns.begin(), om.entries[e].fqns.end());
  StateDict out_state;
  for (const auto& [fqn, v] : state) {
    if (mine.count(fqn)) out_state.insert_or_assign(fqn, v);
  }
  StateList out_groups;
  const StateList& groups = osd.at(kGroups).list();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!groups[i].is_dict() || !groups[i].dict().contains(kParams) ||
        !groups[i].dict().at(kParams).is_list()) {
      throw ValueError(
          msg("optimizer state dict: param_groups[", i, "] is not a dict with a \"params\" list"));
    }
    const StateList& params = groups[i].dict().at(kParams).list();
    size_t ours = 0;
    for (const auto& p : params) ours += p.is_string() && mine.count(p.string()) ? 1 : 0;
    if (ours == 0) continue;
    if (ours != params.size()) {
      throw ValueError(msg("optimizer state dict: param_groups[", i,
                           "] lists parameters of more than one of the given optimizers"));
    }
    out_groups.push_back(groups[i]);
  }
  StateDict out;
  out.insert_or_assign(kState, std::move(out_state));
  out.insert_or_assign(kGroups, std::move(out_groups));
  return out;
}

StateDict unflatten_optim(const DescribeOptimizer& describe,
                          const std::vector<torch::optim::Optimizer*>& optimizers,
                          const StateDict& flat) {
  // "<prefix>.<fqn>.<name>": state names and group keys never contain dots, FQNs may.
  std::map<std::string, StateDict> states, group_values;
  for (const auto& [k, v] : flat) {
    const bool is_state = k.rfind(std::string(kState) + ".", 0) == 0;
    const bool is_group = k.rfind(std::string(kGroups) + ".", 0) == 0;
    const size_t dot = k.rfind('.');
    const size_t start =
        is_state ? std::string(kState).size() + 1 : std::string(kGroups).size() + 1;
    if ((!is_state && !is_group) || dot == std::string::npos || dot <= start) {
      throw ValueError(msg("flattened optimizer state dict: unexpected key ", quote(k),
                           " (keys are \"state.<fqn>.<name>\" and \"param_groups.<fqn>.<key>\")"));
    }
    const std::string fqn = k.substr(start, dot - start);
    (is_state ? states : group_values)[fqn].insert_or_assign(k.substr(dot + 1), v);
  }
  std::set<std::string> known;
  StateDict state;
  StateList groups;
  for (torch::optim::Optimizer* opt : optimizers) {
    const fsdp::detail::OptModel om = describe(*opt);
    for (const auto& g : om.groups) {
      StateDict group;
      StateList params;
      for (size_t e : g) {
        for (const auto& fqn : om.entries[e].fqns) {
          known.insert(fqn);
          params.emplace_back(fqn);
          auto s = states.find(fqn);
          if (s != states.end()) state.insert_or_assign(fqn, s->second);
          auto gv = group_values.find(fqn);
          if (gv == group_values.end()) continue;
          for (const auto& [key, v] : gv->second) {
            if (!group.contains(key)) {
              group.insert_or_assign(key, v);
            } else if (!same_value(group.at(key), v)) {
              throw ValueError(
                  msg("All the parameters in the same parameter group should have the same saved "
                      "param_group value. But ",
                      fqn, ".", key, " is ", value_text(v), " while other(s) is ",
                      value_text(group.at(key)), "."));
            }
          }
        }
      }
      group.insert_or_assign(kParams, std::move(params));
      groups.emplace_back(std::move(group));
    }
  }
  for (const auto* m : {&states, &group_values}) {
    for (const auto& [fqn, v] : *m) {
      if (!known.count(fqn)) {
        throw ValueError(msg("flattened optimizer state dict: ", quote(fqn),
                             " is not a parameter of the given optimizers"));
      }
    }
  }
  StateDict out;
  out.insert_or_assign(kState, std::move(state));
  out.insert_or_assign(kGroups, std::move(groups));
  return out;
}

}  // namespace optim_forms
}  // namespace checkpoint
}  // namespace fsdp
