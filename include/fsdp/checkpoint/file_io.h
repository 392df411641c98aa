// fsdp/checkpoint/file_io.h: the one door through which checkpoints touch the file system.
//
// Every open, write, read, fsync, rename and directory operation of fsdp::checkpoint goes through
// a FileIO, so that a test (or a user with an unusual file system) can replace any of them: inject
// ENOSPC on the third write, a short write, EIO on fsync, a failing rename, or kill the process
// half way through a save. The calls keep POSIX's contract: they return -1 and set errno on
// failure, and `write` may write fewer bytes than asked (the callers loop). The default
// implementation is the plain system calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace checkpoint {

class FileIO {
 public:
  virtual ~FileIO() = default;

  /// open(2) with O_CLOEXEC added.
  virtual int open(const std::string& path, int flags, int mode);
  /// write(2): may write fewer than `n` bytes.
  virtual int64_t write(int fd, const void* data, size_t n);
  /// pread(2): may read fewer than `n` bytes; 0 at the end of the file.
  virtual int64_t pread(int fd, void* data, size_t n, int64_t offset);
  virtual int fsync(int fd);
  virtual int close(int fd);
  /// The size of a regular file, or -1 (errno set) if `path` is missing or not a regular file.
  virtual int64_t file_size(const std::string& path);
  /// 1 if `path` is a directory, 0 if it does not exist or is something else, -1 on error.
  virtual int is_dir(const std::string& path);
  virtual int mkdir(const std::string& path, int mode);
  /// rename(2): replaces `to` if it is a file or an empty directory.
  virtual int rename(const std::string& from, const std::string& to);
  /// Atomically swaps two existing paths (Linux renameat2 RENAME_EXCHANGE); -1 with EINVAL or
  /// ENOSYS where the file system cannot, and the caller falls back to two renames.
  virtual int exchange(const std::string& a, const std::string& b);
  /// unlink(2) for files, rmdir(2) for (empty) directories.
  virtual int remove(const std::string& path);
  /// The names in a directory, without "." and "..".
  virtual int list_dir(const std::string& path, std::vector<std::string>& names);
};

/// The process-wide default: the system calls themselves.
FileIO& default_file_io();

}  // namespace checkpoint
}  // namespace fsdp
