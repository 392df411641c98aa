// The default FileIO (the system calls) and the checkpoint layer's file helpers (files.h).
#include "checkpoint/storage/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include <c10/util/Exception.h>

#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {

int FileIO::open(const std::string& path, int flags, int mode) {
  return ::open(path.c_str(), flags | O_CLOEXEC, mode);
}
int64_t FileIO::write(int fd, const void* data, size_t n) { return ::write(fd, data, n); }
int64_t FileIO::pread(int fd, void* data, size_t n, int64_t offset) {
  return ::pread(fd, data, n, static_cast<off_t>(offset));
}
int FileIO::fsync(int fd) { return ::fsync(fd); }
int FileIO::close(int fd) { return ::close(fd); }
int64_t FileIO::file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  if (!S_ISREG(st.st_mode)) {
    errno = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
    return -1;
  }
  return static_cast<int64_t>(st.st_size);
}
int FileIO::is_dir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
  return S_ISDIR(st.st_mode) ? 1 : 0;
}
int FileIO::mkdir(const std::string& path, int mode) {
  return ::mkdir(path.c_str(), static_cast<mode_t>(mode));
}
int FileIO::rename(const std::string& from, const std::string& to) {
  return ::rename(from.c_str(), to.c_str());
}
int FileIO::exchange(const std::string& a, const std::string& b) {
#if defined(SYS_renameat2)
  // RENAME_EXCHANGE (1 << 1); through syscall() because older glibc lacks the wrapper.
  return static_cast<int>(::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), 2u));
#else
  (void)a;
  (void)b;
  errno = ENOSYS;
  return -1;
#endif
}
int FileIO::remove(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return -1;
  return S_ISDIR(st.st_mode) ? ::rmdir(path.c_str()) : ::unlink(path.c_str());
}
int FileIO::list_dir(const std::string& path, std::vector<std::string>& names) {
  DIR* d = ::opendir(path.c_str());
  if (!d) return -1;
  names.clear();
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return 0;
}

FileIO& default_file_io() {
  static FileIO io;
  return io;
}

namespace files {

using detail::msg;

void io_error(const char* what, const std::string& op, const std::string& path, int err) {
  throw IOError(msg(what, ": ", op, " ", path, " failed: ", std::strerror(err)), err);
}

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir == "." ? name : dir + "/" + name;
}

std::string normalize(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p.empty() ? "." : p;
}

bool plain_file_name(const std::string& p) {
  return !(p.empty() || p == "." || p == ".." || p.find('/') != std::string::npos ||
           p.find('\\') != std::string::npos || p.find('\0') != std::string::npos);
}

std::string printable(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string parent_of(const std::string& path) {
  const std::string p = normalize(path);
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const std::string p = normalize(path);
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

OutFile::OutFile(FileIO& io, std::string path, const char* what)
    : io_(io), path_(std::move(path)), what_(what) {
  fd_ = io_.open(path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) io_error(what_, "creating", path_, errno);
}

OutFile::~OutFile() {
  if (fd_ >= 0) io_.close(fd_);
}

int64_t OutFile::append(const void* data, size_t n) {
  const int64_t at = size_;
  const char* p = static_cast<const char*>(data);
  size_t left = n;
  while (left > 0) {
    const int64_t w = io_.write(fd_, p, left);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_error(what_, "writing", path_, errno);
    }
    // write(2) returning 0 for a non-empty request means no progress is possible.
    if (w == 0) io_error(what_, "writing", path_, ENOSPC);
    p += w;
    left -= static_cast<size_t>(w);
    size_ += w;
  }
  return at;
}

void OutFile::finish() {
  if (io_.fsync(fd_) != 0) io_error(what_, "fsync of", path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (io_.close(fd) != 0) io_error(what_, "closing", path_, errno);
}

void write_file(FileIO& io, const std::string& path, const std::string& data, const char* what) {
  OutFile f(io, path, what);
  f.append(data);
  f.finish();
}

void check_range(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                 const char* what) {
  const int64_t size = io.file_size(path);
  if (size < 0) throw ValueError(msg(what, ": cannot open ", path, ": ", std::strerror(errno)));
  if (offset < 0 || length < 0 || offset > size || length > size - offset) {
    throw CorruptionError(msg(what, ": ", path, " has ", size,
                              " bytes; the bytes asked for lie at [", offset, ", ", offset, " + ",
                              length, ")"));
  }
}

void pread_all(FileIO& io, const std::string& path, int64_t offset, int64_t length, char* out,
               const char* what) {
  const int fd = io.open(path, O_RDONLY, 0);
  if (fd < 0) io_error(what, "opening", path, errno);
  int64_t done = 0;
  int err = 0;
  while (done < length) {
    const int64_t r = io.pread(fd, out + done, static_cast<size_t>(length - done), offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      err = r < 0 ? errno : 0;
      break;
    }
    done += r;
  }
  io.close(fd);
  if (err != 0) io_error(what, "reading", path, err);
  if (done < length)
    throw CorruptionError(msg(what, ": ", path, " ended at byte ", offset + done, ", before the ",
                              length, " bytes at ", offset));
}

namespace {

template <typename Buffer>
Buffer read_as(FileIO& io, const std::string& path, int64_t offset, int64_t length,
               const char* what) {
  check_range(io, path, offset, length, what);
  Buffer out(static_cast<size_t>(length), '\0');
  pread_all(io, path, offset, length, out.data(), what);
  return out;
}

}  // namespace

void read_into(FileIO& io, const std::string& path, int64_t offset, int64_t length, void* dst,
               const char* what) {
  check_range(io, path, offset, length, what);
  pread_all(io, path, offset, length, static_cast<char*>(dst), what);
}

std::string read_range(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                       const char* what) {
  return read_as<std::string>(io, path, offset, length, what);
}

std::vector<char> read_bytes(FileIO& io, const std::string& path, int64_t offset, int64_t length,
                             const char* what) {
  return read_as<std::vector<char>>(io, path, offset, length, what);
}

std::string read_file(FileIO& io, const std::string& path, int64_t limit, const char* what) {
  const int64_t size = io.file_size(path);
  if (size < 0) throw ValueError(msg(what, ": cannot open ", path, ": ", std::strerror(errno)));
  if (size > limit)
    throw ValueError(
        msg(what, ": ", path, " has ", size, " bytes, more than the ", limit, " accepted"));
  return read_range(io, path, 0, size, what);
}

void sync_dir(FileIO& io, const std::string& path, const char* what) {
  const int fd = io.open(path, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0) io_error(what, "opening directory", path, errno);
  const int rc = io.fsync(fd);
  const int err = errno;
  io.close(fd);
  // Some file systems refuse fsync on directories (EINVAL); their renames are durable anyway.
  if (rc != 0 && err != EINVAL) io_error(what, "fsync of directory", path, err);
}

void make_dirs(FileIO& io, const std::string& path, const char* what) {
  const std::string p = normalize(path);
  if (io.is_dir(p) == 1) return;
  const std::string parent = parent_of(p);
  if (parent != p) make_dirs(io, parent, what);
  if (io.mkdir(p, 0755) == 0) {
    // The new name reaches the disk with its parent's fsync: without it a checkpoint or export
    // saved into a new directory (and synced there) could vanish whole in a power cut after the
    // save returned (crash points, tests/faults/test_crash_points.cpp).
    sync_dir(io, parent, what);
  } else if (errno != EEXIST) {
    io_error(what, "creating directory", p, errno);
  }
  if (io.is_dir(p) != 1) io_error(what, "creating directory", p, ENOTDIR);
}

namespace {

void remove_tree(FileIO& io, const std::string& path, const char* what, int depth) {
  // Our directories are two levels deep; deeper is not ours to delete (ELOOP: a loop of links).
  if (depth > 8) throw IOError(msg(what, ": ", path, " is nested too deeply to remove"), ELOOP);
  if (io.is_dir(path) == 1) {
    std::vector<std::string> names;
    if (io.list_dir(path, names) != 0) io_error(what, "listing", path, errno);
    for (const auto& n : names) remove_tree(io, join(path, n), what, depth + 1);
  }
  if (io.remove(path) != 0 && errno != ENOENT) io_error(what, "removing", path, errno);
}

}  // namespace

void remove_tree(FileIO& io, const std::string& path, const char* what) {
  remove_tree(io, path, what, 0);
}

namespace {

// The background removal: joined before the next one starts and at exit (a static destroyed
// before default_file_io()'s, which was constructed first).
struct BackgroundRemoval {
  std::mutex mutex;
  std::thread thread;
  ~BackgroundRemoval() {
    if (thread.joinable()) thread.join();
  }
};
BackgroundRemoval& background_removal() {
  default_file_io();
  static BackgroundRemoval r;
  return r;
}

}  // namespace

void wait_for_background_removal() {
  BackgroundRemoval& r = background_removal();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.thread.joinable()) r.thread.join();
}

void remove_tree_in_background(FileIO& io, const std::vector<std::string>& paths,
                               const char* what) {
  auto remove_all = [paths, what](FileIO& with) {
    for (const std::string& p : paths) {
      try {
        remove_tree(with, p, what);
      } catch (const std::exception& e) {
        TORCH_WARN(what, ": could not remove ", p, ": ", e.what());
      }
    }
  };
  if (&io != &default_file_io()) {  // a caller's FileIO may not outlive the call
    remove_all(io);
    return;
  }
  BackgroundRemoval& r = background_removal();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.thread.joinable()) r.thread.join();
  r.thread = std::thread([remove_all] { remove_all(default_file_io()); });
}

}  // namespace files
}  // namespace checkpoint
}  // namespace fsdp
