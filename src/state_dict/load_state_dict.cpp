// Loading FULL / SHARDED / LOCAL state dicts into a wrapped model: every rank plans its copies
// and checks every key, shape, dtype and piece; the ranks exchange verdicts; nothing is written
// unless all of them succeeded.
#include <algorithm>
#include <map>
#include <sstream>

#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"
#include "runtime/state.h"
#include "state_dict/key_map.h"

namespace fsdp {
namespace {

using detail::flat_key;
using detail::FsdpState;
using detail::key_map;
using detail::KeyMap;
using detail::ParamLoc;
using detail::shape_str;

struct Plan {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // dst <- src (copy_ casts)
  bool strict_dtype = false;                              // reject instead of casting
  std::string error;                                      // first problem found on this rank
  LoadResult result;
  void fail(const std::string& e) {
    if (error.empty()) error = e;
  }
};

// Plans the copy of this rank's part of a managed parameter from `src_range(start, n)`.
template <typename Range>
void plan_param(const FsdpState& st, const ParamLoc& loc, Range&& src_range, Plan& plan) {
  FlatParamHandle& h = *st.units[loc.unit]->handle;
  const ShardParamInfo& s = h.shard_param_infos()[loc.index];
  const auto& l = h.layout();
  at::Tensor flat = h.flat_param().detach();
  if (!h.uses_sharded_strategy()) {
    plan.copies.emplace_back(flat.narrow(0, l.param_offset(loc.index), l.numels[loc.index]),
                             src_range(0, l.numels[loc.index]));
  } else if (s.in_shard && s.numel_in_shard > 0) {
    plan.copies.emplace_back(flat.narrow(0, s.offset_in_shard, s.numel_in_shard),
                             src_range(s.intra_param_start_idx, s.numel_in_shard));
  }
}

void check_shape_dtype(const std::string& key, at::IntArrayRef got, at::ScalarType got_dtype,
                       at::IntArrayRef want, at::ScalarType want_dtype, int rank, Plan& plan) {
  if (got != want) {
    plan.fail("size mismatch for '" + key + "': copying a param with shape " + shape_str(got) +
              " from the state dict, the shape in the current model is " + shape_str(want) +
              " (rank " + std::to_string(rank) + ")");
  } else if (got_dtype != want_dtype && plan.strict_dtype) {
    plan.fail(std::string("dtype mismatch for '") + key + "': the state dict has " +
              c10::toString(got_dtype) + ", the model " + c10::toString(want_dtype) + " (rank " +
              std::to_string(rank) + ")");
  }
}

void plan_unmanaged(FsdpState& st, const std::string& key, const at::Tensor& target,
                    const StateValue& v, Plan& plan, int rank) {
  if (!v.is_tensor()) {
    plan.fail("'" + key + "' must be a Tensor, the state dict has " + to_string(v.kind()));
    return;
  }
  at::ScalarType want = target.scalar_type();
  auto it = st.buffer_orig_dtypes.find(target.unsafeGetTensorImpl());
  if (it != st.buffer_orig_dtypes.end()) want = it->second;
  check_shape_dtype(key, v.tensor().sizes(), v.tensor().scalar_type(), target.sizes(), want, rank,
                    plan);
  plan.copies.emplace_back(target.detach(), v.tensor());
}

// A SHARDED dict holds each parameter as pieces (dim-0 chunks, or any boxes) that do not line up
// with flat-parameter shards: a rank usually needs elements held by other ranks, even at the
// world size that saved. Unless every rank already holds every element it needs (e.g. pieces read
// from storage), the ranks exchange exactly those elements: one metadata exchange for the whole
// dict, then, parameter by parameter, one all_to_all_single that sends each rank only the part
// of each piece inside its range. Peak extra memory per rank: what it sends for one parameter
// plus twice its own range of that parameter (receive buffer and result).
//
// Everything another rank sent is validated before use, and every decision (skip a key, fail) is
// computed from the gathered metadata alone, so all ranks take the same collectives in the same
// order whatever they hold; problems go to the plan and surface in the verdict exchange.

// A box's elements as runs contiguous in both the global row-major order and the box's own.
struct Run {
  int64_t global_start;  // flat index in the parameter
  int64_t local_start;   // flat index in the box
  int64_t len;
};

std::vector<Run> box_runs(const std::vector<int64_t>& shape, const ShardMetadata& b) {
  const size_t nd = shape.size();
  if (b.numel() == 0) return {};
  if (nd == 0) return {Run{0, 0, 1}};
  // Trailing dims the box covers fully merge into one contiguous run.
  size_t k = nd - 1;  // the run spans dims k..nd-1
  int64_t run = b.sizes[nd - 1];
  while (k > 0 && b.sizes[k] == shape[k] && b.offsets[k] == 0) {
    --k;
    run *= b.sizes[k];
  }
  std::vector<int64_t> stride(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) stride[d - 1] = stride[d] * shape[d];
  std::vector<Run> out;
  std::vector<int64_t> idx(k, 0);  // position in the box along dims 0..k-1
  int64_t local = 0;
  for (;;) {
    int64_t g = 0;
    for (size_t d = 0; d < k; ++d) g += (b.offsets[d] + idx[d]) * stride[d];
    g += b.offsets[k] * stride[k];
    out.push_back(Run{g, local, run});
    local += run;
    size_t d = k;
    while (d > 0) {
      --d;
      if (++idx[d] < b.sizes[d]) break;
      idx[d] = 0;
      if (d == 0) return out;
    }
    if (k == 0) return out;
  }
}

struct KeyMeta {
  bool valid = true;
  std::string error;
  bool have = false;  // the rank's dict has the key as a ShardedTensor
  int dtype = -1;
  std::vector<ShardMetadata> boxes;
  int64_t need_lo = 0, need_n = 0;  // the rank's range of the parameter
};

bool known_dtype(int dt) {
  if (dt < 0 || dt >= static_cast<int>(at::ScalarType::NumOptions)) return false;
  switch (static_cast<at::ScalarType>(dt)) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kByte:
    case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kBool:
      return true;
    default:
      return false;
  }
}

// Parses one rank's metadata line for a key and checks it against the model's shape.
KeyMeta parse_meta(const std::string& line, const std::vector<int64_t>& shape) {
  KeyMeta m;
  std::istringstream is(line);
  auto bad = [&](const std::string& why) {
    m.valid = false;
    m.error = why;
    return m;
  };
  std::string tag;
  if (!(is >> tag)) return bad("empty metadata");
  if (tag == "!") {
    std::string rest;
    std::getline(is, rest);
    return bad(rest);
  }
  int64_t lo = 0, n = 0, total = 1;
  for (auto d : shape) total *= d;
  if (!(is >> lo >> n) || lo < 0 || n < 0 || lo + n > total) return bad("bad range");
  m.need_lo = lo;
  m.need_n = n;
  if (tag == "-") return m;
  if (tag != "+") return bad("bad tag");
  size_t nd = 0, nb = 0;
  if (!(is >> m.dtype >> nd >> nb) || !known_dtype(m.dtype)) return bad("bad dtype");
  if (nd != shape.size()) {
    return bad("pieces have " + std::to_string(nd) + " dims, the parameter " +
               std::to_string(shape.size()));
  }
  if (nb > 1000000) return bad("too many pieces");
  m.have = true;
  for (size_t i = 0; i < nb; ++i) {
    ShardMetadata b;
    b.offsets.resize(nd);
    b.sizes.resize(nd);
    for (auto& o : b.offsets)
      if (!(is >> o)) return bad("truncated piece");
    for (auto& z : b.sizes)
      if (!(is >> z)) return bad("truncated piece");
    for (size_t d = 0; d < nd; ++d) {
      if (b.offsets[d] < 0 || b.sizes[d] < 0 || b.offsets[d] + b.sizes[d] > shape[d]) {
        return bad("piece at " + shape_str(b.offsets) + " of size " + shape_str(b.sizes) +
                   " lies outside the parameter's shape " + shape_str(shape));
      }
    }
    m.boxes.push_back(std::move(b));
  }
  return m;
}

std::map<std::string, at::Tensor> exchange_pieces(FsdpState& st, const KeyMap& km,
                                                  const StateDict& sd, Plan& plan) {
  // Over all data-parallel ranks: the dict may have been cut for another layout than this
  // (e.g. 4 chunks saved without hybrid sharding, loaded as 2 x 2).
  dist::ProcessGroup& pg = st.world_group;
  const int me = pg.rank();
  std::map<std::string, at::Tensor> ranges;
  // Does any rank miss an element it needs?
  bool covered = true;
  for (const auto& [k, loc] : km.managed) {
    if (!sd.contains(k) || !sd.at(k).is_sharded_tensor()) continue;
    const ShardParamInfo& s = st.units[loc.unit]->handle->shard_param_infos()[loc.index];
    if (!s.in_shard || s.numel_in_shard == 0) continue;
    try {
      sd.at(k).sharded_tensor().flat_range(s.intra_param_start_idx, s.numel_in_shard, k);
    } catch (...) {  // not covered, or anything else: exchange (every rank must decide alike)
      covered = false;
      break;
    }
  }
  at::Tensor flag = at::full({1}, covered ? 0 : 1, at::kInt);
  pg.all_reduce(flag, dist::ReduceOp::MAX);
  if (flag.item<int>() == 0) return ranges;

  // One metadata exchange: per managed key, a line "<tag> lo n [dtype ndim npieces offs.. sizes..]"
  // (tag + has pieces, - holds no ShardedTensor, ! this rank's own pieces are malformed).
  std::vector<std::string> keys;
  std::ostringstream meta;
  std::map<std::string, std::vector<at::Tensor>> my_pieces;  // flattened, in the key's dtype
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m == km.managed.end()) continue;
    keys.push_back(k);
    const ShardParamInfo& s = st.units[m->second.unit]->handle->shard_param_infos()[m->second.index];
    const int64_t lo = s.in_shard ? s.intra_param_start_idx : 0;
    const int64_t n = s.in_shard ? s.numel_in_shard : 0;
    const bool have = sd.contains(k) && sd.at(k).is_sharded_tensor();
    if (!have) {
      meta << "- " << lo << " " << n << "\n";
      continue;
    }
    const ShardedTensor& t = sd.at(k).sharded_tensor();
    std::ostringstream line;
    line << "+ " << lo << " " << n << " " << static_cast<int>(t.dtype()) << " " << t.size().size()
         << " " << t.local_shards().size();
    bool ok = true;
    for (const auto& piece : t.local_shards()) {
      if (piece.tensor.numel() != piece.metadata.numel() ||
          piece.metadata.offsets.size() != t.size().size() ||
          piece.metadata.sizes.size() != t.size().size()) {
        ok = false;
        break;
      }
      for (auto o : piece.metadata.offsets) line << " " << o;
      for (auto z : piece.metadata.sizes) line << " " << z;
      my_pieces[k].push_back(piece.tensor.reshape({-1}).to(at::kCPU).to(t.dtype()));
    }
    if (ok) {
      meta << line.str() << "\n";
    } else {
      my_pieces.erase(k);
      meta << "! a piece of '" << k << "' does not match its metadata\n";
    }
  }
  const auto metas = pg.all_gather_bytes(meta.str());
  std::vector<std::vector<std::string>> lines(metas.size());
  for (size_t r = 0; r < metas.size(); ++r) {
    std::istringstream is(metas[r]);
    for (std::string l; std::getline(is, l);) lines[r].push_back(l);
  }

  const int W = pg.size();
  for (size_t ki = 0; ki < keys.size(); ++ki) {
    const std::string& k = keys[ki];
    const ParamLoc& loc = km.managed.at(k);
    const std::vector<int64_t> shape = st.units[loc.unit]->handle->layout().shapes[loc.index];
    // Parse and validate every rank's view of this key; the same verdict on every rank.
    std::vector<KeyMeta> ms(W);
    std::string problem;
    int dtype = -1;
    for (int r = 0; r < W; ++r) {
      if (ki < lines[r].size()) {
        ms[r] = parse_meta(lines[r][ki], shape);
      } else {
        ms[r].valid = false;
        ms[r].error = "no metadata";
      }
      if (!ms[r].valid) {
        if (problem.empty()) problem = "rank " + std::to_string(r) + "'s pieces of '" + k +
                                       "' are invalid: " + ms[r].error;
        continue;
      }
      if (!ms[r].have || ms[r].boxes.empty()) continue;
      if (dtype >= 0 && ms[r].dtype != dtype && problem.empty()) {
        problem = "ranks hold pieces of '" + k + "' in different dtypes";
      }
      dtype = ms[r].dtype;
    }
    // Who sends what: each distinct box once (its lowest-ranked holder), the part of each of its
    // runs inside the receiver's range.
    struct Seg {
      int src;
      size_t box;
      int64_t local, len, dst;  // into the source box / into the receiver's range
    };
    std::vector<std::vector<Seg>> to(W);  // to[q]: segments for receiver q, in sender order
    if (problem.empty()) {
      std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> seen;
      for (int r = 0; r < W; ++r) {
        for (size_t bi = 0; bi < ms[r].boxes.size(); ++bi) {
          const ShardMetadata& b = ms[r].boxes[bi];
          auto id = std::make_pair(b.offsets, b.sizes);
          if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
          seen.push_back(id);
          for (const Run& run : box_runs(shape, b)) {
            for (int q = 0; q < W; ++q) {
              const int64_t lo = std::max(run.global_start, ms[q].need_lo);
              const int64_t hi =
                  std::min(run.global_start + run.len, ms[q].need_lo + ms[q].need_n);
              if (lo >= hi) continue;
              to[q].push_back(
                  Seg{r, bi, run.local_start + (lo - run.global_start), hi - lo, lo - ms[q].need_lo});
            }
          }
        }
      }
      // Every rank's range must be covered.
      for (int q = 0; q < W && problem.empty(); ++q) {
        if (ms[q].need_n == 0) continue;
        std::vector<std::pair<int64_t, int64_t>> iv;
        for (const auto& sg : to[q]) iv.emplace_back(sg.dst, sg.dst + sg.len);
        std::sort(iv.begin(), iv.end());
        int64_t reach = 0;
        for (const auto& [a, b] : iv) {
          if (a > reach) break;
          reach = std::max(reach, b);
        }
        if (reach < ms[q].need_n) {
          problem = "no rank holds elements [" + std::to_string(ms[q].need_lo + reach) + ", " +
                    std::to_string(ms[q].need_lo + ms[q].need_n) + ") of '" + k +
                    "' (flattened), which rank " + std::to_string(q) + " needs";
        }
      }
    }
    if (!problem.empty()) {
      plan.fail(problem + " (seen by rank " + std::to_string(me) + ")");
      continue;  // every rank skips this key alike
    }
    if (!ms[me].have) continue;  // reported as missing by the planner
    const at::ScalarType dt = dtype >= 0 ? static_cast<at::ScalarType>(dtype) : at::kFloat;
    // Send buffer: for each receiver in rank order, my segments to it.
    std::vector<int64_t> in_splits(W, 0), out_splits(W, 0);
    std::vector<at::Tensor> send;
    for (int q = 0; q < W; ++q) {
      for (const auto& sg : to[q]) {
        if (sg.src == me) {
          send.push_back(my_pieces[k][sg.box].narrow(0, sg.local, sg.len));
          in_splits[q] += sg.len;
        }
      }
    }
    for (const auto& sg : to[me]) out_splits[sg.src] += sg.len;
    int64_t traffic = 0;  // elements moved for this key, all ranks together (the same everywhere)
    for (int q = 0; q < W; ++q)
      for (const auto& sg : to[q]) traffic += sg.len;
    at::Tensor out = at::empty({ms[me].need_n}, at::TensorOptions().dtype(dt));
    if (traffic == 0) {
      ranges.emplace(k, out);
      continue;
    }
    at::Tensor in = send.empty() ? at::empty({0}, out.options()) : at::cat(send);
    send.clear();
    int64_t recv_n = 0;
    for (auto n : out_splits) recv_n += n;
    at::Tensor recv = at::empty({recv_n}, out.options());
    pg.all_to_all_single(recv, in, out_splits, in_splits);
    // Segments from each sender arrive in the order the sender listed them for me.
    std::vector<int64_t> pos(W, 0);
    for (int r = 1; r < W; ++r) pos[r] = pos[r - 1] + out_splits[r - 1];
    for (const auto& sg : to[me]) {
      out.narrow(0, sg.dst, sg.len).copy_(recv.narrow(0, pos[sg.src], sg.len));
      pos[sg.src] += sg.len;
    }
    ranges.emplace(k, out);
  }
  return ranges;
}

Plan plan_load(FsdpState& st, const StateDict& sd_in, bool strict_dtype) {
  Plan plan;
  plan.strict_dtype = strict_dtype;
  // As the seed loads inside an unshard with writeback: parameters the user replaced (set_data)
  // since the last unshard are written into the flat parameter first, or the next unshard would
  // copy them over what this load writes.
  for (const auto& u : st.units) {
    if (!u->handle) continue;
    try {
      u->handle->writeback_orig_params();
    } catch (const std::exception& e) {
      plan.fail(e.what());
    }
  }
  const KeyMap km = key_map(st);
  const int rank = st.world_group.rank();
  // SHARDED: each rank's range of each parameter, where the ranks had to exchange pieces.
  const std::map<std::string, at::Tensor> ranges =
      st.state_dict_type == StateDictType::SHARDED_STATE_DICT
          ? exchange_pieces(st, km, sd_in, plan)
          : std::map<std::string, at::Tensor>{};
  const StateDict& sd = sd_in;
  std::map<std::string, bool> expected;
  auto expect = [&](const std::string& k) {
    expected[k] = true;
    if (!sd.contains(k)) plan.result.missing_keys.push_back(k);
  };
  const StateDictType type = st.state_dict_type;
  std::vector<bool> unit_done(st.units.size(), false);
  for (const auto& k : km.order) {
    auto m = km.managed.find(k);
    if (m == km.managed.end()) {
      expect(k);
      if (sd.contains(k)) plan_unmanaged(st, k, km.unmanaged.at(k), sd.at(k), plan, rank);
      continue;
    }
    const ParamLoc loc = m->second;
    FlatParamHandle& h = *st.units[loc.unit]->handle;
    const auto& l = h.layout();
    if (type == StateDictType::LOCAL_STATE_DICT) {
      if (unit_done[loc.unit]) continue;
      unit_done[loc.unit] = true;
      const std::string fk = flat_key(*st.units[loc.unit]);
      expect(fk);
      if (!sd.contains(fk)) continue;
      const StateValue& v = sd.at(fk);
      if (!v.is_sharded_tensor()) {
        plan.fail("'" + fk + "' must be a ShardedTensor in a LOCAL state dict, it is " +
                  to_string(v.kind()));
        continue;
      }
      const ShardedTensor& t = v.sharded_tensor();
      const int64_t valid = l.sharded_numel - h.shard_numel_padded();
      const Shard* mine = nullptr;
      for (const auto& s : t.local_shards()) {
        if (s.metadata.offsets == std::vector<int64_t>{h.rank() * l.sharded_numel} &&
            s.metadata.sizes == std::vector<int64_t>{valid}) {
          mine = &s;
        }
      }
      if (t.size() != std::vector<int64_t>{l.unpadded_unsharded_numel} ||
          (plan.strict_dtype && t.dtype() != h.orig_dtype()) || (valid > 0 && mine == nullptr)) {
        plan.fail("'" + fk + "' does not match this rank's flat parameter (rank " +
                  std::to_string(h.rank()) + " of " + std::to_string(h.world_size()) + ", " +
                  std::to_string(l.unpadded_unsharded_numel) + " elements, shard at " +
                  std::to_string(h.rank() * l.sharded_numel) + " of " + std::to_string(valid) +
                  "): LOCAL state dicts load only at the world size and layout that saved "
                  "them; use SHARDED_STATE_DICT to reshard");
        continue;
      }
      if (valid > 0) {
        plan.copies.emplace_back(h.flat_param().detach().narrow(0, 0, valid), mine->tensor);
      }
      continue;
    }
    expect(k);
    if (!sd.contains(k)) continue;
    const StateValue& v = sd.at(k);
    const auto& shape = l.shapes[loc.index];
    if (type == StateDictType::FULL_STATE_DICT) {
      if (!v.is_tensor()) {
        plan.fail("'" + k + "' must be a Tensor in a FULL state dict, it is " +
                  to_string(v.kind()));
        continue;
      }
      const at::Tensor& t = v.tensor();
      check_shape_dtype(k, t.sizes(), t.scalar_type(), shape, h.orig_dtype(), rank, plan);
      if (!plan.error.empty()) continue;
      plan_param(
          st, loc, [&](int64_t start, int64_t n) { return t.reshape({-1}).narrow(0, start, n); },
          plan);
    } else {
      if (!v.is_sharded_tensor()) {
        plan.fail("'" + k + "' must be a ShardedTensor in a SHARDED state dict, it is " +
                  to_string(v.kind()));
        continue;
      }
      const ShardedTensor& t = v.sharded_tensor();
      check_shape_dtype(k, t.size(), t.dtype(), shape, h.orig_dtype(), rank, plan);
      if (!plan.error.empty()) continue;
      auto got = ranges.find(k);
      if (got != ranges.end()) {
        // Exchanged: exactly this rank's range, which starts at its intra-param start.
        const ShardParamInfo& s = h.shard_param_infos()[loc.index];
        const int64_t lo = s.in_shard ? s.intra_param_start_idx : 0;
        plan_param(
            st, loc, [&](int64_t start, int64_t n) { return got->second.narrow(0, start - lo, n); },
            plan);
        continue;
      }
      try {
        plan_param(
            st, loc, [&](int64_t start, int64_t n) { return t.flat_range(start, n, k); }, plan);
      } catch (const ValueError& e) {
        plan.fail(std::string(e.what()) + " (rank " + std::to_string(rank) + ")");
      }
    }
  }
  for (const auto& [k, v] : sd) {
    if (!expected.count(k)) plan.result.unexpected_keys.push_back(k);
  }
  return plan;
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "\"" : ", \"") + k + "\"";
  return out;
}
}  // namespace

LoadResult load_state_dict(FullyShardedDataParallel& model, const StateDict& sd, bool strict,
                           bool strict_dtype) {
  FsdpState& st = *model->runtime_state();
  detail::require_idle(st, "load_state_dict");
  detail::NoShardFallback fallback(st);  // SHARDED/LOCAL on NO_SHARD units load as FULL
  Plan plan = plan_load(st, sd, strict_dtype);
  if (plan.error.empty() && strict &&
      (!plan.result.missing_keys.empty() || !plan.result.unexpected_keys.empty())) {
    plan.error = "Error(s) in loading state_dict:";
    if (!plan.result.missing_keys.empty()) {
      plan.error += " Missing key(s) in state_dict: " + key_list(plan.result.missing_keys) + ".";
    }
    if (!plan.result.unexpected_keys.empty()) {
      plan.error +=
          " Unexpected key(s) in state_dict: " + key_list(plan.result.unexpected_keys) + ".";
    }
  }
  // Non-strict loads skip keys; every rank must skip the same ones, or ranks would end up with
  // different models. (`strict` is the same on every rank, so all or none take part. A rank that
  // already failed sends a marker and is not compared: its own error is reported below.)
  if (!strict) {
    const std::string failed = "\x01" "failed";
    const std::string mine = plan.error.empty() ? key_list(plan.result.missing_keys) + "|" +
                                                      key_list(plan.result.unexpected_keys)
                                                : failed;
    const auto all = st.world_group.all_gather_bytes(mine);
    for (size_t r = 0; r < all.size() && plan.error.empty(); ++r) {
      if (all[r] != failed && all[r] != mine) {
        plan.error = "ranks disagree on the keys to skip: rank " +
                     std::to_string(st.world_group.rank()) + " misses/ignores " + mine + ", rank " +
                     std::to_string(r) + " " + all[r];
      }
    }
  }
  // All-or-nothing across ranks: apply only if every rank's plan is sound.
  const auto errors = st.world_group.all_gather_bytes(plan.error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    if (!plan.error.empty()) throw ValueError("load_state_dict: " + plan.error);
    throw ValueError("load_state_dict aborted, nothing was loaded: rank " + std::to_string(r) +
                     " failed: " + errors[r]);
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : plan.copies) dst.copy_(src);
  return plan.result;
}

}  // namespace fsdp
