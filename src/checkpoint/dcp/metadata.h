// Internal: the `.metadata` file of a PyTorch DCP (torch.distributed.checkpoint) FileSystem
// checkpoint, as C++ values, read with the restricted pickle reader and written in the form stock
// PyTorch 2.6 and 2.14 load (issue 11; tests/dcp loads ours with PyTorch's DCP).
//
// Python's classes and what they become here:
//   Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)
//     -> Metadata (storage_meta is accepted and ignored)
//   TensorStorageMetadata(properties: TensorProperties, size: torch.Size,
//                         chunks: [ChunkStorageMetadata(offsets, sizes)])  -> TensorMeta
//   BytesStorageMetadata()                                                 -> ItemMeta::bytes
//   MetadataIndex(fqn, offset: torch.Size | None, index: int | None)       -> Index
//   filesystem._StorageInfo(relative_path, offset, length[, transform_descriptors])
//                                                                          -> StorageInfo
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fsdp {
namespace checkpoint {
namespace dcp {

struct ChunkMeta {
  std::vector<int64_t> offsets, sizes;
  bool operator==(const ChunkMeta& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

struct TensorMeta {
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  std::vector<int64_t> size;
  std::vector<ChunkMeta> chunks;
};

/// One key of the checkpoint: a tensor stored as chunks, or a non-tensor value (bytes).
struct ItemMeta {
  bool bytes = false;
  TensorMeta tensor;  // when !bytes
};

/// Where an item is: the key, and for a tensor chunk its offsets (PyTorch's MetadataIndex).
struct Index {
  std::string fqn;
  std::optional<std::vector<int64_t>> offset;
  std::optional<int64_t> index;
  bool operator==(const Index& o) const {
    return fqn == o.fqn && offset == o.offset && index == o.index;
  }
};

/// Where its bytes are: a file in the checkpoint directory and a byte range in it.
struct StorageInfo {
  std::string relative_path;
  int64_t offset = 0;
  int64_t length = 0;
};

using PathElement = std::variant<std::string, int64_t>;

struct Metadata {
  std::vector<std::pair<std::string, ItemMeta>> state_dict_metadata;
  /// DCP's default planner: flattened key -> the path in the nested state dict it came from.
  std::vector<std::pair<std::string, std::vector<PathElement>>> planner_data;
  std::vector<std::pair<Index, StorageInfo>> storage_data;
  /// "1.0.0" from PyTorch 2.14 on; empty when the file has none.
  std::string version;
};

/// Parses a `.metadata` file's bytes. Only DCP's own classes, torch.Size, dtypes, layouts, memory
/// formats and pathlib paths may appear; anything else, and any value of the wrong kind or out of
/// range (negative sizes, chunks outside their tensor, an unknown dtype), throws ValueError
/// naming the key. `what` names the file in messages.
Metadata parse_metadata(const std::string& bytes, const std::string& what = ".metadata");

/// The bytes of a `.metadata` file for `m`.
std::string serialize_metadata(const Metadata& m);

/// A compact binary form of `m` for the ranks' own exchange during a save, where each rank sends
/// rank 0 the metadata of what it wrote. Not a file format: the same build writes and reads it
/// within one save. It replaces a `.metadata` pickle per rank, whose writing and checked parsing
/// took about 5 ms of rank 0's 26 ms save of a 1M-parameter model and Adam at W=2, and grew with
/// W; rank 0 still writes the merged `.metadata` once.
std::string encode_wire(const Metadata& m);

/// Reads encode_wire's bytes. Every count and length is checked against the bytes left, dtypes
/// against the ones DCP stores, and chunks against their tensor, as parse_metadata does; anything
/// malformed throws ValueError naming `what`. Never reads past the buffer.
Metadata decode_wire(const std::string& bytes, const std::string& what);

/// PyTorch's name of a dtype ("float32", "bfloat16", ...); throws ValueError for a dtype DCP
/// cannot store.
std::string dtype_name(at::ScalarType t);

/// The globals a `.metadata` pickle may name ({module, name}): DCP's classes, torch.Size, dtypes
/// and pathlib's paths. Nothing else is ever constructed or called.
const std::set<std::pair<std::string, std::string>>& metadata_globals();

}  // namespace dcp
}  // namespace checkpoint
}  // namespace fsdp
