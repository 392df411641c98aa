// Copies of node-local checkpoints on other hosts (SaveOptions::replicas, issue 41 item 4): with
// two copies, the directories of any one host can be lost and the job still loads the exact
// saved state from the others. The single-copy save is the negative control (the lost host's
// files are named as unreadable), and a copy that arrives damaged fails the save on every rank.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/save/host_copies.h"
#include "dcp_model_testing.h"
#include "dcp_testing.h"
#include "fsdp/errors.h"
#include "multi_rank.h"

namespace ckpt = fsdp::checkpoint;
namespace copies = fsdp::checkpoint::host_copies;
using fsdp::FullyShardedDataParallel;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using namespace fsdp::testing;

namespace {

using Names = std::vector<std::string>;

Names distcp_in(const std::string& dir) {
  std::vector<std::string> names, out;
  ckpt::default_file_io().list_dir(dir, names);
  for (const auto& n : names)
    if (n.size() > 7 && n.compare(n.size() - 7, 7, ".distcp") == 0) out.push_back(n);
  std::sort(out.begin(), out.end());
  return out;
}

std::string file_of(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

TEST(HostCopies, ReceiversAreOnTheNextHostsAtTheSamePosition) {
  const copies::Hosts hosts = {{0, 1}, {2}, {3, 4, 5}};
  using To = std::vector<std::vector<int>>;
  EXPECT_EQ(copies::receivers(hosts, 6, 1), To(6));
  EXPECT_EQ(copies::receivers(hosts, 6, 2), (To{{2}, {2}, {3}, {0}, {1}, {0}}));
  // Every other host; more replicas than hosts are capped.
  EXPECT_EQ(copies::receivers(hosts, 6, 3), (To{{2, 3}, {2, 4}, {3, 0}, {0, 2}, {1, 2}, {0, 2}}));
  EXPECT_EQ(copies::receivers(hosts, 6, 9), copies::receivers(hosts, 6, 3));
  EXPECT_EQ(copies::receivers({{0, 1, 2}}, 3, 2), To(3)) << "one host has nowhere to copy to";
}

// Writes through to disk, flipping the first byte written into a file whose name ends in
// `target` (a copy damaged on its way to the disk).
class FlipIO : public ckpt::FileIO {
 public:
  explicit FlipIO(std::string target) : target_(std::move(target)) {}
  int open(const std::string& p, int flags, int mode) override {
    const int fd = FileIO::open(p, flags, mode);
    if (fd >= 0 && p.size() >= target_.size() &&
        p.compare(p.size() - target_.size(), target_.size(), target_) == 0)
      flip_fd_ = fd;
    return fd;
  }
  int64_t write(int fd, const void* d, size_t n) override {
    if (fd != flip_fd_ || n == 0) return FileIO::write(fd, d, n);
    std::string b(static_cast<const char*>(d), n);
    b[0] = static_cast<char>(b[0] ^ 1);
    flip_fd_ = -1;
    return FileIO::write(fd, b.data(), n);
  }

 private:
  std::string target_;
  int flip_fd_ = -1;
};

// The exchange itself, in rounds far smaller than the files (and for an empty file): every
// receiver ends with the sender's exact bytes; a byte damaged on the way to a receiver's disk
// fails that receiver, naming the file and the sender.
TEST(HostCopies, FilesTravelInRoundsAndArriveWhole) {
  TempDir tmp;
  const std::vector<int64_t> sizes = {70001, 0, 5000};
  const Names files = {file_of(0), file_of(1), file_of(2)};
  const copies::Hosts hosts = {{0}, {1}, {2}};
  auto contents = [](int r, int64_t n) {
    std::string s(static_cast<size_t>(n), '\0');
    for (int64_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] = static_cast<char>(i * 7 + r);
    return s;
  };
  for (int replicas : {2, 3}) {
    const auto to = copies::receivers(hosts, 3, replicas);
    run_ranks(3, [&](ProcessGroup& pg) {
      const std::string dir =
          tmp.file("r" + std::to_string(replicas) + "h" + std::to_string(pg.rank()));
      ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
      write_bytes(dir + "/" + files[static_cast<size_t>(pg.rank())],
                  contents(pg.rank(), sizes[static_cast<size_t>(pg.rank())]));
      EXPECT_TRUE(copies::copy(pg, ckpt::default_file_io(), dir, files, sizes, to, 1024).ok());
      for (int r = 0; r < 3; ++r) {
        const auto& t = to[static_cast<size_t>(r)];
        if (r != pg.rank() && std::find(t.begin(), t.end(), pg.rank()) == t.end()) continue;
        EXPECT_EQ(read_bytes(dir + "/" + files[static_cast<size_t>(r)]),
                  contents(r, sizes[static_cast<size_t>(r)]))
            << "rank " << pg.rank() << "'s copy of rank " << r << "'s file";
      }
      EXPECT_EQ(distcp_in(dir).size(), static_cast<size_t>(replicas));
    });
  }
  // The negative control: rank 1's copy of rank 0's file damaged as it is written.
  const auto to = copies::receivers(hosts, 3, 2);
  run_ranks(3, [&](ProcessGroup& pg) {
    const std::string dir = tmp.file("bad" + std::to_string(pg.rank()));
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
    write_bytes(dir + "/" + files[static_cast<size_t>(pg.rank())],
                contents(pg.rank(), sizes[static_cast<size_t>(pg.rank())]));
    FlipIO io(pg.rank() == 1 ? "/" + file_of(0) : std::string("/none"));
    const fsdp::dist::Verdict v = copies::copy(pg, io, dir, files, sizes, to, 4096);
    if (pg.rank() != 1) {
      EXPECT_TRUE(v.ok()) << v.message();
      return;
    }
    ASSERT_FALSE(v.ok());
    EXPECT_NE(
        v.message().find("the copy of __0_0.distcp received from rank 0 differs from what it sent"),
        std::string::npos)
        << v.message();
    EXPECT_THROW(v.rethrow_own(), fsdp::CorruptionError);
  });
}

// Four ranks as three hosts of 2, 1 and 1 ranks save with two copies: each host's directory holds
// its own ranks' files and the previous host's, its manifest lists them and verify checks them.
// Whichever host's directory is then lost, three ranks (one of them a new host with an empty
// disk) load the exact saved state from what is left. With one copy, losing a host loses files.
TEST(HostCopies, TwoCopiesSurviveTheLossOfAnyOneHost) {
  TempDir tmp, ref;
  auto dir_of = [&](const char* save, int host) {
    return tmp.file(std::string(save) + "/host" + std::to_string(host) + "/c");
  };
  const std::vector<int> host_of = {0, 0, 1, 2};
  run_ranks(4, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    StateDict sd = train_two_steps(model, *opt, pg.rank());
    const int host = host_of[static_cast<size_t>(pg.rank())];
    const auto o = ckpt::SaveOptions().group(&pg).node_local(true);
    ckpt::save(sd, dir_of("two", host), ckpt::SaveOptions(o).replicas(2));
    ckpt::save(sd, dir_of("one", host), o);
    // A damaged copy (rank 2 receives host 0's files) fails every rank; nothing is committed.
    FlipIO flip(pg.rank() == 2 ? "/" + file_of(1) : std::string("/none"));
    const std::string e = error_of(
        [&] { ckpt::save(sd, dir_of("bad", host), ckpt::SaveOptions(o).replicas(2).io(&flip)); });
    EXPECT_NE(e.find("nothing was committed: copying data files to other hosts, on rank 2"),
              std::string::npos)
        << e;
    EXPECT_EQ(ckpt::default_file_io().is_dir(dir_of("bad", host)), 0);
    // Options that cannot hold: ranks that would plan different copies fail together.
    const std::string mixed = error_of([&] {
      ckpt::save(sd, dir_of("mixed", host), ckpt::SaveOptions(o).replicas(pg.rank() == 3 ? 3 : 2));
    });
    EXPECT_NE(mixed.find("ranks 0 and 3 pass different SaveOptions::replicas (2 and 3)"),
              std::string::npos)
        << mixed;
    EXPECT_NE(error_of([&] {
                ckpt::save(sd, tmp.file("x"), ckpt::SaveOptions().replicas(2));
              }).find("replicas(2) needs node_local(true)"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                ckpt::save(sd, tmp.file("x"), ckpt::SaveOptions(o).replicas(0));
              }).find("must be at least 1"),
              std::string::npos);
    save_reference_state(model, *opt, ref.path(), pg.rank());
  });
  EXPECT_EQ(distcp_in(dir_of("two", 0)), (Names{file_of(0), file_of(1), file_of(3)}));
  EXPECT_EQ(distcp_in(dir_of("two", 1)), (Names{file_of(0), file_of(1), file_of(2)}));
  EXPECT_EQ(distcp_in(dir_of("two", 2)), (Names{file_of(2), file_of(3)}));
  for (int host = 0; host < 3; ++host) {
    const ckpt::VerifyReport v = ckpt::verify(dir_of("two", host));
    EXPECT_TRUE(v.ok()) << v.problems.front();
    Names here = distcp_in(dir_of("two", host)), all = here;
    all.insert(all.end(), v.elsewhere.begin(), v.elsewhere.end());
    std::sort(all.begin(), all.end());
    EXPECT_EQ(all, (Names{file_of(0), file_of(1), file_of(2), file_of(3)})) << "host " << host;
    for (const auto& f : here)  // the copies are the originals, byte for byte
      EXPECT_EQ(read_bytes(dir_of("two", host) + "/" + f),
                read_bytes(dir_of("one", host_of[static_cast<size_t>(f[2] - '0')]) + "/" + f));
  }
  // The loss of each host in turn: the survivors, and a new host whose disk is empty.
  for (int lost = 0; lost < 3; ++lost) {
    std::vector<std::string> dirs;
    for (int h = 0; h < 3; ++h)
      if (h != lost) dirs.push_back(dir_of("two", h));
    dirs.push_back(tmp.file("empty/c"));
    run_ranks(3, [&](ProcessGroup& pg) {
      TinyLM m(99);
      FullyShardedDataParallel model(m, lm_options(m));
      auto opt = make_optimizer("Adam", unique_params(model->parameters()));
      const std::string& mine = dirs[static_cast<size_t>(pg.rank())];
      EXPECT_EQ(ckpt::missing_files(mine, pg), Names{});
      load_checkpoint(model, *opt, mine, ckpt::LoadOptions().group(&pg));
      expect_reference_state(model, *opt, ref.path(), "host " + std::to_string(lost) + " lost");
    });
  }
  // The negative control: one copy, host 1 lost.
  run_ranks(3, [&](ProcessGroup& pg) {
    const std::vector<std::string> dirs = {dir_of("one", 0), dir_of("one", 2), tmp.file("empty/c")};
    TinyLM m(99);
    FullyShardedDataParallel model(m, lm_options(m));
    auto opt = make_optimizer("Adam", unique_params(model->parameters()));
    EXPECT_EQ(ckpt::missing_files(dirs[static_cast<size_t>(pg.rank())], pg), Names{file_of(2)});
    const std::string e = error_of([&] {
      load_checkpoint(model, *opt, dirs[static_cast<size_t>(pg.rank())],
                      ckpt::LoadOptions().group(&pg));
    });
    EXPECT_NE(e.find("no rank can read '__2_0.distcp'"), std::string::npos) << e;
  });
}

}  // namespace
