// Internal: an opened DCP checkpoint directory. `.metadata` is parsed, the manifest read and
// `.metadata` checked against it once; then any number of fills read what they need. Used by
// load, verify and the exports (which pull one tensor at a time).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/manifest.h"
#include "fsdp/checkpoint/file_io.h"
#include "fsdp/state_dict.h"

namespace fsdp {
namespace checkpoint {

class CheckpointReader {
 public:
  /// Throws ValueError naming the file for a missing or incomplete checkpoint, an unreadable
  /// `.metadata` or manifest, or (with `verify`) a `.metadata` that fails its checksum.
  CheckpointReader(FileIO& io, const std::string& dir, bool verify, const char* what);

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
  /// Whether decoding must check CRC-32s: verifying, with no manifest checksum to rely on.
  bool check_crc() const { return verify_ && !mf_; }
  /// "'key' in <file> at offset N", for messages.
  std::string where(const std::string& key, const dcp::StorageInfo& info) const;

 private:
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
