// fsdp/state_value.h: the state-dict value model shared by model, optimizer, checkpoint and utility
// code, and ShardedTensor, a tensor described by pieces at global offsets.
//
// A StateDict is an insertion-ordered map from string keys to StateValues. A StateValue holds what
// a PyTorch state dict can: None, a tensor, a sharded tensor, an int, a float, a bool, a string, a
// list or a nested dict. Copies of StateDict/StateValue copy the containers; tensors inside are
// shared (as when copying a Python dict), so clone them to own the data.
//
// Which API: this header holds values only; get_state_dict / set_state_dict
// (fsdp/checkpoint/state_dict.h) produce and consume them.
//
// Thread safety: none; like std containers.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

namespace fsdp {

class StateValue;

/// Where one piece of a ShardedTensor lies: the box [offsets, offsets + sizes) of the global
/// tensor, and the rank that holds it. (A state dict's or checkpoint's view of a shard; how a
/// flat parameter's shard maps onto its parameters is ShardParamInfo, in flat_param.h.)
struct ShardMetadata {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int placement_rank = 0;
  int64_t numel() const;
  bool operator==(const ShardMetadata& o) const {
    return offsets == o.offsets && sizes == o.sizes && placement_rank == o.placement_rank;
  }
};

/// One piece held in memory: its data (shape == metadata.sizes) and where it lies.
struct Shard {
  at::Tensor tensor;
  ShardMetadata metadata;
};

/// A tensor of `global_shape` whose data is spread across ranks as boxes. Holds this process's
/// pieces (`local_shards`) and, optionally, the metadata of every piece on every rank
/// (`global_metadata`), which is what a loader needs to find data saved by another world size.
/// Nothing here refers to FSDP internals: dim-0 chunks of a parameter and 1-D pieces of a flat
/// parameter are both just boxes.
class ShardedTensor {
 public:
  ShardedTensor() = default;
  /// Throws ValueError if a piece's tensor does not match its box, a box leaves the global shape,
  /// or a piece's dtype differs from `dtype`.
  ShardedTensor(std::vector<int64_t> global_shape, at::ScalarType dtype,
                std::vector<Shard> local_shards, std::vector<ShardMetadata> global_metadata = {});

  const std::vector<int64_t>& size() const { return global_shape_; }
  int64_t numel() const;
  at::ScalarType dtype() const { return dtype_; }
  const std::vector<Shard>& local_shards() const { return local_shards_; }
  std::vector<Shard>& local_shards() { return local_shards_; }
  /// Metadata of all pieces everywhere, if known (else empty).
  const std::vector<ShardMetadata>& global_metadata() const { return global_metadata_; }

  /// Copies the pieces held here into `out` (shape == size()), and marks the elements written in
  /// `covered` (bool, same shape) if given.
  void copy_into(at::Tensor& out, at::Tensor* covered = nullptr) const;
  /// Elements [start, start + n) of the row-major flattened tensor, assembled from the pieces held
  /// here. Throws ValueError starting with `what`, which names the tensor (e.g. "'fc.weight'",
  /// quotes included), if the pieces do not cover the range.
  at::Tensor flat_range(int64_t start, int64_t n, const std::string& what) const;
  /// A ShardedTensor with the same metadata whose pieces are on `device` (copies if needed).
  ShardedTensor to(at::Device device) const;

 private:
  std::vector<int64_t> global_shape_;
  at::ScalarType dtype_ = at::kFloat;
  std::vector<Shard> local_shards_;
  std::vector<ShardMetadata> global_metadata_;
};

/// torch.chunk of `full` along dim 0 into `world` pieces: the ShardedTensor rank `rank` holds (a
/// clone of its chunk, none if its chunk is empty), with the metadata of every chunk. A 0-d tensor
/// is held whole by rank 0.
ShardedTensor chunk_sharded(const at::Tensor& full, int rank, int world);

/// The pieces chunk_sharded cuts a tensor of `shape` into (every rank's; ranks past the last
/// row get none; a 0-d or empty tensor is one piece on rank 0).
std::vector<ShardMetadata> chunk_metadata(const std::vector<int64_t>& shape, int world);

/// The flat-range form of a piece. Elements [start, start + n) of the row-major flattening of a
/// tensor of `shape`, as boxes in order: their elements, each box taken row-major, concatenate
/// to the range. At most 2 * ndim - 1 boxes (one per dimension on each side of a middle box of
/// whole rows); none when n == 0; a 0-d tensor is one empty-shaped box. Each box is placed on
/// `rank`. This is how a flat-parameter shard's part of a parameter (a use_orig_params shard
/// split mid-row), an optimizer state's range, or a checkpoint's byte range of a tensor become
/// pieces that every ShardedTensor consumer handles. Throws ValueError if the range leaves the
/// tensor.
std::vector<ShardMetadata> flat_range_boxes(const std::vector<int64_t>& shape, int64_t start,
                                            int64_t n, int rank = 0);

/// A ShardedTensor of `global_shape` whose local pieces are elements [start, start +
/// data.numel()) of its row-major flattening: `data` (1-D) cut along flat_range_boxes, each piece
/// a view of `data` (no copy). ShardedTensor::flat_range is the inverse.
ShardedTensor sharded_from_flat_range(std::vector<int64_t> global_shape, int64_t start,
                                      const at::Tensor& data, int rank,
                                      std::vector<ShardMetadata> global_metadata = {});

/// The view of `full` (a tensor of the global shape) at `box`.
at::Tensor box_view(const at::Tensor& full, const ShardMetadata& box);

/// Keys a non-strict load skipped (PyTorch's _IncompatibleKeys).
struct LoadResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

/// An insertion-ordered map of string keys to StateValue.
class StateDict {
 public:
  using Item = std::pair<std::string, StateValue>;
  StateDict() = default;
  StateDict(const StateDict&);
  StateDict(StateDict&&) noexcept = default;
  StateDict& operator=(const StateDict&);
  StateDict& operator=(StateDict&&) noexcept = default;
  ~StateDict();

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  /// Throws ValueError naming the key if absent.
  StateValue& at(const std::string& key);
  const StateValue& at(const std::string& key) const;
  /// Inserts at the end, or replaces in place (keeping the key's position).
  void insert_or_assign(const std::string& key, StateValue value);
  /// Removes the key if present; returns whether it was. Later keys keep their order.
  bool erase(const std::string& key);
  std::vector<std::string> keys() const;
  std::vector<Item>::iterator begin() { return items_.begin(); }
  std::vector<Item>::iterator end() { return items_.end(); }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
};

using StateList = std::vector<StateValue>;

/// One value of a state dict.
class StateValue {
 public:
  enum class Kind {
    NONE,
    TENSOR,
    SHARDED_TENSOR,
    INT,
    DOUBLE,
    BOOL,
    STRING,
    LIST,
    DICT,
    // The names before the one enum style (docs/migration.md); removed in the next release.
    None [[deprecated("use Kind::NONE")]] = NONE,
    Tensor [[deprecated("use Kind::TENSOR")]] = TENSOR,
    ShardedTensor [[deprecated("use Kind::SHARDED_TENSOR")]] = SHARDED_TENSOR,
    Int [[deprecated("use Kind::INT")]] = INT,
    Double [[deprecated("use Kind::DOUBLE")]] = DOUBLE,
    Bool [[deprecated("use Kind::BOOL")]] = BOOL,
    String [[deprecated("use Kind::STRING")]] = STRING,
    List [[deprecated("use Kind::LIST")]] = LIST,
    Dict [[deprecated("use Kind::DICT")]] = DICT,
  };

  StateValue() = default;  // None
  StateValue(at::Tensor t) : v_(std::move(t)) {}
  StateValue(ShardedTensor t) : v_(std::move(t)) {}
  StateValue(int64_t x) : v_(x) {}
  StateValue(int x) : v_(static_cast<int64_t>(x)) {}
  StateValue(double x) : v_(x) {}
  StateValue(bool x) : v_(x) {}
  StateValue(std::string s) : v_(std::move(s)) {}
  StateValue(const char* s) : v_(std::string(s)) {}
  StateValue(StateList l) : v_(std::move(l)) {}
  StateValue(StateDict d) : v_(std::move(d)) {}

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_none() const { return kind() == Kind::NONE; }
  bool is_tensor() const { return kind() == Kind::TENSOR; }
  bool is_sharded_tensor() const { return kind() == Kind::SHARDED_TENSOR; }
  bool is_int() const { return kind() == Kind::INT; }
  bool is_double() const { return kind() == Kind::DOUBLE; }
  bool is_bool() const { return kind() == Kind::BOOL; }
  bool is_string() const { return kind() == Kind::STRING; }
  bool is_list() const { return kind() == Kind::LIST; }
  bool is_dict() const { return kind() == Kind::DICT; }

  // Accessors throw ValueError naming the expected and actual kind.
  const at::Tensor& tensor() const;
  at::Tensor& tensor();
  const ShardedTensor& sharded_tensor() const;
  ShardedTensor& sharded_tensor();
  int64_t to_int() const;
  double to_double() const;  // also accepts Int
  bool to_bool() const;
  const std::string& string() const;
  const StateList& list() const;
  StateList& list();
  const StateDict& dict() const;
  StateDict& dict();

 private:
  std::variant<std::monostate, at::Tensor, ShardedTensor, int64_t, double, bool, std::string,
               StateList, StateDict>
      v_;
};

/// "None", "Tensor", ... for messages.
const char* to_string(StateValue::Kind k);

/// PyTorch's `module.state_dict()` for an unwrapped LibTorch module: for each module in pre-order,
/// its own parameters then its own buffers, keyed by FQN; a tied parameter appears under every
/// FQN that names it. Values are detached (not cloned) tensors.
StateDict module_state_dict(const torch::nn::Module& module);

}  // namespace fsdp
