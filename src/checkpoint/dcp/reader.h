// Internal: an opened DCP checkpoint directory. `.metadata` is parsed, the manifest read and
// `.metadata` checked against it once; then any number of fills read what they need. Used by
// load (load.cpp), verify and inspect (verify.cpp) and the exports (which pull one tensor
// at a time). Also the checks of chunks that load and verify share.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/storage/files.h"
#include "fsdp/checkpoint/file_io.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {
namespace dcp {

/// A box of a tensor: [lo, hi) per dimension, in the tensor's coordinates.
struct Region {
  std::vector<int64_t> lo, hi;
};

/// Whether `a` and `b` overlap: in every dimension each starts before the other ends. For boxes
/// that are not empty, whether they share an element; an empty box also overlaps a box it lies
/// strictly inside, and verify reports such a chunk as overlapping.
inline bool overlap(const Region& a, const Region& b) {
  for (size_t d = 0; d < a.lo.size(); ++d)
    if (!(a.lo[d] < b.hi[d] && b.lo[d] < a.hi[d])) return false;
  return true;
}

/// Testing boxes pairwise for overlaps is quadratic: beyond this many boxes of one tensor, load
/// counts their coverage with a mask instead, and verify claims the cells of a grid.
constexpr size_t kMaxPairwiseBoxes = 4096;

/// A decoded chunk must be exactly what the metadata says: a ValueError naming `what` and `where`
/// for another dtype or shape.
void check_chunk(const at::Tensor& chunk, at::ScalarType dtype, const std::vector<int64_t>& sizes,
                 const std::string& where, const char* what);

/// The bytes `.metadata` says are stored for each key: its items' lengths added up (saturating at
/// the int64 maximum).
std::map<std::string, int64_t> stored_bytes(const Metadata& md);

/// Memory is allocated for a whole tensor only once its claim is plausible: its chunks are
/// uncompressed torch.save archives, each holding at least its elements, so a tensor of `nbytes`
/// whose key stores fewer bytes is damaged (or hostile) metadata, a CorruptionError naming `what`,
/// the key and `where`, raised before anything is allocated.
void check_claim(const char* what, const std::string& where, const std::string& key, int64_t nbytes,
                 int64_t stored);

/// The smallest target, in bytes, that a load reads a chunk straight into instead of through its
/// buffer (256 KiB). Process-wide. The fuzz target sets 0 so that inputs of a few KiB reach the
/// direct path's own reading of an item (its zip directory, then the bytes around the record).
void set_direct_read_min_bytes(int64_t bytes);

}  // namespace dcp

class CheckpointReader {
 public:
  /// Throws ValueError naming the file for a missing or incomplete checkpoint, an unreadable
  /// `.metadata` or manifest, or (with `verify`) a `.metadata` that fails its checksum.
  CheckpointReader(FileIO& io, const std::string& dir, bool verify, const char* what);

  /// The bytes a reader is made from: `.metadata`'s and the manifest's, if there is one.
  struct Files {
    std::string metadata;
    std::optional<std::string> manifest;
  };
  /// Reads them from `dir`; throws as the constructor above does for a missing or incomplete
  /// checkpoint.
  static Files read_files(FileIO& io, const std::string& dir, const char* what);
  /// A reader of `dir` from its files' bytes as read elsewhere: a collective load reads them on
  /// one rank and hands them to the others (read_once.cpp); assemble keeps them.
  CheckpointReader(FileIO& io, const std::string& dir, const Files& files, bool verify,
                   const char* what);

  /// Not copied: it keeps pointers into its own metadata.
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const { return dir_; }
  const dcp::Metadata& metadata() const { return md_; }
  const std::optional<manifest::Manifest>& manifest() const { return mf_; }
  /// The key's entry in `.metadata`, or null.
  const dcp::ItemMeta* item(const std::string& key) const;

  /// Where items are read: grown as needed and reused, so reading an item allocates nothing
  /// and touches no fresh pages once the buffer has reached the largest item.
  class Buffer {
   public:
    char* get(size_t n);
    /// Bytes held: what the largest item read through it needed.
    size_t capacity() const { return capacity_; }

   private:
    std::unique_ptr<char[]> data_;
    size_t capacity_ = 0;
  };
  /// Fills `sd` as checkpoint::load does.
  void fill(StateDict& sd) const;
  /// The same, reading items into `buf`, which a caller that fills again and again keeps (the
  /// exports, which fill one tensor at a time).
  void fill(StateDict& sd, Buffer& buf) const;
  /// The bytes of one stored item, read into `buf` and checked against the manifest (when
  /// verifying and it has one); valid until `buf` is used again.
  std::string_view read_item(const std::string& key, const dcp::StorageInfo& info,
                             Buffer& buf) const;
  /// A tensor chunk read straight into the memory of its destination, `dst` (`dst_bytes`, what
  /// the chunk's storage record must hold), without passing through `buf`, which receives only
  /// the archive around the record (a few hundred bytes). Checked against the manifest as
  /// read_item does, then decoded: the chunk is a view of `dst` (in the element order the file
  /// stores, which the caller compares with its target's). nullopt, with `dst` untouched, when the
  /// item is not laid out for it (not one storage record of that size, or a zip directory that
  /// does not parse): the caller then reads it through read_item, which reports what is wrong.
  /// After a checksum or decoding error `dst` holds the item's unverified bytes.
  std::optional<at::Tensor> read_chunk_into(const std::string& key, const dcp::StorageInfo& info,
                                            char* dst, size_t dst_bytes, Buffer& buf) const;
  /// fill's two phases: first which saved item fills which part of which target, every key,
  /// shape and box checked before anything changes (plan); then each item read, checked and
  /// copied (apply). A collective load splits the plan between the ranks (read_once.cpp).
  struct FillPlan {
    struct Copy {
      at::Tensor dst;                       // a view of the target
      std::vector<int64_t> src_lo, extent;  // region of the chunk
    };
    struct Read {
      std::string key;
      std::vector<int64_t> sizes;  // of the chunk
      at::ScalarType dtype = at::kFloat;
      std::vector<Copy> copies;
    };
    struct Value {
      StateValue* target;
      const dcp::StorageInfo* info;
      std::string key;
    };
    std::map<const dcp::StorageInfo*, Read> reads;  // each chunk needed, read once
    std::vector<Value> values;                      // non-tensors

    Read& read_of(const dcp::StorageInfo* info, const std::string& key, const dcp::ChunkMeta& chunk,
                  at::ScalarType dtype);
  };
  FillPlan plan(StateDict& sd) const;
  void apply(FillPlan& plan, Buffer& buf) const;
  /// Decodes one stored chunk (`raw`, its checked bytes) and copies it where `job` says.
  void apply_chunk(const FillPlan::Read& job, const dcp::StorageInfo& info,
                   std::string_view raw) const;
  /// Decodes one stored non-tensor value into its target.
  void apply_value(const FillPlan::Value& v, std::string_view raw) const;

  /// Whether decoding must check CRC-32s: verifying, with no manifest checksum to rely on.
  bool check_crc() const { return verify_ && !mf_; }
  /// "'key' in <file> at offset N", for messages.
  std::string where(const std::string& key, const dcp::StorageInfo& info) const;

 private:
  /// Reads `length` bytes at `offset` of `path` into `out`, adding them to `hash` (if not null)
  /// block by block as they arrive.
  void read_hashed(const std::string& path, int64_t offset, int64_t length, char* out,
                   files::Xxh3Stream* hash) const;
  /// The manifest's checks of an item (its entry, its length, the XXH3-64 of its bytes in hex);
  /// only when verifying with a manifest.
  void check_digest(const std::string& key, const dcp::StorageInfo& info,
                    const std::string& xxh3_hex) const;
  void plan_tensor(const std::string& key, const dcp::ItemMeta& item, StateValue& v,
                   FillPlan& plan) const;

  FileIO& io_;
  std::string dir_;
  bool verify_;
  const char* what_;
  dcp::Metadata md_;
  std::optional<manifest::Manifest> mf_;
  std::map<std::string, const dcp::ItemMeta*> items_;
  std::map<std::pair<std::string, std::vector<int64_t>>, const dcp::StorageInfo*> chunk_at_;
  std::map<std::string, const dcp::StorageInfo*> bytes_at_;
};

}  // namespace checkpoint
}  // namespace fsdp
