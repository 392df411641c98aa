// The journal and the crash model of crash_fs.h.
#include "crash_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>

#include "checkpoint/storage/files.h"

namespace fsdp {
namespace testing {
namespace crash {

namespace files = checkpoint::files;

namespace {

const char* kind_name(OpKind k) {
  switch (k) {
    case OpKind::CREATE:
      return "create";
    case OpKind::TRUNCATE:
      return "truncate";
    case OpKind::WRITE:
      return "write";
    case OpKind::FSYNC:
      return "fsync";
    case OpKind::MKDIR:
      return "mkdir";
    case OpKind::RENAME:
      return "rename";
    case OpKind::EXCHANGE:
      return "exchange";
    case OpKind::REMOVE:
      return "remove";
  }
  return "?";
}

uint64_t inode_of(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    throw std::runtime_error("crash journal: cannot stat " + path + ": " + std::strerror(errno));
  return st.st_ino;
}

// Records: a u32 length, then the fields in order (integers little-endian as in memory, strings
// as a u32 length and bytes).
template <typename T>
void put(std::string& b, T v) {
  b.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void put_str(std::string& b, const std::string& s) {
  put(b, static_cast<uint32_t>(s.size()));
  b += s;
}
struct Reader {
  const std::string& b;
  size_t at = 0;
  void need(size_t n) const {
    if (n > b.size() - at) throw std::runtime_error("crash journal: truncated record");
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v{};
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  uint64_t u64() { return get<uint64_t>(); }
  std::string str() {
    const uint32_t n = get<uint32_t>();
    need(n);
    std::string s = b.substr(at, n);
    at += n;
    return s;
  }
};

}  // namespace

std::string describe(const Op& op) {
  std::string s = "rank " + std::to_string(op.rank) + " " + kind_name(op.kind);
  if (op.kind == OpKind::WRITE)
    s += " " + std::to_string(op.data.size()) + " bytes at " + std::to_string(op.offset) + " of";
  return s + " " + op.path;
}

// ---- the journal ----

// The journal lock, held across one operation and its record; errno survives the unlock.
class JournalIO::Locked {
 public:
  explicit Locked(JournalIO& io) : io_(io), lock_(io.mutex_) {
    while (::flock(io_.journal_fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~Locked() {
    const int err = errno;
    ::flock(io_.journal_fd_, LOCK_UN);
    errno = err;
  }

 private:
  JournalIO& io_;
  std::lock_guard<std::mutex> lock_;
};

JournalIO::JournalIO(const std::string& journal_path, int rank) : rank_(rank) {
  journal_fd_ = ::open(journal_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (journal_fd_ < 0)
    throw std::runtime_error("crash journal: cannot open " + journal_path + ": " +
                             std::strerror(errno));
}

JournalIO::~JournalIO() { ::close(journal_fd_); }

void JournalIO::append(Op op) {
  const int err = errno;
  std::string b;
  b.push_back(static_cast<char>(op.kind));
  put<uint64_t>(b, static_cast<uint64_t>(rank_));
  put<uint64_t>(b, op.ino);
  put<uint64_t>(b, op.ino2);
  put<uint64_t>(b, op.dir1);
  put<uint64_t>(b, op.dir2);
  put<uint64_t>(b, static_cast<uint64_t>(op.offset));
  put_str(b, op.name1);
  put_str(b, op.name2);
  put_str(b, op.data);
  put_str(b, op.path);
  std::string rec;
  put_str(rec, b);
  // One write(2) per record under the lock; the journal is a regular file, which takes it whole.
  if (::write(journal_fd_, rec.data(), rec.size()) != static_cast<ssize_t>(rec.size()))
    throw std::runtime_error("crash journal: short write");
  errno = err;
}

int JournalIO::open(const std::string& path, int flags, int mode) {
  Locked lock(*this);
  struct stat st {};
  const bool existed = ::lstat(path.c_str(), &st) == 0;
  const int fd = FileIO::open(path, flags, mode);
  if (fd < 0) return fd;
  ::fstat(fd, &st);
  fd_file_[fd] = {st.st_ino, path};
  if ((flags & O_CREAT) && !existed) {
    Op op;
    op.kind = OpKind::CREATE;
    op.ino = st.st_ino;
    op.dir1 = inode_of(files::parent_of(path));
    op.name1 = files::base_of(path);
    op.path = path;
    append(std::move(op));
  } else if ((flags & O_TRUNC) && (flags & O_ACCMODE) != O_RDONLY) {
    Op op;
    op.kind = OpKind::TRUNCATE;
    op.ino = st.st_ino;
    op.path = path;
    append(std::move(op));
  }
  return fd;
}

int64_t JournalIO::write(int fd, const void* data, size_t n) {
  Locked lock(*this);
  const off_t at = ::lseek(fd, 0, SEEK_CUR);
  const int64_t w = FileIO::write(fd, data, n);
  if (w > 0) {
    Op op;
    op.kind = OpKind::WRITE;
    op.ino = fd_file_.at(fd).first;
    op.offset = at;
    op.data.assign(static_cast<const char*>(data), static_cast<size_t>(w));
    op.path = fd_file_.at(fd).second;
    append(std::move(op));
  }
  return w;
}

int JournalIO::fsync(int fd) {
  Locked lock(*this);
  const int rc = FileIO::fsync(fd);
  if (rc == 0) {
    Op op;
    op.kind = OpKind::FSYNC;
    op.ino = fd_file_.at(fd).first;
    op.path = fd_file_.at(fd).second;
    append(std::move(op));
  }
  return rc;
}

int JournalIO::close(int fd) {
  Locked lock(*this);
  fd_file_.erase(fd);
  return FileIO::close(fd);
}

int JournalIO::mkdir(const std::string& path, int mode) {
  Locked lock(*this);
  const int rc = FileIO::mkdir(path, mode);
  if (rc == 0) {
    Op op;
    op.kind = OpKind::MKDIR;
    op.ino = inode_of(path);
    op.dir1 = inode_of(files::parent_of(path));
    op.name1 = files::base_of(path);
    op.path = path;
    append(std::move(op));
  }
  return rc;
}

// A rename or a swap: what each name named, read before the call (a rename moves one inode; a
// swap two).
int JournalIO::move(OpKind kind, const std::string& a, const std::string& b) {
  Locked lock(*this);
  const bool swap = kind == OpKind::EXCHANGE;
  struct stat sa {};
  struct stat sb {};
  const bool found = ::lstat(a.c_str(), &sa) == 0 && (!swap || ::lstat(b.c_str(), &sb) == 0);
  const int rc = swap ? FileIO::exchange(a, b) : FileIO::rename(a, b);
  if (rc == 0 && found) {
    Op op;
    op.kind = kind;
    op.ino = sa.st_ino;
    op.ino2 = swap ? sb.st_ino : 0;
    op.dir1 = inode_of(files::parent_of(a));
    op.dir2 = inode_of(files::parent_of(b));
    op.name1 = files::base_of(a);
    op.name2 = files::base_of(b);
    op.path = a + (swap ? " <-> " : " -> ") + b;
    append(std::move(op));
  }
  return rc;
}

int JournalIO::rename(const std::string& from, const std::string& to) {
  return move(OpKind::RENAME, from, to);
}

int JournalIO::exchange(const std::string& a, const std::string& b) {
  return move(OpKind::EXCHANGE, a, b);
}

int JournalIO::remove(const std::string& path) {
  Locked lock(*this);
  const int rc = FileIO::remove(path);
  if (rc == 0) {
    Op op;
    op.kind = OpKind::REMOVE;
    op.dir1 = inode_of(files::parent_of(path));
    op.name1 = files::base_of(path);
    op.path = path;
    append(std::move(op));
  }
  return rc;
}

std::vector<Op> read_journal(const std::string& journal_path) {
  std::ifstream f(journal_path, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<Op> ops;
  Reader outer{all};
  while (outer.at < all.size()) {
    const std::string b = outer.str();
    Reader r{b};
    r.need(1);
    Op op;
    op.kind = static_cast<OpKind>(b[r.at++]);
    op.rank = static_cast<int>(r.u64());
    op.ino = r.u64();
    op.ino2 = r.u64();
    op.dir1 = r.u64();
    op.dir2 = r.u64();
    op.offset = static_cast<int64_t>(r.u64());
    op.name1 = r.str();
    op.name2 = r.str();
    op.data = r.str();
    op.path = r.str();
    ops.push_back(std::move(op));
  }
  return ops;
}

// ---- the model ----

CrashEnumerator::CrashEnumerator(const std::string& top) : top_(top) {
  // The tree as it is now, all of it durable.
  std::function<int(const std::string&)> take = [&](const std::string& path) -> int {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0)
      throw std::runtime_error("crash model: cannot stat " + path);
    const int id = static_cast<int>(initial_.size());
    initial_.emplace_back();
    initial_inodes_[st.st_ino] = id;
    if (S_ISDIR(st.st_mode)) {
      initial_[id].dir = true;
      std::vector<std::string> names;
      checkpoint::default_file_io().list_dir(path, names);
      for (const auto& n : names) {
        const int child = take(path + "/" + n);
        initial_[id].entries[n] = child;
      }
    } else if (S_ISREG(st.st_mode)) {
      std::ifstream f(path, std::ios::binary);
      initial_[id].data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    } else {
      throw std::runtime_error("crash model: " + path + " is neither a file nor a directory");
    }
    return id;
  };
  top_node_ = take(top_);
  node_count_ = initial_.size();
}

void CrashEnumerator::set_journal(std::vector<Op> ops) {
  std::map<uint64_t, int> inodes = initial_inodes_;
  int next = static_cast<int>(initial_.size());
  auto node = [&](uint64_t ino, const Op& op) {
    const auto it = inodes.find(ino);
    if (it == inodes.end())
      throw std::runtime_error("crash model: " + describe(op) + " touches an inode outside " +
                               top_);
    return it->second;
  };
  steps_.clear();
  for (Op& op : ops) {
    Step s;
    switch (op.kind) {
      case OpKind::CREATE:
      case OpKind::MKDIR:
        s.dir1 = node(op.dir1, op);
        s.node = next++;
        inodes[op.ino] = s.node;  // a new file (an inode number may be reused after an unlink)
        break;
      case OpKind::TRUNCATE:
      case OpKind::WRITE:
      case OpKind::FSYNC:
        s.node = node(op.ino, op);
        break;
      case OpKind::RENAME:
        s.node = node(op.ino, op);
        s.dir1 = node(op.dir1, op);
        s.dir2 = node(op.dir2, op);
        break;
      case OpKind::EXCHANGE:
        s.node = node(op.ino, op);
        s.node2 = node(op.ino2, op);
        s.dir1 = node(op.dir1, op);
        s.dir2 = node(op.dir2, op);
        break;
      case OpKind::REMOVE:
        s.dir1 = node(op.dir1, op);
        break;
    }
    s.op = std::move(op);
    steps_.push_back(std::move(s));
  }
  node_count_ = static_cast<size_t>(next);
  // What each inode is does not depend on which changes survive: a directory made by a lost
  // mkdir is still a directory (only unnamed).
  fresh_.assign(node_count_ - initial_.size(), Node());
  for (const Step& s : steps_)
    if (s.op.kind == OpKind::MKDIR) fresh_[s.node - initial_.size()].dir = true;
  // When each change becomes durable: a file's bytes at the next fsync of that file; a name at
  // the next fsync of its directory (of both, for a rename or swap between two directories).
  auto next_sync = [&](size_t after, int n) {
    for (size_t j = after + 1; j < steps_.size(); ++j)
      if (steps_[j].op.kind == OpKind::FSYNC && steps_[j].node == n) return j;
    return SIZE_MAX;
  };
  for (size_t i = 0; i < steps_.size(); ++i) {
    Step& s = steps_[i];
    switch (s.op.kind) {
      case OpKind::TRUNCATE:
      case OpKind::WRITE:
        s.durable_after = next_sync(i, s.node);
        break;
      case OpKind::CREATE:
      case OpKind::MKDIR:
      case OpKind::REMOVE:
        s.durable_after = next_sync(i, s.dir1);
        break;
      case OpKind::RENAME:
      case OpKind::EXCHANGE:
        s.durable_after = std::max(next_sync(i, s.dir1), next_sync(i, s.dir2));
        break;
      case OpKind::FSYNC:
        s.durable_after = i;  // nothing to lose
        break;
    }
  }
}

std::vector<size_t> CrashEnumerator::pending(size_t point) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < point; ++i)
    if (steps_[i].op.kind != OpKind::FSYNC && steps_[i].durable_after >= point) out.push_back(i);
  return out;
}

std::vector<CrashEnumerator::Node> CrashEnumerator::replay(size_t point,
                                                           const std::vector<bool>& lost) const {
  std::vector<Node> nodes = initial_;
  nodes.insert(nodes.end(), fresh_.begin(), fresh_.end());
  for (size_t i = 0; i < point; ++i) {
    if (lost[i]) continue;
    const Step& s = steps_[i];
    const Op& op = s.op;
    switch (op.kind) {
      case OpKind::CREATE:
        nodes[s.dir1].entries[op.name1] = s.node;
        break;
      case OpKind::MKDIR:
        nodes[s.dir1].entries[op.name1] = s.node;
        break;
      case OpKind::TRUNCATE:
        nodes[s.node].data.clear();
        break;
      case OpKind::WRITE: {
        std::string& d = nodes[s.node].data;
        const size_t end = static_cast<size_t>(op.offset) + op.data.size();
        if (d.size() < end) d.resize(end, '\0');  // a hole where a lost write was
        d.replace(static_cast<size_t>(op.offset), op.data.size(), op.data);
        break;
      }
      case OpKind::FSYNC:
        break;
      // A rename or swap writes both directories' entries in one go (a journalled file system
      // makes it atomic), naming the inodes it moved, whether or not the changes that created
      // those names survived.
      case OpKind::RENAME: {
        auto& from = nodes[s.dir1].entries;
        const auto it = from.find(op.name1);
        if (it != from.end() && it->second == s.node) from.erase(it);
        nodes[s.dir2].entries[op.name2] = s.node;
        break;
      }
      case OpKind::EXCHANGE:
        nodes[s.dir1].entries[op.name1] = s.node2;
        nodes[s.dir2].entries[op.name2] = s.node;
        break;
      case OpKind::REMOVE:
        nodes[s.dir1].entries.erase(op.name1);
        break;
    }
  }
  return nodes;
}

namespace {

void remove_all(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    checkpoint::default_file_io().list_dir(path, names);
    for (const auto& n : names) remove_all(path + "/" + n);
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

}  // namespace

CrashCounts CrashEnumerator::for_each_state(
    const std::string& out,
    const std::function<void(const std::string& what, bool after_return)>& check) const {
  CrashCounts counts;
  counts.operations = steps_.size();
  counts.points = steps_.size() + 1;
  std::set<std::string> seen;
  // The tree under `n`, serialised: the key that tells distinct states apart.
  std::function<void(const std::vector<Node>&, int, std::string&)> key =
      [&](const std::vector<Node>& nodes, int n, std::string& k) {
        const Node& node = nodes[n];
        if (!node.dir) {
          k += "F" + std::to_string(node.data.size()) + ":" + node.data;
          return;
        }
        k += "D{";
        for (const auto& [name, child] : node.entries) {
          k += name + "=";
          key(nodes, child, k);
          k += ";";
        }
        k += "}";
      };
  std::function<void(const std::vector<Node>&, int, const std::string&)> write =
      [&](const std::vector<Node>& nodes, int n, const std::string& path) {
        const Node& node = nodes[n];
        if (node.dir) {
          ::mkdir(path.c_str(), 0755);
          for (const auto& [name, child] : node.entries) write(nodes, child, path + "/" + name);
        } else {
          std::ofstream(path, std::ios::binary) << node.data;
        }
      };
  for (size_t point = 0; point <= steps_.size(); ++point) {
    const std::vector<size_t> pend = pending(point);
    // Loss patterns: none, all, and each single pending change.
    std::vector<std::pair<std::string, std::vector<size_t>>> patterns = {{"none lost", {}}};
    if (!pend.empty()) patterns.push_back({"all " + std::to_string(pend.size()) + " lost", pend});
    if (pend.size() > 1)
      for (size_t i : pend) patterns.push_back({"lost: " + describe(steps_[i].op), {i}});
    if (host_of_) {
      std::map<int, std::vector<size_t>> by_host;
      for (size_t i : pend) by_host[host_of_(steps_[i].op.rank)].push_back(i);
      // (A host's single change or all of them are above already.)
      if (by_host.size() > 1)
        for (const auto& [host, lose] : by_host)
          if (lose.size() > 1)
            patterns.push_back(
                {"host " + std::to_string(host) + "'s " + std::to_string(lose.size()) + " lost",
                 lose});
    }
    for (const auto& [label, lose] : patterns) {
      ++counts.states;
      std::vector<bool> lost(steps_.size(), false);
      for (size_t i : lose) lost[i] = true;
      const std::vector<Node> nodes = replay(point, lost);
      // The last point is judged more strictly (the operation returned): its trees are checked
      // even where an earlier point had them.
      std::string k = point == steps_.size() ? "returned:" : "";
      key(nodes, top_node_, k);
      if (!seen.insert(files::xxh3_hex(k)).second) continue;
      ++counts.checked;
      remove_all(out);
      write(nodes, top_node_, out);
      std::string what = "crash after " + std::to_string(point) + " of " +
                         std::to_string(steps_.size()) + " operations";
      if (point > 0) what += " (the last: " + describe(steps_[point - 1].op) + ")";
      check(what + ", " + label, point == steps_.size());
    }
  }
  remove_all(out);
  return counts;
}

}  // namespace crash
}  // namespace testing
}  // namespace fsdp
