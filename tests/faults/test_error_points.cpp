// An error at every I/O call (issue 39, item 3) of the operations of checkpoint_operations.h, and
// a save onto a file system that is really full.
//
// A counting run lists every FileIO call of every rank; then each call in turn
// fails (EIO; writes also ENOSPC and no progress) and the operation must fail on every rank with
// an error naming a path, leave the previous checkpoint or export in place, and let the next save
// succeed. The counts are printed.
#include <gtest/gtest.h>

#include <sched.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "checkpoint/storage/files.h"
#include "checkpoint_operations.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "point_sampler.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using fsdp::testing::contains;
using fsdp::testing::exists;
using fsdp::testing::holds;
using fsdp::testing::operation;
using fsdp::testing::Operation;
using fsdp::testing::PointSampler;
using fsdp::testing::QuietStderr;
using fsdp::testing::run_ranks;
using fsdp::testing::RunOptions;
using fsdp::testing::scratch_base;
using fsdp::testing::sharded_sample;
using fsdp::testing::TempDir;

namespace {

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
