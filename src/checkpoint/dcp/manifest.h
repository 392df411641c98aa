// Internal: `.fsdp_manifest.json`, fsdp-cpp's sidecar in a DCP checkpoint directory. Python's DCP
// ignores it; we use it to version the format, record who saved the checkpoint, and verify every
// byte (docs/checkpoint_format.md, "The manifest").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp {
namespace checkpoint {
namespace manifest {

inline constexpr const char* kFileName = ".fsdp_manifest.json";
/// Bumped when a reader of an older version could misread a newer checkpoint.
inline constexpr int kFormatVersion = 1;
/// Largest manifest accepted (about 150 bytes an item: a million items).
inline constexpr int64_t kMaxBytes = int64_t{256} << 20;

/// One stored item: its key, where its bytes are, and their checksum.
struct Item {
  std::string key;
  std::string file;
  int64_t offset = 0;
  int64_t length = 0;
  std::string xxh3;
};

struct Manifest {
  int format_version = kFormatVersion;
  std::string library_version;  // fsdp-cpp
  std::string torch_version;    // LibTorch it was built with
  int world_size = 1;
  int64_t created_unix = 0;
  std::map<std::string, std::string> annotations;  // SaveOptions::annotations
  std::map<std::string, int64_t> files;            // data file -> size
  /// A node-local save (SaveOptions::node_local): the data files of `files` that this directory
  /// holds; the others are in other hosts' directories. Empty: this directory holds them all.
  std::vector<std::string> local_files;
  std::string metadata_xxh3;  // of `.metadata`
  std::vector<Item> items;

  /// Whether this directory holds `file` (local_files empty, or listing it).
  bool holds(const std::string& file) const;
  /// The item stored at `offset` of `file`, or null.
  const Item* find(const std::string& file, int64_t offset) const;
};

std::string to_json(const Manifest& m);
/// Parses and validates a manifest (types, ranges, plain file names, no duplicate items, a format
/// version this build reads); ValueError naming `path` otherwise.
Manifest parse(const std::string& bytes, const std::string& path);

}  // namespace manifest
}  // namespace checkpoint
}  // namespace fsdp
