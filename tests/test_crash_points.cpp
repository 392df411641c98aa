// A crash at every I/O point and an error at every I/O call (issue 39, item 3), for a save_step
// with keep_last, a save replacing a checkpoint, a first save into a new directory, an async
// save, and both exports; and a save onto a file system that is really full.
//
// Crash points: each operation runs once through crash::JournalIO on real ranks; the journal's
// every prefix is then replayed with each loss pattern POSIX allows for writes and names not yet
// made durable by fsync (none lost, all lost, each single one lost; crash_fs.h), and every
// distinct tree is checked as a restart would see it: `latest` names the old or the new
// checkpoint, that one verifies and loads exactly, after the save returned it is the new one,
// and the next save goes through over whatever was left.
//
// Error points: a counting run lists every FileIO call of every rank; then each call in turn
// fails (EIO; writes also ENOSPC and no progress) and the operation must fail on every rank with
// an error naming a path, leave the previous checkpoint or export in place, and let the next save
// succeed. The counts are printed.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>

#include "checkpoint/files.h"
#include "crash_fs.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "point_sampler.h"

namespace ckpt = fsdp::checkpoint;
namespace crash = fsdp::testing::crash;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using fsdp::testing::load_full_sharded;
using fsdp::testing::PointSampler;
using fsdp::testing::run_ranks;
using fsdp::testing::RunOptions;
using fsdp::testing::sharded_sample;
using fsdp::testing::TempDir;

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Stderr silenced for a scope: latest_checkpoint warns about every `latest` naming a lost step,
// which hundreds of crash states here do on purpose.
class QuietStderr {
 public:
  QuietStderr() {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 2);
    ::close(null);
  }
  ~QuietStderr() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
  }

 private:
  int saved_ = -1;
};

at::Tensor expected_sharded(double scale) {
  return at::arange(30, at::kFloat).reshape({6, 5}) * scale;
}

// "" if `dir` verifies and holds what the save with `scale` wrote; else why not.
std::string holds(const std::string& dir, double scale) {
  try {
    const ckpt::VerifyReport report = ckpt::verify(dir);
    if (!report.ok()) return dir + " does not verify: " + report.problems.front();
    if (!at::equal(load_full_sharded(dir), expected_sharded(scale)))
      return dir + " loads other values";
    return "";
  } catch (const std::exception& e) {
    return dir + ": " + e.what();
  }
}

// One checkpoint a restart may find: its directory and the scale it was saved with.
struct Saved {
  std::string dir;
  double scale;
};

// What a restart must see in a step root: `latest` names one of `allowed` (the previous latest or
// the new one, the last of them), which verifies and loads exactly; once the save returned (or
// `must_be_new`), the new one. Nothing found is allowed only where nothing was saved before.
void expect_latest(const std::string& root, const std::vector<Saved>& allowed, bool must_be_new,
                   const std::string& what) {
  std::optional<std::string> latest;
  {
    QuietStderr quiet;
    latest = ckpt::latest_checkpoint(root);
  }
  if (!latest) {
    EXPECT_TRUE(allowed.size() == 1 && !must_be_new) << what << ": no checkpoint found";
    return;
  }
  std::string problem = "latest is " + *latest + ", none of the allowed";
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (must_be_new && i + 1 < allowed.size()) continue;
    if (*latest != allowed[i].dir) continue;
    problem = holds(*latest, allowed[i].scale);
    if (problem.empty()) break;
  }
  EXPECT_EQ(problem, "") << what;
  // Nor is anything half-written or half-removed listed as a step (a step being dropped by
  // keep_last may still be there, whole).
  for (const int64_t step : ckpt::list_steps(root)) {
    const ckpt::VerifyReport report = ckpt::verify(ckpt::step_dir(root, step));
    EXPECT_TRUE(report.ok()) << what << ": step " << step
                             << " is listed but does not verify: " << report.problems.front();
  }
}

// The next save (collective) goes through over whatever was left, and becomes `latest`.
void expect_next_save(ProcessGroup& pg, const std::string& root, const std::string& what) {
  const int64_t next = 100;
  pg.barrier();  // every rank has looked at what was there before it changes
  {
    QuietStderr quiet;
    ckpt::save_step(sharded_sample(pg.rank(), pg.size(), 7.0), root, next,
                    ckpt::SaveOptions().keep_last(2));
    ckpt::files::wait_for_background_removal();
  }
  EXPECT_EQ(ckpt::latest_checkpoint(root).value_or("(none)"), ckpt::step_dir(root, next)) << what;
  EXPECT_EQ(holds(ckpt::step_dir(root, next), 7.0), "") << what;
}

// ---- the operations under test ----

// An operation on `world` ranks under test: `before` builds the starting state in `top` (on the
// same ranks, default FileIO), `act` is the operation through `io`, `check` judges a restart's
// view of `top` (`ok`: the operation returned; false after a crash or a failure) on every rank.
struct Operation {
  const char* name;
  int world;
  std::function<void(ProcessGroup&, const std::string& top)> before;
  std::function<void(ProcessGroup&, const std::string& top, ckpt::FileIO& io)> act;
  std::function<void(ProcessGroup&, const std::string& top, bool ok, const std::string& what)>
      check;
};

std::string root_of(const std::string& top) { return top + "/ckpt"; }

void save_steps(ProcessGroup& pg, const std::string& top, const std::vector<int64_t>& steps,
                int keep_last = 0) {
  for (int64_t s : steps)
    ckpt::save_step(sharded_sample(pg.rank(), pg.size(), static_cast<double>(s)), root_of(top), s,
                    ckpt::SaveOptions().keep_last(keep_last));
  ckpt::files::wait_for_background_removal();
}

// A check of a step root: `latest` among the given (step, scale)s, the last once returned; then
// the next save.
// (Names relative to the root: "step_1", or where latest_checkpoint may point after a save without
// an atomic swap died half way, ".step_1.aside".)
std::function<void(ProcessGroup&, const std::string&, bool, const std::string&)> step_check(
    std::vector<std::pair<std::string, double>> allowed) {
  return [allowed](ProcessGroup& pg, const std::string& top, bool ok, const std::string& what) {
    std::vector<Saved> saved;
    for (const auto& [name, scale] : allowed) saved.push_back({root_of(top) + "/" + name, scale});
    expect_latest(root_of(top), saved, ok, what);
    expect_next_save(pg, root_of(top), what);
  };
}

// A .pt export over an earlier one: the file holds the old export or, once returned, the new one.
void expect_pt(const std::string& file, double old_scale, double new_scale, bool ok,
               const std::string& what) {
  std::string problem;
  try {
    const at::Tensor t = ckpt::load_pt(file).at("sharded").tensor();
    const bool is_new = at::equal(t, expected_sharded(new_scale));
    const bool is_old = at::equal(t, expected_sharded(old_scale));
    if (!(is_new || (is_old && !ok)))
      problem = "holds " + std::string(is_old ? "the old" : "other") + " values";
  } catch (const std::exception& e) {
    problem = e.what();
  }
  EXPECT_EQ(problem, "") << what;
}

// A safetensors export into a new directory: loading it fails (nothing complete is there) or
// gives every tensor exactly; once returned, it loads.
void expect_safetensors(const std::string& dir, const StateDict& reference, bool ok,
                        const std::string& what) {
  StateDict got;
  try {
    got = ckpt::load_safetensors(dir);
  } catch (const std::exception& e) {
    EXPECT_FALSE(ok) << what << ": " << e.what();
    return;
  }
  std::string problem;
  if (got.size() != reference.size()) problem = "holds " + std::to_string(got.size()) + " tensors";
  for (const auto& [key, value] : reference)
    if (!got.contains(key) || !at::equal(got.at(key).tensor(), value.tensor()))
      problem += " " + key + " differs";
  EXPECT_EQ(problem, "") << what;
}

// What the safetensors export of step 2 holds, exported once by a plain export.
const StateDict& safetensors_reference(const std::string& top) {
  static StateDict reference;
  if (reference.size() == 0) {
    TempDir out;
    ckpt::export_safetensors(ckpt::step_dir(root_of(top), 2), out.file("st"));
    reference = ckpt::load_safetensors(out.file("st"));
  }
  return reference;
}

// A FileIO forwarding every call to `to`; with `no_exchange`, a file system without
// RENAME_EXCHANGE (NFS, older kernels), whose swap says EINVAL, so that a save replaces a
// checkpoint by two renames.
struct ForwardingIO : ckpt::FileIO {
  ckpt::FileIO* to = nullptr;
  bool no_exchange = false;
  int open(const std::string& p, int f, int m) override { return to->open(p, f, m); }
  int64_t write(int fd, const void* d, size_t n) override { return to->write(fd, d, n); }
  int64_t pread(int fd, void* d, size_t n, int64_t o) override { return to->pread(fd, d, n, o); }
  int fsync(int fd) override { return to->fsync(fd); }
  int close(int fd) override { return to->close(fd); }
  int64_t file_size(const std::string& p) override { return to->file_size(p); }
  int is_dir(const std::string& p) override { return to->is_dir(p); }
  int mkdir(const std::string& p, int m) override { return to->mkdir(p, m); }
  int rename(const std::string& a, const std::string& b) override { return to->rename(a, b); }
  int exchange(const std::string& a, const std::string& b) override {
    if (!no_exchange) return to->exchange(a, b);
    errno = EINVAL;
    return -1;
  }
  int remove(const std::string& p) override { return to->remove(p); }
  int list_dir(const std::string& p, std::vector<std::string>& n) override {
    return to->list_dir(p, n);
  }
};

std::vector<Operation> operations() {
  std::vector<Operation> ops;
  ops.push_back({"save_step with keep_last", 2,
                 [](ProcessGroup& pg, const std::string& top) {
                   save_steps(pg, top, {1, 2}, 2);
                 },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 3.0), root_of(top), 3,
                                   ckpt::SaveOptions().keep_last(2).io(&io));
                 },
                 step_check({{"step_2", 2.0}, {"step_3", 3.0}})});
  ops.push_back({"save replacing a checkpoint", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&io));
                 },
                 step_check({{"step_1", 1.0}, {"step_1", 2.0}})});
  ops.push_back({"save replacing a checkpoint without RENAME_EXCHANGE", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ForwardingIO no_exchange;
                   no_exchange.to = &io;
                   no_exchange.no_exchange = true;
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&no_exchange));
                 },
                 step_check({{"step_1", 1.0}, {".step_1.aside", 1.0}, {"step_1", 2.0}})});
  ops.push_back({"first save into a new directory", 2, [](ProcessGroup&, const std::string&) {},
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 1.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&io));
                 },
                 step_check({{"step_1", 1.0}})});
  ops.push_back({"async save_step", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   // One saver per rank process for every point (making its group is a collective
                   // of its own), never destroyed: ranks leave by _exit.
                   static ForwardingIO forward;
                   static auto* saver =
                       new ckpt::AsyncSaver(ckpt::SaveOptions().keep_last(1).io(&forward));
                   forward.to = &io;
                   saver->save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 2);
                   saver->wait();
                 },
                 step_check({{"step_1", 1.0}, {"step_2", 2.0}})});
  ops.push_back({"export_pt over an earlier export", 1,
                 [](ProcessGroup& pg, const std::string& top) {
                   save_steps(pg, top, {1, 2});
                   ckpt::export_pt(ckpt::step_dir(root_of(top), 1), top + "/out/model.pt");
                 },
                 [](ProcessGroup&, const std::string& top, ckpt::FileIO& io) {
                   ckpt::export_pt(ckpt::step_dir(root_of(top), 2), top + "/out/model.pt",
                                   ckpt::ExportOptions().io(&io));
                 },
                 [](ProcessGroup&, const std::string& top, bool ok, const std::string& what) {
                   expect_pt(top + "/out/model.pt", 1.0, 2.0, ok, what);
                 }});
  // Three safetensors files and an index, into a directory that does not exist yet.
  ops.push_back({"export_safetensors in shards", 1,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {2}); },
                 [](ProcessGroup&, const std::string& top, ckpt::FileIO& io) {
                   ckpt::export_safetensors(ckpt::step_dir(root_of(top), 2), top + "/hf/out",
                                            ckpt::ExportOptions().max_shard_bytes(64).io(&io));
                 },
                 [](ProcessGroup&, const std::string& top, bool ok, const std::string& what) {
                   expect_safetensors(top + "/hf/out", safetensors_reference(top), ok, what);
                 }});
  return ops;
}

const Operation& operation(const std::string& name) {
  static const std::vector<Operation> all = operations();
  for (const Operation& op : all)
    if (name == op.name) return op;
  throw std::runtime_error("no operation " + name);
}

// ---- crash points ----

// Where the enumerations keep their thousands of small trees: in memory (/dev/shm) where there is
// one, as the durability they model is the journal's, not the scratch disk's (three times
// faster here: fsync on a tmpfs costs nothing).
std::string scratch_base() {
  if (::access("/dev/shm", W_OK | X_OK) == 0) return "/dev/shm";
  const char* base = std::getenv("TMPDIR");
  return base && *base ? base : "/tmp";
}

// The first `n` space-separated words of `s` from `at`.
std::string first_words(const std::string& s, size_t at, int n) {
  size_t end = at;
  for (int i = 0; i < n && end != std::string::npos; ++i) end = s.find(' ', end + (i ? 1 : 0));
  return s.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

// The code path a crash state exercises, for PointSampler: the last operation to land and, for a
// single lost change, the lost one (their rank and kind, not their paths or sizes), the loss
// pattern, and whether the operation had returned. `what` is CrashEnumerator's
// "crash after P of N operations (the last: rank R KIND ...), LOSS".
std::string crash_label(const std::string& what, bool after_return) {
  std::string label = after_return ? "returned|" : "|";
  const size_t last = what.find("(the last: ");
  if (last != std::string::npos) label += first_words(what, last + 11, 3);
  const size_t loss = what.rfind(", ");
  if (loss != std::string::npos) {
    const bool single = what.compare(loss + 2, 5, "lost:") == 0;
    label += "|" + first_words(what, loss + 2, single ? 4 : 1);
  }
  return label;
}

// Runs `op` once under the journal and checks the restart after every crash point and loss
// pattern (or a sample: point_sampler.h); prints the counts.
void crash_everywhere(const Operation& op) {
  TempDir tmp(scratch_base());
  const std::string top = tmp.file("top");
  ASSERT_EQ(::mkdir(top.c_str(), 0755), 0);
  run_ranks(op.world, [&](ProcessGroup& pg) { op.before(pg, top); });
  crash::CrashEnumerator model(top);
  const std::string journal = tmp.file("journal");
  run_ranks(op.world, [&](ProcessGroup& pg) {
    crash::JournalIO io(journal, pg.rank());
    op.act(pg, top, io);
  });
  model.set_journal(crash::read_journal(journal));
  RunOptions opts;
  opts.deadline = std::chrono::minutes(10);
  run_ranks(
      1,
      [&](ProcessGroup& pg) {
        PointSampler sampler;
        const crash::CrashCounts c = model.for_each_state(
            tmp.file("restart"), [&](const std::string& what, bool after_return) {
              if (sampler.take(crash_label(what, after_return)))
                op.check(pg, tmp.file("restart"), after_return, what);
            });
        std::printf(
            "%s: %zu operations, %zu crash points, %zu crash states, %zu distinct checked%s\n",
            op.name, c.operations, c.points, c.states, c.checked, sampler.note().c_str());
        EXPECT_GT(c.operations, 5u);
        EXPECT_GT(c.checked, 2u);
      },
      opts);
}

TEST(CrashPoints, SaveStepWithKeepLast) { crash_everywhere(operation("save_step with keep_last")); }
TEST(CrashPoints, SaveReplacingACheckpoint) {
  crash_everywhere(operation("save replacing a checkpoint"));
}
TEST(CrashPoints, SaveReplacingACheckpointWithoutExchange) {
  crash_everywhere(operation("save replacing a checkpoint without RENAME_EXCHANGE"));
}
TEST(CrashPoints, FirstSaveIntoANewDirectory) {
  crash_everywhere(operation("first save into a new directory"));
}
TEST(CrashPoints, AsyncSaveStep) { crash_everywhere(operation("async save_step")); }
TEST(CrashPoints, ExportPt) { crash_everywhere(operation("export_pt over an earlier export")); }
TEST(CrashPoints, ExportSafetensorsInShards) {
  crash_everywhere(operation("export_safetensors in shards"));
}

// ---- error points ----

// Fails its `fail_at`-th call (counting every call on this rank, reads too; 0: none) with `err`,
// or for a write with no progress (0 bytes written); lists the calls it saw.
struct FailingIO : ckpt::FileIO {
  int64_t fail_at = 0;
  int err = EIO;
  bool no_progress = false;
  int64_t calls = 0;
  std::vector<std::string> seen;  // "write", "open", ... in call order
  std::map<int, std::string> fd_path;
  std::string failed;  // the failed call and its path

  bool fail(const char* call, const std::string& path) {
    seen.push_back(call);
    if (++calls != fail_at) return false;
    failed = std::string(call) + " " + path;
    errno = err;
    return true;
  }
  int open(const std::string& path, int flags, int mode) override {
    if (fail("open", path)) return -1;
    const int fd = FileIO::open(path, flags, mode);
    if (fd >= 0) fd_path[fd] = path;
    return fd;
  }
  int64_t write(int fd, const void* data, size_t n) override {
    if (fail("write", fd_path[fd])) return no_progress ? 0 : -1;
    return FileIO::write(fd, data, n);
  }
  int64_t pread(int fd, void* data, size_t n, int64_t offset) override {
    return fail("pread", fd_path[fd]) ? -1 : FileIO::pread(fd, data, n, offset);
  }
  int fsync(int fd) override { return fail("fsync", fd_path[fd]) ? -1 : FileIO::fsync(fd); }
  int close(int fd) override {
    const std::string path = fd_path[fd];
    fd_path.erase(fd);
    if (fail("close", path)) {
      FileIO::close(fd);  // close(2) releases the descriptor even when it reports an error
      errno = err;
      return -1;
    }
    return FileIO::close(fd);
  }
  int64_t file_size(const std::string& path) override {
    return fail("file_size", path) ? -1 : FileIO::file_size(path);
  }
  int is_dir(const std::string& path) override {
    return fail("is_dir", path) ? -1 : FileIO::is_dir(path);
  }
  int mkdir(const std::string& path, int mode) override {
    return fail("mkdir", path) ? -1 : FileIO::mkdir(path, mode);
  }
  int rename(const std::string& a, const std::string& b) override {
    return fail("rename", a) ? -1 : FileIO::rename(a, b);
  }
  int exchange(const std::string& a, const std::string& b) override {
    return fail("exchange", a) ? -1 : FileIO::exchange(a, b);
  }
  int remove(const std::string& path) override {
    return fail("remove", path) ? -1 : FileIO::remove(path);
  }
  int list_dir(const std::string& path, std::vector<std::string>& names) override {
    return fail("list_dir", path) ? -1 : FileIO::list_dir(path, names);
  }
};

struct Injection {
  int err;
  bool no_progress;
  const char* name;
};

// The errors tried at a call: EIO at every one; ENOSPC and a write that makes no progress too at
// writes.
std::vector<Injection> injections_for(const std::string& call) {
  std::vector<Injection> out = {{EIO, false, "EIO"}};
  if (call == "write") {
    out.push_back({ENOSPC, false, "ENOSPC"});
    out.push_back({0, true, "no progress"});
  }
  return out;
}

// Fails each FileIO call of each rank of `op` in turn; every rank must fail together with an
// error naming a path under `top` (or all succeed, where the failed call was one the operation
// may do without), and the restart's view must pass `op.check`. Prints the counts.
void fail_everywhere(const Operation& op) {
  TempDir tmp(scratch_base());
  RunOptions opts;
  opts.deadline = std::chrono::minutes(10);
  opts.collective_timeout = std::chrono::seconds(20);
  run_ranks(
      op.world,
      [&](ProcessGroup& pg) {
        int64_t points = 0, failed_ops = 0, succeeded = 0;
        int64_t index = 0;
        // The starting state, built once; each point starts from a copy of it.
        const std::string start = tmp.file("start");
        if (pg.rank() == 0) ::mkdir(start.c_str(), 0755);
        pg.barrier();
        op.before(pg, start);
        auto top_for = [&](int64_t i) {
          const std::string top = tmp.file("p" + std::to_string(i));
          if (pg.rank() == 0)
            std::filesystem::copy(start, top, std::filesystem::copy_options::recursive);
          pg.barrier();
          return top;
        };
        // The calls of a run without failures, on each rank.
        std::vector<std::vector<std::string>> calls(static_cast<size_t>(pg.size()));
        {
          const std::string top = top_for(index++);
          FailingIO io;
          op.act(pg, top, io);
          for (int r = 0; r < pg.size(); ++r) {
            std::string mine;
            for (const auto& c : io.seen) mine += c + "\n";
            std::string all = pg.broadcast_bytes(mine, r);
            for (size_t at = 0; at < all.size();) {
              const size_t nl = all.find('\n', at);
              calls[r].push_back(all.substr(at, nl - at));
              at = nl + 1;
            }
          }
        }
        PointSampler sampler;
        for (int target = 0; target < pg.size(); ++target) {
          for (size_t n = 0; n < calls[target].size(); ++n) {
            for (const Injection& inj : injections_for(calls[target][n])) {
              if (!sampler.take(std::to_string(target) + "|" + calls[target][n] + "|" + inj.name))
                continue;
              const std::string top = top_for(index++);
              FailingIO io;
              if (pg.rank() == target) {
                io.fail_at = static_cast<int64_t>(n) + 1;
                io.err = inj.err;
                io.no_progress = inj.no_progress;
              }
              std::string error;
              try {
                QuietStderr quiet;  // the warnings of failed clean-ups
                op.act(pg, top, io);
              } catch (const std::exception& e) {
                error = e.what();
                if (error.empty()) error = "(empty message)";
              }
              const std::string what = std::string(op.name) + ": " + inj.name + " at call " +
                                       std::to_string(n + 1) + " (" + calls[target][n] +
                                       ") of rank " + std::to_string(target);
              // Every rank fails, or every rank succeeds.
              const std::vector<std::string> outcomes =
                  pg.all_gather_bytes(error.empty() ? "ok" : "failed");
              for (const auto& o : outcomes) EXPECT_EQ(o, outcomes[0]) << what << ": " << error;
              // Data written, made durable, read, or a directory made: never optional. (A failed
              // stat, listing or clean-up may be survived, and then the check below must pass.)
              const std::string& call = calls[target][n];
              if (call == "write" || call == "fsync" || call == "open" || call == "pread" ||
                  call == "mkdir" || call == "exchange") {
                EXPECT_FALSE(error.empty()) << what << ": succeeded anyway";
              }
              if (!error.empty()) {
                EXPECT_TRUE(contains(error, top)) << what << ": the error names no path: " << error;
                ++failed_ops;
              } else {
                ++succeeded;
                if (std::getenv("FSDP_ERROR_POINTS_VERBOSE") && pg.rank() == 0)
                  std::printf("  succeeded despite: %s\n", what.c_str());
              }
              ++points;
              op.check(pg, top, error.empty(), what);
              pg.barrier();
            }
          }
        }
        if (pg.rank() == 0) {
          size_t total = 0;
          for (const auto& c : calls) total += c.size();
          std::printf(
              "%s: %zu FileIO calls on %d rank(s), %lld error points: %lld failed on every "
              "rank, %lld succeeded without the call%s\n",
              op.name, total, pg.size(), static_cast<long long>(points),
              static_cast<long long>(failed_ops), static_cast<long long>(succeeded),
              sampler.note().c_str());
        }
      },
      opts);
}

TEST(ErrorPoints, SaveStepWithKeepLast) { fail_everywhere(operation("save_step with keep_last")); }
TEST(ErrorPoints, SaveReplacingACheckpoint) {
  fail_everywhere(operation("save replacing a checkpoint"));
}
TEST(ErrorPoints, SaveReplacingACheckpointWithoutExchange) {
  fail_everywhere(operation("save replacing a checkpoint without RENAME_EXCHANGE"));
}
TEST(ErrorPoints, FirstSaveIntoANewDirectory) {
  fail_everywhere(operation("first save into a new directory"));
}
TEST(ErrorPoints, AsyncSaveStep) { fail_everywhere(operation("async save_step")); }
TEST(ErrorPoints, ExportPt) { fail_everywhere(operation("export_pt over an earlier export")); }
TEST(ErrorPoints, ExportSafetensorsInShards) {
  fail_everywhere(operation("export_safetensors in shards"));
}

// ---- a file system that is really full ----

// A save onto a tmpfs too small for it (mounted in a mount namespace of a child of this test, so
// no one else sees it): the save fails on every rank with ENOSPC naming the file, the previous
// checkpoint stays `latest` and loads, the failed save's files are gone (the space is free again),
// and once a step is dropped by hand the next save fits. Skipped where mounting is not allowed.
TEST(FullDisk, SaveOntoAFullFileSystem) {
  TempDir tmp;
  const std::string mnt = tmp.file("small");
  ASSERT_EQ(::mkdir(mnt.c_str(), 0755), 0);
  // About 300 KB a checkpoint, in 512 KiB: one fits, two do not.
  auto state = [](int rank, int world, double scale) {
    StateDict sd = sharded_sample(rank, world, scale);
    sd.insert_or_assign("big", at::full({75000}, scale));
    return sd;
  };
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=512k") != 0) {
      std::printf("cannot mount a tmpfs here (%s): skipped\n", std::strerror(errno));
      std::fflush(stdout);
      ::_exit(77);
    }
    const std::string root = mnt + "/ckpt";
    auto used = [&] {
      struct statvfs v {};
      ::statvfs(mnt.c_str(), &v);
      return static_cast<int64_t>((v.f_blocks - v.f_bfree) * v.f_frsize);
    };
    run_ranks(2, [&](ProcessGroup& pg) {
      ckpt::save_step(state(pg.rank(), 2, 1.0), root, 1);
      pg.barrier();
      const int64_t before = used();
      std::string error = "(no error)";
      int code = 0;
      try {
        ckpt::save_step(state(pg.rank(), 2, 2.0), root, 2);
      } catch (const fsdp::IOError& e) {
        error = e.what();
        code = e.error_code();
      }
      if (pg.rank() == 0) std::printf("the save onto a full tmpfs: %s\n", error.c_str());
      EXPECT_EQ(code, ENOSPC) << "rank " << pg.rank() << ": " << error;
      EXPECT_TRUE(contains(error, "No space left on device")) << error;
      EXPECT_TRUE(contains(error, root + "/.step_2.partial/")) << "names no file: " << error;
      pg.barrier();
      if (pg.rank() == 0) {
        EXPECT_EQ(ckpt::latest_checkpoint(root).value_or("(none)"), ckpt::step_dir(root, 1));
        EXPECT_EQ(holds(ckpt::step_dir(root, 1), 1.0), "");
        EXPECT_FALSE(exists(root + "/.step_2.partial"));
        EXPECT_LE(used(), before) << "the failed save left files behind";
        ckpt::files::remove_tree(ckpt::default_file_io(), ckpt::step_dir(root, 1), "test");
      }
      pg.barrier();
      ckpt::save_step(state(pg.rank(), 2, 3.0), root, 3);
      if (pg.rank() == 0) {
        EXPECT_EQ(holds(ckpt::step_dir(root, 3), 3.0), "");
      }
    });
    ::_exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no tmpfs mount allowed here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the full-disk run failed (its messages are above)";
}

}  // namespace
