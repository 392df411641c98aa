// StateDict / StateValue, ShardedTensor, and the unwrapped module's state dict (save and load).
#include "fsdp/state_value.h"

#include "fsdp/errors.h"
#include "fsdp/model_state_dict.h"
#include "state_dict/load_keys.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace {

using detail::msg;
using detail::quote;
using detail::shape;

// Row-major strides of a shape, in elements.
std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    st[d] = st[d + 1] * shape[d + 1];
  }
  return st;
}

// The box's elements form one contiguous run of the flattened tensor when every dimension after
// the first it splits is whole (true for dim-0 chunks and for 1-D pieces).
bool box_is_contiguous(const ShardMetadata& m, const std::vector<int64_t>& shape) {
  size_t d = 0;
  while (d < shape.size() && m.sizes[d] == 1) ++d;  // leading unit dims
  for (size_t k = d + 1; k < shape.size(); ++k) {
    if (m.offsets[k] != 0 || m.sizes[k] != shape[k]) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ShardedTensor

int64_t ShardMetadata::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

ShardedTensor::ShardedTensor(std::vector<int64_t> global_shape, at::ScalarType dtype,
                             std::vector<Shard> local_shards,
                             std::vector<ShardMetadata> global_metadata)
    : global_shape_(std::move(global_shape)),
      dtype_(dtype),
      local_shards_(std::move(local_shards)),
      global_metadata_(std::move(global_metadata)) {
  auto check_box = [&](const ShardMetadata& m) {
    if (m.offsets.size() != global_shape_.size() || m.sizes.size() != global_shape_.size()) {
      throw ValueError(msg("ShardedTensor: piece at ", shape(m.offsets), " has ", m.offsets.size(),
                           " dims, the tensor ", global_shape_.size()));
    }
    if (detail::dim_outside(m.offsets, m.sizes, global_shape_) >= 0) {
      throw ValueError(msg("ShardedTensor: piece at offsets ", shape(m.offsets), " sizes ",
                           shape(m.sizes), " leaves the global shape ", shape(global_shape_)));
    }
  };
  for (const auto& s : local_shards_) {
    check_box(s.metadata);
    if (!s.tensor.defined() || s.tensor.sizes() != at::IntArrayRef(s.metadata.sizes)) {
      throw ValueError(msg("ShardedTensor: piece at ", shape(s.metadata.offsets), " has shape ",
                           s.tensor.defined() ? msg(shape(s.tensor.sizes())) : "undefined",
                           " but its metadata says ", shape(s.metadata.sizes)));
    }
    if (s.tensor.scalar_type() != dtype_) {
      throw ValueError(msg("ShardedTensor: piece at ", shape(s.metadata.offsets), " has dtype ",
                           s.tensor.scalar_type(), ", the tensor ", dtype_));
    }
  }
  for (const auto& m : global_metadata_) check_box(m);
}

int64_t ShardedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : global_shape_) n *= s;
  return n;
}

void ShardedTensor::copy_into(at::Tensor& out, at::Tensor* covered) const {
  for (const auto& s : local_shards_) {
    at::Tensor dst = out;
    at::Tensor cov = covered ? *covered : at::Tensor();
    for (size_t d = 0; d < global_shape_.size(); ++d) {
      dst = dst.narrow(d, s.metadata.offsets[d], s.metadata.sizes[d]);
      if (cov.defined()) cov = cov.narrow(d, s.metadata.offsets[d], s.metadata.sizes[d]);
    }
    dst.copy_(s.tensor);
    if (cov.defined()) cov.fill_(true);
  }
}

at::Tensor ShardedTensor::flat_range(int64_t start, int64_t n, const std::string& what) const {
  if (start < 0 || n < 0 || start + n > numel()) {
    throw ValueError(msg(what, ": range [", start, ", ", start + n, ") is outside a tensor of ",
                         numel(), " elements"));
  }
  auto opts = at::TensorOptions().dtype(dtype_);
  at::Tensor out = at::empty({n}, opts);
  bool simple = true;
  for (const auto& s : local_shards_) simple &= box_is_contiguous(s.metadata, global_shape_);
  if (simple) {
    // Fast path: each piece is one contiguous run of the flattened tensor. Coverage is tracked
    // per element: pieces may overlap (the same piece from two ranks), so counting would lie.
    const auto st = strides_of(global_shape_);
    at::Tensor covered = at::zeros({n}, at::kBool);
    for (const auto& s : local_shards_) {
      int64_t pstart = 0;
      for (size_t d = 0; d < st.size(); ++d) pstart += s.metadata.offsets[d] * st[d];
      const int64_t pn = s.metadata.numel();
      const int64_t lo = std::max(start, pstart), hi = std::min(start + n, pstart + pn);
      if (lo >= hi) continue;
      out.narrow(0, lo - start, hi - lo)
          .copy_(s.tensor.reshape({-1}).narrow(0, lo - pstart, hi - lo));
      covered.narrow(0, lo - start, hi - lo).fill_(true);
    }
    if (n == 0 || covered.all().item<bool>()) return out;
  } else {
    at::Tensor full = at::empty(global_shape_, opts);
    at::Tensor covered = at::zeros(global_shape_, at::kBool);
    copy_into(full, &covered);
    if (covered.reshape({-1}).narrow(0, start, n).all().item<bool>()) {
      return full.reshape({-1}).narrow(0, start, n).clone();
    }
  }
  throw ValueError(msg(what, ": the pieces given do not cover elements [", start, ", ", start + n,
                       ") of the flattened tensor (shape ", shape(global_shape_),
                       "); pass the pieces saved by every rank"));
}

ShardedTensor ShardedTensor::to(at::Device device) const {
  std::vector<Shard> shards;
  for (const auto& s : local_shards_) shards.push_back(Shard{s.tensor.to(device), s.metadata});
  return ShardedTensor(global_shape_, dtype_, std::move(shards), global_metadata_);
}

std::vector<ShardMetadata> chunk_metadata(const std::vector<int64_t>& shape, int world) {
  if (shape.empty()) return {ShardMetadata{{}, {}, 0}};  // 0-d: cannot be chunked; rank 0 holds it
  std::vector<ShardMetadata> all;
  const int64_t n = shape[0];
  const int64_t chunk = (n + world - 1) / world;  // torch.chunk's size; ranks past the end get none
  for (int r = 0; r < world; ++r) {
    const int64_t start = std::min<int64_t>(r * chunk, n);
    const int64_t len = std::max<int64_t>(0, std::min<int64_t>(chunk, n - start));
    if (len == 0 && n > 0) continue;
    if (n == 0 && r > 0) continue;  // an empty tensor: one empty piece on rank 0
    ShardMetadata m;
    m.offsets.assign(shape.size(), 0);
    m.offsets[0] = start;
    m.sizes = shape;
    m.sizes[0] = len;
    m.placement_rank = r;
    all.push_back(m);
  }
  return all;
}

ShardedTensor chunk_sharded(const at::Tensor& full, int rank, int world) {
  const std::vector<int64_t> shape = full.sizes().vec();
  std::vector<ShardMetadata> all = chunk_metadata(shape, world);
  std::vector<Shard> mine;
  for (const auto& m : all) {
    if (m.placement_rank != rank) continue;
    at::Tensor piece = shape.empty() ? full.detach().clone()
                                     : full.detach().narrow(0, m.offsets[0], m.sizes[0]).clone();
    mine.push_back(Shard{piece, m});
  }
  return ShardedTensor(shape, full.scalar_type(), std::move(mine), std::move(all));
}

// ---------------------------------------------------------------------------------------------
// StateDict

StateDict::StateDict(const StateDict& o) : items_(o.items_), index_(o.index_) {}
StateDict& StateDict::operator=(const StateDict& o) {
  items_ = o.items_;
  index_ = o.index_;
  return *this;
}
StateDict::~StateDict() = default;

StateValue& StateDict::at(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) throw ValueError(msg("state dict has no key ", quote(key)));
  return items_[it->second].second;
}

const StateValue& StateDict::at(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end()) throw ValueError(msg("state dict has no key ", quote(key)));
  return items_[it->second].second;
}

void StateDict::insert_or_assign(const std::string& key, StateValue value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    items_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, items_.size());
  items_.emplace_back(key, std::move(value));
}

bool StateDict::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  const size_t erased = it->second;
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(erased));
  index_.erase(it);
  for (auto& [k, i] : index_) i -= i > erased ? 1 : 0;  // later keys moved up by one
  return true;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : items_) out.push_back(k);
  return out;
}

// ---------------------------------------------------------------------------------------------
// StateValue

const char* to_string(StateValue::Kind k) {
  switch (k) {
    case StateValue::Kind::NONE:
      return "None";
    case StateValue::Kind::TENSOR:
      return "Tensor";
    case StateValue::Kind::SHARDED_TENSOR:
      return "ShardedTensor";
    case StateValue::Kind::INT:
      return "int";
    case StateValue::Kind::DOUBLE:
      return "float";
    case StateValue::Kind::BOOL:
      return "bool";
    case StateValue::Kind::STRING:
      return "str";
    case StateValue::Kind::LIST:
      return "list";
    case StateValue::Kind::DICT:
      return "dict";
  }
  return "?";
}

namespace {
template <typename T, typename V>
auto& get_as(V& v, StateValue::Kind want, StateValue::Kind have) {
  if (!std::holds_alternative<T>(v)) {
    throw ValueError(msg("state value is ", to_string(have), ", not ", to_string(want)));
  }
  return std::get<T>(v);
}
}  // namespace

const at::Tensor& StateValue::tensor() const {
  return get_as<at::Tensor>(v_, Kind::TENSOR, kind());
}
at::Tensor& StateValue::tensor() { return get_as<at::Tensor>(v_, Kind::TENSOR, kind()); }
const ShardedTensor& StateValue::sharded_tensor() const {
  return get_as<ShardedTensor>(v_, Kind::SHARDED_TENSOR, kind());
}
ShardedTensor& StateValue::sharded_tensor() {
  return get_as<ShardedTensor>(v_, Kind::SHARDED_TENSOR, kind());
}
int64_t StateValue::to_int() const { return get_as<int64_t>(v_, Kind::INT, kind()); }
double StateValue::to_double() const {
  if (is_int()) return static_cast<double>(std::get<int64_t>(v_));
  return get_as<double>(v_, Kind::DOUBLE, kind());
}
bool StateValue::to_bool() const { return get_as<bool>(v_, Kind::BOOL, kind()); }
const std::string& StateValue::string() const {
  return get_as<std::string>(v_, Kind::STRING, kind());
}
const StateList& StateValue::list() const { return get_as<StateList>(v_, Kind::LIST, kind()); }
StateList& StateValue::list() { return get_as<StateList>(v_, Kind::LIST, kind()); }
const StateDict& StateValue::dict() const { return get_as<StateDict>(v_, Kind::DICT, kind()); }
StateDict& StateValue::dict() { return get_as<StateDict>(v_, Kind::DICT, kind()); }

// ---------------------------------------------------------------------------------------------

namespace {

// flat_range_boxes for dims d.. of `shape`, within the fixed prefix `prefix` (one index per dim
// before d), over elements [lo, hi) of that sub-tensor.
void range_boxes(const std::vector<int64_t>& shape, size_t d, std::vector<int64_t>& prefix,
                 int64_t lo, int64_t hi, std::vector<ShardMetadata>& out) {
  if (lo >= hi) return;
  int64_t row = 1;  // elements per index of dim d
  for (size_t k = d + 1; k < shape.size(); ++k) row *= shape[k];
  auto box = [&](int64_t first, int64_t count) {  // indices [first, first + count) of dim d
    ShardMetadata m;
    m.offsets = prefix;
    m.sizes.assign(prefix.size(), 1);
    m.offsets.push_back(first);
    m.sizes.push_back(count);
    for (size_t k = d + 1; k < shape.size(); ++k) {
      m.offsets.push_back(0);
      m.sizes.push_back(shape[k]);
    }
    out.push_back(std::move(m));
  };
  const int64_t r0 = lo / row, r1 = (hi - 1) / row;      // first and last index of dim d touched
  auto partial = [&](int64_t r, int64_t a, int64_t b) {  // part [a, b) of index r
    prefix.push_back(r);
    range_boxes(shape, d + 1, prefix, a, b, out);
    prefix.pop_back();
  };
  if (r0 == r1) {
    if (hi - lo == row) {
      box(r0, 1);
    } else {
      partial(r0, lo - r0 * row, hi - r0 * row);
    }
    return;
  }
  int64_t full_lo = r0, full_hi = r1 + 1;  // indices of dim d covered whole
  if (lo % row != 0) {
    partial(r0, lo - r0 * row, row);
    full_lo = r0 + 1;
  }
  const bool tail = hi % row != 0;
  if (tail) full_hi = r1;
  if (full_hi > full_lo) box(full_lo, full_hi - full_lo);
  if (tail) partial(r1, 0, hi - r1 * row);
}

}  // namespace

std::vector<ShardMetadata> flat_range_boxes(const std::vector<int64_t>& shape, int64_t start,
                                            int64_t n, int rank) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (start < 0 || n < 0 || start + n > numel) {
    throw ValueError(msg("flat_range_boxes: elements [", start, ", ", start + n,
                         ") are outside a tensor of shape ", detail::shape(shape), " (", numel,
                         " elements)"));
  }
  std::vector<ShardMetadata> out;
  if (n == 0) return out;
  if (shape.empty()) return {ShardMetadata{{}, {}, rank}};
  std::vector<int64_t> prefix;
  range_boxes(shape, 0, prefix, start, start + n, out);
  for (auto& b : out) b.placement_rank = rank;
  return out;
}

ShardedTensor sharded_from_flat_range(std::vector<int64_t> global_shape, int64_t start,
                                      const at::Tensor& data, int rank,
                                      std::vector<ShardMetadata> global_metadata) {
  if (data.dim() != 1) {
    throw ValueError(
        msg("sharded_from_flat_range: the data must be 1-D, it has shape ", shape(data.sizes())));
  }
  std::vector<Shard> pieces;
  int64_t pos = 0;
  for (auto& b : flat_range_boxes(global_shape, start, data.numel(), rank)) {
    const int64_t k = b.numel();
    pieces.push_back(Shard{data.narrow(0, pos, k).view(b.sizes), b});
    pos += k;
  }
  return ShardedTensor(std::move(global_shape), data.scalar_type(), std::move(pieces),
                       std::move(global_metadata));
}

StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict sd;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const std::string& prefix = item.key();
    auto name = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
    for (const auto& p : item.value()->named_parameters(false)) {
      sd.insert_or_assign(name(p.key()), p.value().detach());
    }
    for (const auto& b : item.value()->named_buffers(false)) {
      sd.insert_or_assign(name(b.key()), b.value().detach());
    }
  }
  return sd;
}

at::Tensor box_view(const at::Tensor& full, const ShardMetadata& box) {
  at::Tensor part = full;
  for (size_t d = 0; d < box.offsets.size(); ++d)
    part = part.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
  return part;
}

std::string detail::load_keys_error(const LoadResult& r) {
  if (r.missing_keys.empty() && r.unexpected_keys.empty()) return "";
  auto list = [](const std::vector<std::string>& keys) {
    std::string out;
    for (const auto& k : keys) out += msg(out.empty() ? "\"" : ", \"", k, "\"");
    return out;
  };
  std::string e = "Error(s) in loading state_dict:";
  if (!r.missing_keys.empty())
    e += msg(" Missing key(s) in state_dict: ", list(r.missing_keys), ".");
  if (!r.unexpected_keys.empty())
    e += msg(" Unexpected key(s) in state_dict: ", list(r.unexpected_keys), ".");
  return e;
}

LoadResult load_module_state_dict(torch::nn::Module& module, const StateDict& sd, bool strict) {
  const StateDict own = module_state_dict(module);
  LoadResult result;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // dst <- src, applied only if all fit
  std::string error;
  for (const auto& [key, dst] : own) {
    if (!sd.contains(key)) {
      result.missing_keys.push_back(key);
      continue;
    }
    const StateValue& v = sd.at(key);
    at::Tensor src;
    if (v.is_tensor()) {
      src = v.tensor();
    } else if (v.is_sharded_tensor()) {  // usable here only if the local pieces cover it
      const ShardedTensor& t = v.sharded_tensor();
      try {
        src = t.flat_range(0, t.numel(), msg(quote(key))).view(t.size());
      } catch (const ValueError& e) {
        if (error.empty()) error = e.what();
        continue;
      }
    } else {
      if (error.empty()) {
        error = msg(quote(key), " must be a Tensor, the state dict has ", to_string(v.kind()));
      }
      continue;
    }
    if (src.sizes() != dst.tensor().sizes()) {
      if (error.empty()) {
        error = msg("size mismatch for ", quote(key), ": copying a param with shape ",
                    shape(src.sizes()), " from the state dict, the shape in the current model is ",
                    shape(dst.tensor().sizes()));
      }
      continue;
    }
    copies.emplace_back(dst.tensor(), src);
  }
  for (const auto& [key, v] : sd) {
    if (!own.contains(key)) result.unexpected_keys.push_back(key);
  }
  if (error.empty() && strict) error = detail::load_keys_error(result);
  if (!error.empty()) throw ValueError(msg("load_module_state_dict: ", error));
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(src);
  return result;
}

}  // namespace fsdp
