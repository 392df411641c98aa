// Internal: file helpers of the checkpoint layer on top of FileIO (fsdp/checkpoint/file_io.h):
// whole writes with fsync, bounded reads, directory syncs and trees, and the xxh3 checksums the
// manifest records. Every failure throws fsdp::Error (I/O) or ValueError (a file that is not what
// it should be) naming the path and the operation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/checkpoint/file_io.h"

namespace fsdp {
namespace checkpoint {
namespace files {

/// Throws IOError "<what>: <op> <path> failed: <strerror(err)>" carrying `err` (an errno, read
/// by the caller right after the failed call).
[[noreturn]] void io_error(const char* what, const std::string& op, const std::string& path,
                           int err);

std::string join(const std::string& dir, const std::string& name);
/// "a/b/c" -> "a/b"; "c" -> "."; trailing slashes ignored.
std::string parent_of(const std::string& path);
/// "a/b/c/" -> "c".
std::string base_of(const std::string& path);
/// `path` without trailing slashes (and "." for an empty one).
std::string normalize(const std::string& path);
/// Whether `name`, read from a file (a `.metadata`, a safetensors index), names a file beside
/// it: one non-empty component, not "." or "..", with no '/', '\\' or NUL that could point
/// elsewhere.
bool plain_file_name(const std::string& name);
/// `name`, read from a file, fit for an error message: control bytes as \xNN (a NUL would end
/// the message's what()).
std::string printable(const std::string& name);

/// A file being written: bytes appended in order, then fsynced and closed by `finish`. Closed
/// (without sync) by the destructor if `finish` was never reached.
class OutFile {
 public:
  OutFile(FileIO& io, std::string path, const char* what);
  ~OutFile();
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  /// Appends `n` bytes; returns the offset they were written at.
  int64_t append(const void* data, size_t n);
  int64_t append(const std::string& s) { return append(s.data(), s.size()); }
  int64_t size() const { return size_; }
  void finish();

 private:
  FileIO& io_;
  std::string path_;
  const char* what_;
  int fd_ = -1;
  int64_t size_ = 0;
};

/// Writes `data` as the whole of `path` and fsyncs it.
void write_file(FileIO& io, const std::string& path, const std::string& data, const char* what);
/// ValueError naming the file unless [offset, offset + length) lies inside it: what to check
/// before allocating a buffer for those bytes.
void check_range(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                 const char* what);
/// Reads exactly `length` bytes at `offset` into `out`, for a range check_range has passed (the
/// read_* functions below do both); a short file is a ValueError, a failed read an Error.
void pread_all(FileIO& io, const std::string& path, int64_t offset, int64_t length, char* out,
               const char* what);
/// Reads `length` bytes at `offset`; ValueError naming the file if they are not all there.
std::string read_range(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                       const char* what);
/// Reads the bytes straight into `dst` (which holds `length` bytes), with the same checks.
void read_into(FileIO& io, const std::string& path, int64_t offset, int64_t length, void* dst,
               const char* what);
/// The same into a vector (what LibTorch's archive readers take), saving a copy.
std::vector<char> read_bytes(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                             const char* what);
/// The whole file, refused (ValueError) above `limit` bytes before anything is allocated.
std::string read_file(FileIO& io, const std::string& path, int64_t limit, const char* what);
/// fsync of a directory, so that names created or renamed in it survive a power cut.
void sync_dir(FileIO& io, const std::string& path, const char* what);
/// mkdir -p, each directory it creates made durable (its parent fsynced).
void make_dirs(FileIO& io, const std::string& path, const char* what);
/// rm -r of a tree this library made (depth-limited); a missing path is no error.
void remove_tree(FileIO& io, const std::string& path, const char* what);

/// Removes `path` like remove_tree, on a background thread when `io` is default_file_io() (else
/// right away): a replaced checkpoint's files take tens of milliseconds to unlink, which no rank
/// should wait for. One removal at a time: a second call, wait_for_background_removal() and the
/// process's exit wait for the one before. A failure is reported as a warning.
void remove_tree_in_background(FileIO& io, const std::vector<std::string>& paths, const char* what);
void wait_for_background_removal();

/// Which build of XXH3 hashes: the fastest the CPU runs (AVX2 on x86-64 CPUs that have it), or
/// one in particular (the tests compare them). All compute the same function.
enum class Xxh3Build { BEST, PORTABLE, AVX2 };
/// Whether the AVX2 build is compiled in and the CPU runs it.
bool xxh3_avx2_available();

/// XXH3-64 of the bytes, as 16 lower-case hex digits (xxh3.cpp).
std::string xxh3_hex(const void* data, size_t n, Xxh3Build build = Xxh3Build::BEST);
inline std::string xxh3_hex(const std::string& s) { return xxh3_hex(s.data(), s.size()); }

/// XXH3-64 of bytes fed in pieces (the same digest as xxh3_hex of them all at once).
class Xxh3Stream {
 public:
  explicit Xxh3Stream(Xxh3Build build = Xxh3Build::BEST);
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void update(const void* data, size_t n);
  std::string hex() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  bool avx2_ = false;
};

}  // namespace files
}  // namespace checkpoint
}  // namespace fsdp
