// Collective loads (LoadOptions::group, issue 40 item 5): each stored byte is read once across
// the job, whether HYBRID_SHARD's replicas need the same pieces or the data files lie on
// node-local disks, each holding some of them. Bytes are counted through a FileIO; values are
// compared with the saving model's full state; the group-less load is the negative control
// (every replica reads its pieces again).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

#include <functional>
#include <optional>
#include <vector>

#include "checkpoint/load/read_once.h"
#include "dcp_model_testing.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "python_ref.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using namespace fsdp::testing;

namespace {

// Counts the bytes read through it.
class CountingIO : public ckpt::FileIO {
 public:
  int64_t pread(int fd, void* data, size_t n, int64_t offset) override {
    const int64_t got = FileIO::pread(fd, data, n, offset);
    if (got > 0) bytes += got;
    return got;
  }
  int64_t bytes = 0;
};

// The sum over the group of each rank's `n`.
int64_t job_total(ProcessGroup& pg, int64_t n) {
  at::Tensor t = at::full({1}, n, at::kLong);
  pg.all_reduce(t);
  return t.item<int64_t>();
}

// The bytes of every file in `dir`: the checkpoint's size.
int64_t dir_bytes(const std::string& dir) {
  int64_t total = 0;
  std::vector<std::string> names;
  EXPECT_EQ(ckpt::default_file_io().list_dir(dir, names), 0) << dir;
  for (const auto& n : names) total += ckpt::default_file_io().file_size(dir + "/" + n);
  return total;
}

// A W=4 FULL_SHARD or HYBRID_SHARD (2 x 2) TinyLM after two Adam steps, saved to `dir`, its full
// state to `ref`.
void save_trained(const std::string& dir, const std::string& ref, bool hybrid) {
  run_ranks(4, [&](ProcessGroup& pg) {
    TinyLM m(7);
    auto o =
        hybrid ? lm_options(m, ShardingStrategy::HYBRID_SHARD).hybrid_shard_size(2) : lm_options(m);
    FullyShardedDataParallel model(m, o);
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    StateDict sd = train_two_steps(model, *opt, pg.rank());
    ckpt::save(sd, dir);
    save_reference_state(model, *opt, ref, pg.rank());
  });
}

TEST(ReadOnceLoad, HybridShardReplicasReadEachStoredByteOnce) {
  TempDir tmp, ref;
  save_trained(tmp.file("c"), ref.path(), true);
  const int64_t size = dir_bytes(tmp.file("c"));
  run_ranks(4, [&](ProcessGroup& pg) {
    TinyLM m(99);
    FullyShardedDataParallel model(
        m, lm_options(m, ShardingStrategy::HYBRID_SHARD).hybrid_shard_size(2));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    CountingIO once;
    load_checkpoint(model, *opt, tmp.file("c"), ckpt::LoadOptions().io(&once).group(&pg));
    expect_reference_state(model, *opt, ref.path(), "collective load");
    const int64_t read_once = job_total(pg, once.bytes);
    // The negative control: each rank on its own reads what it needs, so both replicas of each
    // shard group read the same pieces, and every rank reads `.metadata` and the manifest.
    CountingIO local;
    load_checkpoint(model, *opt, tmp.file("c"), ckpt::LoadOptions().io(&local));
    expect_reference_state(model, *opt, ref.path(), "local load");
    const int64_t read_local = job_total(pg, local.bytes);
    EXPECT_LE(read_once, size) << "the collective load read some bytes twice";
    EXPECT_GT(read_local, size * 3 / 2) << "the replicas' reads were not counted";
    if (pg.rank() == 0)
      std::printf(
          "[ figures  ] HYBRID_SHARD 2x2 load of a %lld-byte checkpoint: %.3fx its size "
          "read across the job (local loads: %.3fx)\n",
          static_cast<long long>(size), static_cast<double>(read_once) / size,
          static_cast<double>(read_local) / size);
  });
}

// What each host's node-local disk holds of a W=4 save made as 2 hosts x 2 ranks: `.metadata`,
// the manifest and its own ranks' data files; host 2 is new, its disk empty.
std::vector<std::string> node_local_copies(const TempDir& tmp) {
  const std::string saved = tmp.file("c");
  std::vector<std::string> dirs;
  for (int host = 0; host < 3; ++host) {
    const std::string root = tmp.file("host" + std::to_string(host));
    EXPECT_EQ(::mkdir(root.c_str(), 0755), 0) << root;
    dirs.push_back(root + "/c");
    if (host == 2) continue;
    EXPECT_EQ(::mkdir(dirs.back().c_str(), 0755), 0);
    for (const char* name : {".metadata", ".fsdp_manifest.json"})
      write_bytes(dirs.back() + "/" + name, read_bytes(saved + "/" + name));
    for (int r = 2 * host; r < 2 * host + 2; ++r) {
      const std::string file = "/__" + std::to_string(r) + "_0.distcp";
      write_bytes(dirs.back() + file, read_bytes(saved + file));
    }
  }
  return dirs;
}

// Loads the node-local copies at `hosts` (each rank's host), with rounds of `round_bytes`.
void load_node_local(const std::vector<std::string>& dirs, const std::vector<int>& hosts,
                     const std::string& ref, int64_t size, int64_t round_bytes) {
  const int world = static_cast<int>(hosts.size());
  run_ranks(world, [&](ProcessGroup& pg) {
    TinyLM m(99);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    auto [msd, osd] = ckpt::get_state_dict(model, *opt);
    StateDict sd;
    sd.insert_or_assign("model", msd);
    sd.insert_or_assign("optim", osd);
    CountingIO io;
    const std::string& dir = dirs[static_cast<size_t>(hosts[static_cast<size_t>(pg.rank())])];
    ckpt::read_once::load(sd, dir, io, true, pg, round_bytes);
    ckpt::set_state_dict(model, *opt, sd.at("model").dict(), sd.at("optim").dict());
    const std::string what = "W=" + std::to_string(world) + " from node-local disks";
    expect_reference_state(model, *opt, ref, what);
    EXPECT_LE(job_total(pg, io.bytes), size) << what << ": some bytes were read twice";
  });
}

// The acceptance topologies: saved as 2 hosts x 2 ranks, loaded at 2 x 1, 2 x 3 and 3 x 1 (the
// third host's disk empty), every piece found on the disk that holds it and read once. The small
// rounds make the pieces travel in many exchanges.
TEST(ReadOnceLoad, NodeLocalDisksLoadAtOtherTopologies) {
  TempDir tmp, ref;
  save_trained(tmp.file("c"), ref.path(), false);
  const int64_t size = dir_bytes(tmp.file("c"));
  const std::vector<std::string> dirs = node_local_copies(tmp);
  load_node_local(dirs, {0, 1}, ref.path(), size, ckpt::read_once::kRoundBytes);
  load_node_local(dirs, {0, 0, 0, 1, 1, 1}, ref.path(), size, 1024);
  load_node_local(dirs, {0, 1, 2}, ref.path(), size, 4096);
}

// A data file on no rank's disk is named on every rank before anything is read; a corrupt item
// fails every rank, naming the rank that read it and the file.
TEST(ReadOnceLoad, MissingAndCorruptFilesFailEveryRank) {
  TempDir tmp, ref;
  save_trained(tmp.file("c"), ref.path(), false);
  const std::vector<std::string> dirs = node_local_copies(tmp);
  // Each rank's error (its text, and whether it is a CorruptionError) goes to `check`.
  auto load_at = [&](const std::vector<std::string>& where,
                     const std::function<void(int, const std::string&)>& check) {
    run_ranks(static_cast<int>(where.size()), [&](ProcessGroup& pg) {
      TinyLM m(99);
      FullyShardedDataParallel model(m, lm_options(m));
      auto opt = make_optimizer("Adam", unique_params(model->parameters()));
      const std::string e = error_of([&] {
        load_checkpoint(model, *opt, where[static_cast<size_t>(pg.rank())],
                        ckpt::LoadOptions().group(&pg));
      });
      check(pg.rank(), e);
    });
  };
  // Host 1's copy of __3_0.distcp lost: nobody can read it.
  ASSERT_EQ(::unlink((dirs[1] + "/__3_0.distcp").c_str()), 0);
  load_at({dirs[0], dirs[1]}, [](int rank, const std::string& e) {
    EXPECT_NE(e.find("no rank can read '__3_0.distcp'"), std::string::npos) << rank << ": " << e;
  });
  // Host 0's __1_0.distcp damaged in its middle: rank 0 reads it (it needs it, at W=2), fails its
  // checksum, and rank 1 fails too, naming rank 0.
  write_bytes(dirs[1] + "/__3_0.distcp", read_bytes(tmp.file("c") + "/__3_0.distcp"));
  std::string bytes = read_bytes(dirs[0] + "/__1_0.distcp");
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);
  write_bytes(dirs[0] + "/__1_0.distcp", bytes);
  load_at({dirs[0], dirs[1]}, [](int rank, const std::string& e) {
    EXPECT_NE(e.find("__1_0.distcp"), std::string::npos) << rank << ": " << e;
    EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << rank << ": " << e;
    if (rank == 1) {
      EXPECT_NE(e.find("rank 0: "), std::string::npos) << e;
    }
  });
  // The same checkpoint, intact, loads (the failures above were the files').
  write_bytes(dirs[0] + "/__1_0.distcp", read_bytes(tmp.file("c") + "/__1_0.distcp"));
  load_node_local(dirs, {0, 1}, ref.path(), dir_bytes(tmp.file("c")), 4096);
}

}  // namespace

namespace {

// Fails with ENOSPC to open `.metadata` for writing when `armed` (a host's leader committing).
class FullDiskIO : public ckpt::FileIO {
 public:
  int open(const std::string& path, int flags, int mode) override {
    if (armed && (flags & O_CREAT) && path.size() > 10 &&
        path.compare(path.size() - 10, 10, "/.metadata") == 0) {
      errno = ENOSPC;
      return -1;
    }
    return FileIO::open(path, flags, mode);
  }
  bool armed = false;
};

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  ckpt::default_file_io().list_dir(dir, names);
  std::sort(names.begin(), names.end());
  return names;
}

// Four ranks on two emulated hosts, each host's ranks sharing a directory no other host sees: the
// save finds the hosts by itself, each host's directory is committed with its own ranks' files
// and the whole `.metadata`, verify checks what is there and names the rest, and the collective
// load reads it back at 2 x 1 and at 3 x 1 with an empty third disk. On one shared directory the
// same option saves a plain checkpoint.
TEST(NodeLocalSave, EachHostCommitsItsOwnFilesAndTheJobLoadsAnywhere) {
  TempDir tmp, ref;
  const std::vector<std::string> roots = {tmp.file("host0"), tmp.file("host1"), tmp.file("host2")};
  std::vector<std::string> dirs;
  for (const auto& r : roots) dirs.push_back(r + "/c");
  run_ranks(4, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    StateDict sd = train_two_steps(model, *opt, pg.rank());
    ckpt::save(sd, dirs[static_cast<size_t>(pg.rank() / 2)],
               ckpt::SaveOptions().group(&pg).node_local(true));
    ckpt::save(sd, tmp.file("shared"), ckpt::SaveOptions().group(&pg).node_local(true));
    save_reference_state(model, *opt, ref.path(), pg.rank());
  });
  using Names = std::vector<std::string>;
  EXPECT_EQ(names_in(roots[0]), Names{"c"}) << "a probe or partial directory was left";
  EXPECT_EQ(names_in(dirs[0]),
            (Names{".fsdp_manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"}));
  EXPECT_EQ(names_in(dirs[1]),
            (Names{".fsdp_manifest.json", ".metadata", "__2_0.distcp", "__3_0.distcp"}));
  const ckpt::VerifyReport host0 = ckpt::verify(dirs[0]);
  EXPECT_TRUE(host0.ok()) << host0.problems.front();
  EXPECT_EQ(host0.elsewhere, (Names{"__2_0.distcp", "__3_0.distcp"}));
  const ckpt::VerifyReport shared = ckpt::verify(tmp.file("shared"));
  EXPECT_TRUE(shared.ok() && shared.elsewhere.empty());
  EXPECT_EQ(read_bytes(dirs[0] + "/.metadata"), read_bytes(tmp.file("shared") + "/.metadata"));
  // Its size: one host's `.metadata` and manifest, and every data file.
  const int64_t size = dir_bytes(dirs[0]) +
                       ckpt::default_file_io().file_size(dirs[1] + "/__2_0.distcp") +
                       ckpt::default_file_io().file_size(dirs[1] + "/__3_0.distcp");
  load_node_local(dirs, {0, 1}, ref.path(), size, ckpt::read_once::kRoundBytes);
  load_node_local(dirs, {0, 1, 2}, ref.path(), size, ckpt::read_once::kRoundBytes);
  // Assembled into one ordinary directory: without host 1's directory a file is missing (named,
  // nothing left behind); with both, it verifies whole and loads at W=3 on its own.
  const std::string whole = tmp.file("whole");
  EXPECT_NE(
      error_of([&] { ckpt::assemble({dirs[0]}, whole); }).find("no directory holds '__2_0.distcp'"),
      std::string::npos);
  EXPECT_EQ(ckpt::default_file_io().is_dir(whole), 0);
  EXPECT_EQ(ckpt::default_file_io().is_dir(tmp.file(".whole.partial")), 0);
  ckpt::assemble({dirs[1], dirs[0]}, whole);
  const ckpt::VerifyReport all = ckpt::verify(whole);
  EXPECT_TRUE(all.ok() && all.elsewhere.empty());
  EXPECT_EQ(read_bytes(whole + "/__2_0.distcp"), read_bytes(dirs[1] + "/__2_0.distcp"));
  run_ranks(3, [&](ProcessGroup&) {
    TinyLM m(98);
    FullyShardedDataParallel model(m, lm_options(m, ShardingStrategy::SHARD_GRAD_OP, true));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    load_checkpoint(model, *opt, whole);
    expect_reference_state(model, *opt, ref.path(), "assembled, W=3");
  });
  // Stock PyTorch's dcp.load reads the assembled directory (the trixie chroot's Python).
  if (!python().empty()) {
    StateDict full;
    full.insert_or_assign("model", load_pieces(1, ref.path(), "m_"));
    full.insert_or_assign("optim", load_osd(1, ref.path()));
    EXPECT_EQ(run_command(dcp_python() + "values " + whole), values_text(flat_of(full)));
  }
}

// A host that cannot complete its directory fails the save on every rank and no host commits;
// save_step's keep_last runs only once every host holds the new step; agreed_latest_checkpoint
// passes over a step that only some hosts committed.
TEST(NodeLocalSave, NoHostCommitsAloneAndResumesAgree) {
  TempDir tmp;
  const std::vector<std::string> roots = {tmp.file("host0"), tmp.file("host1")};
  run_ranks(4, [&](ProcessGroup& pg) {
    const std::string& root = roots[static_cast<size_t>(pg.rank() / 2)];
    StateDict sd = sharded_sample(pg.rank(), 4, 1.0);
    const auto o = ckpt::SaveOptions().group(&pg).node_local(true).keep_last(2);
    for (int64_t step : {1, 2}) ckpt::save_step(sd, root, step, o);
    // Host 1's leader (rank 2) finds its disk full while committing step 3.
    FullDiskIO io;
    io.armed = pg.rank() == 2;
    const std::string e =
        error_of([&] { ckpt::save_step(sd, root, 3, ckpt::SaveOptions(o).io(&io)); });
    EXPECT_NE(e.find("nothing was committed"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
    EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{1, 2})) << "a host committed alone";
    ckpt::save_step(sd, root, 3, o);
    EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg), root + "/step_3");
    pg.barrier();
    // Host 1's `latest` pointer left at step 2 (its save_step died before moving it): the hosts
    // disagree, and the newest step both hold is step 3.
    if (pg.rank() == 2) write_bytes(root + "/latest", "step_2\n");
    pg.barrier();
    EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg), root + "/step_3");
    pg.barrier();
    // Host 1 without step 3 (a crash between the hosts' swaps, or its disk restored from an older
    // copy): step 2, the newest step every host holds.
    if (pg.rank() == 2) std::filesystem::remove_all(root + "/step_3");
    pg.barrier();
    EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg), root + "/step_2");
    // A rank whose disk is empty follows the others.
    const std::string mine = pg.rank() == 3 ? tmp.file("empty") : root;
    EXPECT_EQ(ckpt::agreed_latest_checkpoint(mine, pg), mine + "/step_2");
  });
}

// Node-local steps saved by an AsyncSaver with copies on the other host (what fsdp-train --mem-dir
// does every step): each commits on both hosts while the caller goes on (what the caller changes
// after save_step returns is not saved), keep_last(1) leaves the newest on both, and with either
// host's directory lost the survivors and a rank with an empty disk load it exactly.
TEST(NodeLocalSave, AsyncStepsWithCopiesSurviveALostHost) {
  TempDir tmp;
  auto host_root = [&](int host) { return tmp.file("host" + std::to_string(host)); };
  run_ranks(4, [&](ProcessGroup& pg) {
    const std::string root = host_root(pg.rank() / 2);
    ckpt::AsyncSaver saver(
        ckpt::SaveOptions().group(&pg).node_local(true).replicas(2).keep_last(1));
    for (int64_t step = 1; step <= 3; ++step) {
      StateDict sd = sharded_sample(pg.rank(), 4, static_cast<double>(step));
      saver.save_step(sd, root, step);
      sd.at("model").dict().at("w").tensor().fill_(-1);  // after the snapshot: not saved
    }
    saver.wait();
    EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{3}));
    EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg), ckpt::step_dir(root, 3));
    const ckpt::VerifyReport v = ckpt::verify(ckpt::step_dir(root, 3));
    EXPECT_TRUE(v.ok()) << v.problems.front();
  });
  for (int lost = 0; lost < 2; ++lost) {
    const std::string empty = tmp.file("empty" + std::to_string(lost));
    run_ranks(3, [&](ProcessGroup& pg) {
      const std::string root = pg.rank() < 2 ? host_root(1 - lost) : empty;
      const std::optional<std::string> latest = ckpt::agreed_latest_checkpoint(root, pg);
      ASSERT_EQ(latest.value_or("(none)"), ckpt::step_dir(root, 3)) << "host " << lost << " lost";
      EXPECT_EQ(ckpt::missing_files(*latest, pg), std::vector<std::string>{});
      StateDict sd = sharded_sample(pg.rank(), 3, 0.0);
      ckpt::load(sd, *latest, ckpt::LoadOptions().group(&pg));
      EXPECT_TRUE(holds_sample(sd, pg.rank(), 3, 3.0)) << "host " << lost << " lost";
    });
  }
}

}  // namespace

namespace {

// Fails the `fail_at`-th file operation that changes something (0-based; open, write, fsync,
// rename, exchange, mkdir, remove) with EIO, once; counts them all.
class FailAtIO : public ckpt::FileIO {
 public:
  int open(const std::string& p, int flags, int mode) override {
    return hit() ? -1 : FileIO::open(p, flags, mode);
  }
  int64_t write(int fd, const void* d, size_t n) override {
    return hit() ? -1 : FileIO::write(fd, d, n);
  }
  int fsync(int fd) override { return hit() ? -1 : FileIO::fsync(fd); }
  int mkdir(const std::string& p, int mode) override { return hit() ? -1 : FileIO::mkdir(p, mode); }
  int rename(const std::string& a, const std::string& b) override {
    return hit() ? -1 : FileIO::rename(a, b);
  }
  int exchange(const std::string& a, const std::string& b) override {
    return hit() ? -1 : FileIO::exchange(a, b);
  }
  int remove(const std::string& p) override { return hit() ? -1 : FileIO::remove(p); }
  int64_t fail_at = -1;
  int64_t calls = 0;
  bool fired = false;

 private:
  bool hit() {
    if (calls++ != fail_at) return false;
    fired = true;
    errno = EIO;
    return true;
  }
};

// An error at every file operation of one host's leader (rank 2) during a node-local save_step,
// with one copy of each file and with two (rank 2 then also receives and checks host 0's files):
// every rank fails or none does, and the hosts never disagree on which steps are committed (the
// step is on both or on neither; the previous one stays on both).
TEST(NodeLocalSave, AnErrorAtEveryCallOfOneHostNeverSplitsTheHosts) {
  TempDir tmp;
  for (int replicas : {1, 2})
    run_ranks(4, [&](ProcessGroup& pg) {
      const std::string root =
          tmp.file("r" + std::to_string(replicas) + "host" + std::to_string(pg.rank() / 2));
      StateDict sd = sharded_sample(pg.rank(), 4, 1.0);
      const auto o =
          ckpt::SaveOptions().group(&pg).node_local(true).keep_last(2).replicas(replicas);
      ckpt::save_step(sd, root, 0, o);
      int64_t points = 0, failed = 0, split = 0;
      for (int64_t k = 0;; ++k) {
        FailAtIO io;
        io.fail_at = pg.rank() == 2 ? k : -1;
        std::string e =
            error_of([&] { ckpt::save_step(sd, root, k + 1, ckpt::SaveOptions(o).io(&io)); });
        if (e == "(no error)") e.clear();
        const std::vector<std::string> errors = pg.all_gather_bytes(e);
        for (const auto& x : errors)
          ASSERT_EQ(x.empty(), e.empty())
              << "k=" << k << ": one rank failed, another did not: " << x;
        std::string steps;
        for (int64_t s : ckpt::list_steps(root)) steps += std::to_string(s) + " ";
        const std::vector<std::string> views = pg.all_gather_bytes(steps);
        // (Older steps may differ: a host whose keep_last failed kept one more.)
        auto has = [&](const std::string& v, int64_t step) {
          return (" " + v).find(" " + std::to_string(step) + " ") != std::string::npos;
        };
        if (has(views[0], k + 1) != has(views[2], k + 1)) {
          // Only a swap that failed on host 1 after host 0's succeeded splits them, as a crash
          // between the two swaps would: said so, and the resume passes over the new step.
          ASSERT_NE(e.find("committed on some hosts only"), std::string::npos)
              << "k=" << k << ": " << e;
          EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg), ckpt::step_dir(root, k)) << "k=" << k;
          ++split;
        }
        ASSERT_TRUE(has(views[0], k) && has(views[2], k))
            << "k=" << k << ": the previous step is gone: " << views[0] << "/ " << views[2];
        // A save that succeeded despite the error (a removal only warned about) left each
        // host's directory whole: every file it lists, copies included, checks out.
        if (e.empty() && pg.rank() % 2 == 0) {
          const ckpt::VerifyReport v = ckpt::verify(ckpt::step_dir(root, k + 1));
          EXPECT_TRUE(v.ok()) << "k=" << k << ": " << v.problems.front();
        }
        failed += !e.empty();
        ++points;
        // Until rank 2's save ran past its last call without the error firing.
        if (pg.all_gather_bytes(io.fired ? "1" : "0")[2] == "0") {
          EXPECT_EQ(e, "") << "the save failed with no error injected";
          break;
        }
        if (e.empty()) continue;
        // Commit step k + 1 for the next round's "previous step".
        ckpt::save_step(sd, root, k + 1, o);
      }
      if (pg.rank() == 0)
        std::printf(
            "[ figures  ] node-local save_step, %d cop%s of each file: an error at each of %lld "
            "file operations of host 1's leader, %lld failing the save on every rank, %lld of "
            "them after host 0 had swapped its directory in\n",
            replicas, replicas == 1 ? "y" : "ies", static_cast<long long>(points - 1),
            static_cast<long long>(failed), static_cast<long long>(split));
      EXPECT_GT(failed, 10);
    });
}

}  // namespace
