// Internal: how a StateDict becomes DCP items and back (shared by save, load and verify):
// DCP's key flattening, and the payload of each item, a complete torch.save archive.
#pragma once

#include <ATen/ATen.h>

#include <functional>

#include <string>
#include <vector>

#include "checkpoint/dcp/metadata.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {
namespace items {

/// One value of a state dict under its DCP key, and its path in the nested dict.
struct FlatItem {
  std::string key;
  std::vector<dcp::PathElement> path;
  StateValue* value;
};

/// DCP's traversal (2.4+): dicts always; lists where they hold a dict, a tensor or such a list.
std::vector<FlatItem> flatten(StateDict& sd);

/// Receives an item's bytes in order.
using ByteSink = std::function<void(const char* data, size_t n)>;

/// Writes a torch.save archive of one tensor into `sink`, holding only the tensor's own elements
/// (a view's storage is not dragged in). The data goes from the tensor's memory straight to the
/// sink (only a non-contiguous or non-CPU tensor is copied first); the few dtypes without a
/// storage class in our table fall back to LibTorch's pickle_save.
void write_tensor_item(const at::Tensor& t, const ByteSink& sink);
/// A torch.save archive of one non-tensor value (our protocol-2 pickle); ValueError naming `key`
/// for a value DCP stores as bytes but that holds a tensor.
std::string value_payload(const StateValue& v, const std::string& key);

/// An item's bytes where they lie, in pieces that tile [0, size) in order: one for an item read
/// into a buffer; three for a chunk read straight into its destination (the archive's head, the
/// storage record in the destination's memory, the tail).
struct ItemParts {
  struct Part {
    int64_t offset;  // in the item
    size_t n;
    const char* data;
  };
  std::vector<Part> parts;
  size_t size = 0;
};

/// Decodes a tensor payload (`n` bytes at `data`): a view of the bytes, valid while they are.
/// ValueError naming `where` if it is not one; with `check_crc`, also if a record fails its
/// CRC-32 (for items no manifest checksum covers).
at::Tensor decode_tensor(const char* data, size_t n, const std::string& where, bool check_crc);
/// The same for an item in pieces; a storage must lie within one piece (else ValueError).
at::Tensor decode_tensor(const ItemParts& item, const std::string& where, bool check_crc);
/// Decodes a value payload through the restricted reader (tensors inside it are views, as above).
StateValue decode_value(const char* data, size_t n, const std::string& where, bool check_crc);

}  // namespace items
}  // namespace checkpoint
}  // namespace fsdp
