// fsdp/state_dict_utils.h: utilities that work on any StateDict (PyTorch's
// torch/distributed/_state_dict_utils.py): flattening nested dicts to dotted keys and back,
// comparing structures, moving values to the CPU or into a preallocated companion dict, and
// turning SHARDED values into full tensors (gather) or full tensors into this rank's pieces
// (distribute).
//
// A StateDict nests StateDicts and StateLists; "terminal" values are everything else (tensors,
// ShardedTensors, numbers, strings, None). Functions taking a ProcessGroup are collective: every
// rank of the group calls them with dicts of the same structure.
//
// Which API: these transform dicts you already hold; to get or set a model's and optimizer's
// state, use get_state_dict / set_state_dict (fsdp/checkpoint/state_dict.h).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp/dist.h"
#include "fsdp/state_value.h"

namespace fsdp {

/// One step of the path to a terminal value: a dict key or a list index.
using PathElement = std::variant<std::string, int64_t>;
using ObjPath = std::vector<PathElement>;
/// Flattened key -> the path it came from.
using FlattenMapping = std::map<std::string, ObjPath>;

/// PyTorch's _flatten_state_dict: every terminal value under a key made of its path joined with
/// "." ({"a": {"b": x, "c": [y, z]}} -> "a.b", "a.c.0", "a.c.1"), and the mapping that undoes it.
/// Empty dicts and lists have no terminal value and vanish, as in PyTorch. Throws ValueError
/// naming the key if two paths flatten to the same key (e.g. "a.b" and {"a": {"b": ...}}).
std::pair<StateDict, FlattenMapping> flatten_state_dict(const StateDict& sd);

/// The inverse: rebuilds the nested dict from `flat` and `mapping` (lists are extended with None
/// where an index is skipped). Throws ValueError naming a key of `flat` missing from `mapping`.
StateDict unflatten_state_dict(const StateDict& flat, const FlattenMapping& mapping);

/// True if `a` and `b` have the same keys (in any order), list lengths and value kinds
/// everywhere, and every tensor (or ShardedTensor) the same shape and dtype (PyTorch's
/// _check_state_dict_similarity, which compares keys as sets).
bool check_state_dict_similarity(const StateDict& a, const StateDict& b);

/// A copy of `sd` whose tensors (and ShardedTensor pieces) are on the CPU (shared, not copied,
/// where they already are).
StateDict offload_state_dict_to_cpu(const StateDict& sd);

/// A companion for `sd`: the same structure, with a fresh zero-initialised CPU tensor (and
/// ShardedTensor pieces) for each tensor, pinned when the tensor is on a CUDA device.
StateDict create_cpu_state_dict(const StateDict& sd);

/// PyTorch's _copy_state_dict: copies every tensor of `src` into the tensor at the same place in
/// `companion` (which keeps its own storage; non_blocking where the devices allow), and returns
/// a dict with `src`'s structure and key order holding `companion`'s tensors and `src`'s other
/// values. `companion`'s containers and non-tensor values are left as they are. Dict keys must
/// match as sets. Throws ValueError naming the path where the structures, shapes or dtypes
/// differ, before any tensor is written.
StateDict copy_state_dict(const StateDict& src, const StateDict& companion,
                          bool non_blocking = false);

/// PyTorch's _gather_state_dict: every ShardedTensor of `sd` as a full tensor, one tensor at a
/// time, on the ranks in `ranks_only` (all ranks if empty; the others get an empty dict). A
/// gathered tensor stays on the device of this rank's first piece of it (the CPU if it holds
/// none), as in PyTorch; `cpu_offload` moves every tensor to the CPU. Pieces move with the piece
/// exchange (each target rank receives only what it lacks), so peak extra memory is about one
/// full tensor. Collective over `pg`.
StateDict gather_state_dict(const StateDict& sd, dist::ProcessGroup& pg,
                            const std::vector<int>& ranks_only = {}, bool cpu_offload = false);

/// PyTorch's _distribute_state_dict: fills `local` (a template, e.g. this rank's own SHARDED
/// state dict) from `full` (full tensors and other values, on every rank), compared by path
/// (flatten_state_dict's keys). For each value of `full`: a tensor of one or more dimensions is
/// copied into the template's tensor, or for a ShardedTensor into its local pieces at their
/// offsets, where the template has that path (and skipped where it has not); a 0-d tensor or a
/// non-tensor value (an optimizer's step, a learning rate) is written at its path, into the
/// template's tensor there if it has one of the same shape (so the template keeps its kinds
/// and storage), else as the value itself, added if the template lacks the path. Paths only in
/// `local` are left as they are. Local, no communication. Throws ValueError naming the path
/// where a tensor's shape differs (checked before anything is written).
void distribute_state_dict(const StateDict& full, StateDict& local);

/// PyTorch's _broadcast_state_dict: rank `src` holds `full` (full tensors and other values; the
/// other ranks' `full` is ignored), every rank holds `local`, a template of the same structure
/// (e.g. its own state dict, SHARDED or not). Each value of `full` is written into the template
/// where it has that key: a tensor is copied into the template's tensor (cast to its dtype), a
/// ShardedTensor's local pieces get their boxes of it, other values are replaced. Keys only in
/// `full` are skipped (returned as unexpected_keys), keys only in `local` kept (missing_keys);
/// with `strict` either raises ValueError (PyTorch's strict only drops the template's extra keys,
/// leaving the error to the load that follows). Shapes must match.
///
/// Tensors travel one at a time (peak extra memory: the largest tensor), after the structure,
/// non-tensor values and 0-d tensors went in one broadcast. Every rank checks the structure
/// against its template and the ranks agree before any tensor moves: a mismatch raises
/// ValueError naming the key and rank on every rank, with no template changed. Tensors are
/// broadcast on the device of the template's first tensor (CPU if none). Collective over `pg`.
LoadResult broadcast_state_dict(const StateDict& full, StateDict& local, dist::ProcessGroup& pg,
                                int src = 0, bool strict = false);

}  // namespace fsdp
