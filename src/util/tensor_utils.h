// Internal: tensor and storage helpers shared by every layer (dist/ included): shapes in messages,
// box bounds, and moving, freeing and allocating tensor memory.
#pragma once

#include <string>

#include <ATen/ATen.h>

#include "fsdp/errors.h"
#include "util/huge_pages.h"
#include "util/message.h"

namespace fsdp {
namespace detail {

/// "[2, 3]" ("[]" for a 0-d shape), as PyTorch prints a size: msg(shape(s)) on its own, for text
/// that is not an error message.
inline std::string shape_str(at::IntArrayRef s) { return msg(shape(s)); }

// The first dim in which the box at `offsets` of `sizes` leaves a tensor of `shape`, or -1 (all
// three of the same rank). Written so that no sum can overflow: offsets and sizes come from
// files and peers, and `offset + size > dim` wraps for values near INT64_MAX.
inline int dim_outside(at::IntArrayRef offsets, at::IntArrayRef sizes, at::IntArrayRef shape) {
  for (size_t d = 0; d < shape.size(); ++d) {
    if (offsets[d] < 0 || sizes[d] < 0 || offsets[d] > shape[d] || sizes[d] > shape[d] - offsets[d])
      return static_cast<int>(d);
  }
  return -1;
}

// Moves a tensor's memory out of its storage, which is left empty (and so are its views), and
// returns it: a unit-sized block handed from one buffer to the next without a trip through the
// allocator, which on the CPU would give it back to the kernel (glibc returns blocks over its
// mmap threshold) and page-fault it in anew.
inline at::DataPtr take_memory(const at::Tensor& t) {
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  at::DataPtr memory = st->set_data_ptr(at::DataPtr(nullptr, t.device()));
  st->set_nbytes(0);
  return memory;
}

// Frees a tensor's storage for real (the allocator gets the memory back) while keeping the tensor
// and every view of it; alloc_storage gives it fresh memory of the tensor's size again.
inline void free_storage(const at::Tensor& t) {
  if (!t.defined() || t.storage().nbytes() == 0) return;
  take_memory(t);  // dropped here: the allocator's deleter frees it
}

inline void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (st->nbytes() == nbytes) return;
  if (st->nbytes() != 0) {
    throw InternalError(msg("alloc_storage: storage already holds ", st->nbytes(),
                            " bytes, expected 0 or ", nbytes));
  }
  st->set_data_ptr_noswap(st->allocator()->allocate(nbytes));
  st->set_nbytes(nbytes);
  if (t.device().is_cpu()) advise_huge_pages(st->data(), nbytes);
}

// at::empty for a 1-D buffer that is written whole right after (a collective's output, a gradient
// copy): fresh CPU memory of a unit's size gets huge pages (util/huge_pages.h).
inline at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = at::empty({numel}, options);
  if (t.device().is_cpu()) advise_huge_pages(t.storage().data(), t.storage().nbytes());
  return t;
}

// A 1-D tensor of `numel` elements of `options` on `nbytes` of memory from take_memory (at least
// numel elements' worth; the allocator's deleter frees it with the tensor's storage).
inline at::Tensor tensor_on_memory(at::DataPtr memory, size_t nbytes, int64_t numel,
                                   const at::TensorOptions& options) {
  if (nbytes <
      static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()))) {
    throw InternalError(
        msg("tensor_on_memory: ", nbytes, " bytes hold fewer than ", numel, " elements"));
  }
  at::Tensor t = at::empty({0}, options);
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  st->set_data_ptr_noswap(std::move(memory));
  st->set_nbytes(nbytes);
  t.set_(t.storage(), 0, {numel}, {1});
  return t;
}

inline int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

// A tensor of `numel` elements whose storage starts out freed.
inline at::Tensor freed_buffer(int64_t numel, at::ScalarType dtype, at::Device device) {
  at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  free_storage(t);
  return t;
}

// A device with its index: "cuda" becomes "cuda:<current device>" (what tensors created on it
// report), so that devices compare equal to those of the tensors placed on them.
inline at::Device with_index(const at::Device& d) {
  if (d.has_index() || !d.is_cuda()) return d;
  return at::empty({0}, at::TensorOptions().device(d)).device();
}

// True if `t` is exactly flat[offset, offset + numel) of `flat`'s storage.
inline bool aliases(const at::Tensor& t, const at::Tensor& flat, int64_t offset, int64_t numel) {
  return t.defined() && flat.defined() && t.numel() == numel && t.has_storage() &&
         t.storage().is_alias_of(flat.storage()) &&
         t.storage_offset() == flat.storage_offset() + offset;
}

// True if `t` already is flat.narrow(0, offset, numel).view(shape): contiguous, of `flat`'s dtype,
// over the same memory. Setting `t`'s data to that view again would change nothing.
inline bool is_view_at(const at::Tensor& t, const at::Tensor& flat, int64_t offset,
                       at::IntArrayRef shape) {
  return t.defined() && t.sizes() == shape &&
         aliases(t, flat, offset, c10::multiply_integers(shape)) && t.dtype() == flat.dtype() &&
         t.is_contiguous();
}

// A tensor sharing `base`'s storage at [offset, offset + numel) with the given shape, without
// being an autograd view of it. Gradients handed to optimizers are built this way: LibTorch 1.13's
// Optimizer::zero_grad() calls detach_(), which refuses views.
inline at::Tensor storage_alias(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::NoGradGuard no_grad;
  at::Tensor t = at::empty({0}, base.options());
  t.set_(base.storage(), base.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  return t;
}

inline void set_param_data(at::Tensor& param, const at::Tensor& data) {
  at::NoGradGuard no_grad;
  param.set_data(data);
}

}  // namespace detail
}  // namespace fsdp
