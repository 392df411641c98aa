// Internal: torch.save archives read without LibTorch's archive reader. A torch.save file (and
// every DCP item) is a zip of stored records under one top-level folder: `data.pkl`, `data/<key>`
// (one per storage), `version`, `byteorder`, ... Our reader:
//  - parses the zip directory (ZIP64 included) from a byte source and checks every offset, size
//    and name against it before anything is allocated for a record;
//  - hands records out by position, so a caller reads a storage straight into its tensor (from a
//    file) or views it where it lies (an item already in memory), with no intermediate copies;
//  - checks each record's CRC-32 when asked (items without an xxh3 in a manifest);
//  - rebuilds values from data.pkl through the restricted unpickler (pickle.h): tensors via
//    `_rebuild_tensor_v2` only, every size and stride checked against its storage.
#pragma once

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "checkpoint/formats/pickle.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {
namespace archive {

/// One stored record: its data's place in the archive and its CRC-32.
struct Record {
  int64_t offset = 0;
  int64_t size = 0;
  uint32_t crc32 = 0;
};

/// Reads `n` bytes at `offset` of the archive into `dst`, or throws.
using ReadFn = std::function<void(int64_t offset, size_t n, char* dst)>;

/// The records of a zip archive of `size` bytes. Throws ValueError starting with `where` for
/// anything that is not a well-formed archive of stored (uncompressed) records under one folder.
class Directory {
 public:
  Directory(int64_t size, const ReadFn& read, std::string where);
  /// The record "<folder>/<name>", or null.
  const Record* find(const std::string& name) const;
  /// Every record, by name under the folder.
  const std::map<std::string, Record>& records() const { return records_; }
  const std::string& where() const { return where_; }
  int64_t size() const { return size_; }

 private:
  std::string where_;
  int64_t size_;
  std::map<std::string, Record> records_;  // by name under the folder
};

/// The record of storage `key`, checked to hold exactly `numel` elements of `dtype`.
const Record& storage_record(const Directory& dir, const std::string& key, at::ScalarType dtype,
                             int64_t numel);

/// CRC-32 (the zip polynomial) of `n` bytes, continuing from `crc`.
uint32_t crc32(const char* data, size_t n, uint32_t crc = 0);

/// Globals a torch.save pickle of tensors, dicts and lists may name.
const std::set<std::pair<std::string, std::string>>& pickle_globals();

/// The tensor storage `key` of `numel` elements of `dtype` (called once per key).
using StorageFn =
    std::function<at::Tensor(const std::string& key, at::ScalarType dtype, int64_t numel)>;

/// Turns an unpickled data.pkl into StateValues. Tensors are strided views of their storages
/// (sharing them, as in the file); `fail` prefixes every error.
class Values {
 public:
  Values(StorageFn storage, int64_t archive_size, std::string where)
      : storage_(std::move(storage)), archive_size_(archive_size), where_(std::move(where)) {}
  StateValue value(const pickle::NodePtr& n, const std::string& name, int depth = 0);
  /// A `_rebuild_tensor_v2(...)` call's tensor.
  at::Tensor tensor(const pickle::Node& call, const std::string& name);

 private:
  [[noreturn]] void fail(const std::string& what) const;
  std::vector<int64_t> ints(const pickle::NodePtr& n, const std::string& what) const;
  at::Tensor storage_of(const std::string& key, at::ScalarType dtype, int64_t numel,
                        const std::string& name);

  StorageFn storage_;
  int64_t archive_size_;
  std::string where_;
  std::map<std::string, at::Tensor> storages_;
};

/// The unpickled data.pkl of an archive (refusing TorchScript archives and big-endian ones);
/// ValueError starting with the directory's `where`.
pickle::NodePtr read_data_pkl(const Directory& dir, const ReadFn& read, bool check_crc);

/// A torch.save archive written by LibTorch's zip writer (PyTorchStreamWriter: aligned records,
/// CRC-32s, ZIP64 when needed) into `sink`, with no copy of the record data. The writer calls its
/// callback from C code (miniz) and from its destructor, where an exception must not pass, so a
/// sink error is kept, later bytes are dropped, and finish() rethrows it.
class ArchiveWriter {
 public:
  using Sink = std::function<void(const char* data, size_t n)>;
  explicit ArchiveWriter(Sink sink);
  ~ArchiveWriter();
  ArchiveWriter(const ArchiveWriter&) = delete;
  ArchiveWriter& operator=(const ArchiveWriter&) = delete;
  /// Adds the stored record "<archive>/<name>".
  void record(const std::string& name, const void* data, size_t n);
  /// Writes the directory (and LibTorch's `version` record); throws the first sink error.
  void finish();

 private:
  Sink sink_;
  std::exception_ptr error_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> zip_;
};

/// Writes a torch.save archive of `t` (contiguous, CPU, a dtype with a storage class) into `sink`,
/// holding only the tensor's own elements: data.pkl (tensor_node, storage key "0"), byteorder,
/// data/0 (64-byte aligned, straight from the tensor's memory) and version. Our own zip writer,
/// with the fast crc32 above, writes it; archives that need ZIP64 (data over 3.75 GiB) go
/// through ArchiveWriter with the same records.
void write_tensor_archive(const at::Tensor& t, const ArchiveWriter::Sink& sink);

/// What torch.save pickles for a tensor held whole by storage `key`: the call
/// torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict()), the storage
/// being the persistent id ('storage', torch.<T>Storage, key, 'cpu', numel). ValueError naming
/// `what` for a dtype with no storage class.
pickle::NodePtr tensor_node(at::ScalarType dtype, const std::string& key, at::IntArrayRef sizes,
                            at::IntArrayRef strides, int64_t numel, const std::string& what);

}  // namespace archive
}  // namespace checkpoint
}  // namespace fsdp
