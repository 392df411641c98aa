// The fuzz targets' file system: whole files held in memory, behind the FileIO every reader and
// writer of fsdp::checkpoint takes, so a run touches no disk and a campaign reaches thousands of
// executions a second.
//
// Read-only by default: a write then fails with EROFS, so a reader that tried to write would be a
// finding of its own (its error says so). Writable (for the targets that assemble, convert or
// export what they read), it keeps POSIX's contract where the writers rely on it: O_CREAT creates,
// O_TRUNC empties, write appends at the descriptor's offset, rename replaces a file or an empty
// directory, a directory is removed only when empty. What is written is bounded (kMaxBytes,
// ENOSPC past it) so that a hostile input cannot make a writer fill the memory.
#pragma once

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fsdp/checkpoint/file_io.h"

namespace fsdp {
namespace fuzz {

class MemFS : public checkpoint::FileIO {
 public:
  static constexpr size_t kMaxBytes = size_t{64} << 20;

  explicit MemFS(bool writable = false) : writable_(writable) {}

  /// Puts a file (and its parent directories) in place, read-only or not.
  void add(const std::string& path, std::string bytes) {
    files_[path] = std::make_shared<std::string>(std::move(bytes));
    add_parents(path);
  }
  /// The file at `path`, or null.
  const std::string* find(const std::string& path) const {
    auto it = files_.find(path);
    return it == files_.end() ? nullptr : it->second.get();
  }

  int open(const std::string& path, int flags, int) override {
    const bool writing = (flags & O_ACCMODE) != O_RDONLY || (flags & (O_CREAT | O_TRUNC));
    if (writing && !writable_) return fail(EROFS);
    if (flags & O_DIRECTORY) {  // to fsync a directory, as a save does after each rename
      if (writing) return fail(EISDIR);
      if (!dirs_.count(path)) return fail(files_.count(path) ? ENOTDIR : ENOENT);
      open_.push_back(Open{std::make_shared<std::string>(), 0, false, true});
      return static_cast<int>(open_.size()) + 2;
    }
    auto it = files_.find(path);
    if (it == files_.end()) {
      if (dirs_.count(path)) return fail(EISDIR);
      if (!(flags & O_CREAT)) return fail(ENOENT);
      if (!dirs_.count(parent(path))) return fail(ENOENT);
      it = files_.emplace(path, std::make_shared<std::string>()).first;
    } else if ((flags & O_CREAT) && (flags & O_EXCL)) {
      return fail(EEXIST);
    }
    if (flags & O_TRUNC) it->second->clear();
    open_.push_back(Open{it->second, 0, writing, false});
    return static_cast<int>(open_.size()) + 2;  // past stdin/stdout/stderr, never negative
  }
  int64_t write(int fd, const void* data, size_t n) override {
    Open* f = file(fd);
    if (!f || !f->writing) return fail(EBADF);
    if (written_ + n > kMaxBytes) return fail(ENOSPC);
    std::string& s = *f->bytes;
    if (s.size() < f->offset + n) s.resize(f->offset + n);
    std::memcpy(&s[f->offset], data, n);
    f->offset += n;
    written_ += n;
    return static_cast<int64_t>(n);
  }
  int64_t pread(int fd, void* data, size_t n, int64_t offset) override {
    Open* f = file(fd);
    if (f && f->dir) return fail(EISDIR);
    if (!f || offset < 0) return fail(EINVAL);
    const std::string& s = *f->bytes;
    if (static_cast<uint64_t>(offset) >= s.size()) return 0;
    const size_t k = std::min(n, s.size() - static_cast<size_t>(offset));
    std::memcpy(data, s.data() + offset, k);
    return static_cast<int64_t>(k);
  }
  int fsync(int fd) override { return file(fd) ? 0 : fail(EBADF); }
  int close(int fd) override {
    if (!file(fd)) return fail(EBADF);
    open_[static_cast<size_t>(fd - 3)].bytes.reset();
    return 0;
  }
  int64_t file_size(const std::string& path) override {
    auto it = files_.find(path);
    return it == files_.end() ? fail(ENOENT) : static_cast<int64_t>(it->second->size());
  }
  int is_dir(const std::string& path) override { return dirs_.count(path) ? 1 : 0; }
  int mkdir(const std::string& path, int) override {
    if (!writable_) return fail(EROFS);
    if (dirs_.count(path) || files_.count(path)) return fail(EEXIST);
    if (!dirs_.count(parent(path))) return fail(ENOENT);
    dirs_.insert(path);
    return 0;
  }
  int rename(const std::string& from, const std::string& to) override {
    if (!writable_) return fail(EROFS);
    if (from == to) return 0;
    if (files_.count(from)) {
      if (dirs_.count(to)) return fail(EISDIR);
      if (!dirs_.count(parent(to))) return fail(ENOENT);
      files_[to] = files_[from];
      files_.erase(from);
      return 0;
    }
    if (!dirs_.count(from)) return fail(ENOENT);
    if (files_.count(to)) return fail(ENOTDIR);
    if (dirs_.count(to) && !empty_dir(to)) return fail(ENOTEMPTY);
    if (!dirs_.count(parent(to)) || under(to, from)) return fail(EINVAL);
    move_tree(from, to);
    return 0;
  }
  int exchange(const std::string& a, const std::string& b) override {
    if (!writable_) return fail(EROFS);
    if (!dirs_.count(a) || !dirs_.count(b) || under(a, b) || under(b, a)) return fail(EINVAL);
    const std::string aside = a + "\x01swap";
    move_tree(a, aside);
    move_tree(b, a);
    move_tree(aside, b);
    return 0;
  }
  int remove(const std::string& path) override {
    if (!writable_) return fail(EROFS);
    if (files_.erase(path)) return 0;
    if (!dirs_.count(path)) return fail(ENOENT);
    if (!empty_dir(path)) return fail(ENOTEMPTY);
    dirs_.erase(path);
    return 0;
  }
  int list_dir(const std::string& path, std::vector<std::string>& names) override {
    if (!dirs_.count(path)) return fail(ENOENT);
    names.clear();
    const std::string prefix = path + "/";
    std::set<std::string> seen;
    const auto collect = [&](const auto& paths_in_order) {
      for (auto it = paths_in_order.lower_bound(prefix); it != paths_in_order.end(); ++it) {
        const std::string& p = key_of(*it);
        if (p.compare(0, prefix.size(), prefix) != 0) break;
        const std::string rest = p.substr(prefix.size());
        seen.insert(rest.substr(0, rest.find('/')));
      }
    };
    collect(files_);
    collect(dirs_);
    names.assign(seen.begin(), seen.end());
    return 0;
  }

 private:
  struct Open {
    std::shared_ptr<std::string> bytes;  // null once closed
    size_t offset;
    bool writing;
    bool dir;
  };

  static int fail(int err) {
    errno = err;
    return -1;
  }
  static std::string parent(const std::string& path) {
    const size_t slash = path.rfind('/');
    return slash == std::string::npos || slash == 0 ? "/" : path.substr(0, slash);
  }
  static bool under(const std::string& path, const std::string& dir) {
    return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
           path[dir.size()] == '/';
  }
  void add_parents(const std::string& path) {
    for (std::string d = parent(path);; d = parent(d)) {
      dirs_.insert(d);
      if (d == "/") break;
    }
  }
  bool empty_dir(const std::string& dir) {
    std::vector<std::string> names;
    return list_dir(dir, names) == 0 && names.empty();
  }
  // Renames the directory `from` and everything under it to `to` (which may exist, empty).
  void move_tree(const std::string& from, const std::string& to) {
    std::map<std::string, std::shared_ptr<std::string>> files;
    for (auto& [p, f] : files_) files[under(p, from) ? to + p.substr(from.size()) : p] = f;
    std::set<std::string> dirs;
    for (const auto& d : dirs_)
      dirs.insert(d == from || under(d, from) ? to + d.substr(from.size()) : d);
    files_.swap(files);
    dirs_.swap(dirs);
  }
  static const std::string& key_of(const std::string& dir) { return dir; }
  template <typename V>
  static const std::string& key_of(const std::pair<const std::string, V>& file) {
    return file.first;
  }
  Open* file(int fd) {
    const size_t i = static_cast<size_t>(fd - 3);
    return fd >= 3 && i < open_.size() && open_[i].bytes ? &open_[i] : nullptr;
  }

  bool writable_;
  size_t written_ = 0;
  std::map<std::string, std::shared_ptr<std::string>> files_;
  std::set<std::string> dirs_ = {"/"};
  std::vector<Open> open_;
};

}  // namespace fuzz
}  // namespace fsdp
