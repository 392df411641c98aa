// Internal: dtype names of the exchange formats (safetensors' "F32", torch.save's FloatStorage)
// and overflow-safe tensor sizes, shared by the exports and imports.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace formats {

struct DtypeName {
  at::ScalarType dtype;
  const char* safetensors;
  const char* storage;  // torch.<storage> in torch.save pickles
};

inline const std::vector<DtypeName>& dtype_names() {
  static const std::vector<DtypeName> names = {
      {at::kDouble, "F64", "DoubleStorage"}, {at::kFloat, "F32", "FloatStorage"},
      {at::kHalf, "F16", "HalfStorage"},     {at::kBFloat16, "BF16", "BFloat16Storage"},
      {at::kLong, "I64", "LongStorage"},     {at::kInt, "I32", "IntStorage"},
      {at::kShort, "I16", "ShortStorage"},   {at::kChar, "I8", "CharStorage"},
      {at::kByte, "U8", "ByteStorage"},      {at::kBool, "BOOL", "BoolStorage"},
  };
  return names;
}

inline std::string safetensors_dtype(at::ScalarType t, const std::string& what) {
  for (const auto& n : dtype_names())
    if (n.dtype == t) return n.safetensors;
  throw ValueError(detail::msg(what, ": dtype ", t, " has no safetensors name"));
}

/// torch.save's storage class name for `t` ("FloatStorage"), or null where the table has none.
inline const char* find_storage_class(at::ScalarType t) {
  for (const auto& n : dtype_names())
    if (n.dtype == t) return n.storage;
  return nullptr;
}

inline std::string storage_class(at::ScalarType t, const std::string& what) {
  if (const char* name = find_storage_class(t)) return name;
  throw ValueError(detail::msg(what, ": dtype ", t, " cannot be written to a .pt file"));
}

/// numel * itemsize, or ValueError naming `what` for a negative dimension or an overflow.
inline int64_t checked_nbytes(const std::vector<int64_t>& shape, at::ScalarType t,
                              const std::string& what) {
  int64_t n = static_cast<int64_t>(c10::elementSize(t));
  for (int64_t s : shape) {
    if (s < 0) throw ValueError(detail::msg(what, ": negative dimension ", s));
    if (s != 0 && n > INT64_MAX / s)
      throw ValueError(detail::msg(what, ": the shape's byte size overflows 64 bits"));
    n *= s;
  }
  return n;
}

}  // namespace formats
}  // namespace checkpoint
}  // namespace fsdp
