// AsyncSaver (issue 11): the save runs in the background while the training's own collectives go
// on, the tensors may change right after save() returns, staging buffers are reused, and an I/O
// error on one rank surfaces at the next wait() on every rank.
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "checkpoint/save/stream_copy.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "state_dict_testing.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::ShardedTensor;
using fsdp::ShardMetadata;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::run_ranks;
using fsdp::testing::TempDir;

namespace {

constexpr int64_t kBig = 300001;  // 1.2 MB of float32
at::Tensor big_values(float value) { return at::arange(kBig, at::kFloat) + value; }

StateDict sample(int rank, float value) {
  StateDict model;
  model.insert_or_assign("w", ShardedTensor({4, 256}, at::kFloat,
                                            {{at::full({2, 256}, value + rank),
                                              ShardMetadata{{2 * rank, 0}, {2, 256}, rank}}}));
  model.insert_or_assign("b", at::full({8}, value));
  // Past kStreamCopyMinBytes: staged with streaming stores.
  model.insert_or_assign("big", big_values(value));
  StateDict sd;
  sd.insert_or_assign("model", model);
  sd.insert_or_assign("step", int64_t{static_cast<int64_t>(value)});
  return sd;
}

at::Tensor saved_w(const std::string& dir) {
  return fsdp::testing::load_tensor(dir, "model.w", {4, 256});
}

// Fails the next `fail` writes with ENOSPC, whichever thread makes them.
struct FailingWrites : ckpt::FileIO {
  int64_t write(int fd, const void* data, size_t n) override {
    if (fail.load() > 0) {
      --fail;
      errno = ENOSPC;
      return -1;
    }
    return FileIO::write(fd, data, n);
  }
  std::atomic<int> fail{0};
};

// Holds the background save back at the opening of its data file (before it serializes any
// tensor) until the test opens the gate: the tensors are certainly changed by then.
struct GatedWrites : ckpt::FileIO {
  int open(const std::string& path, int flags, int mode) override {
    if (path.find(".distcp") != std::string::npos)
      while (!gate.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return FileIO::open(path, flags, mode);
  }
  std::atomic<bool> gate{true};
};

TEST(AsyncSave, OverlapsTrainingAndSnapshotsTheTensors) {
  TempDir tmp;
  const std::string root = tmp.file("ckpt");
  run_ranks(2, [&](ProcessGroup& pg) {
    GatedWrites io;
    ckpt::AsyncSaver saver(ckpt::SaveOptions().keep_last(2).io(&io));
    StateDict sd = sample(pg.rank(), 1);
    for (int step = 1; step <= 3; ++step) {
      saver.wait();  // the gate closes only once the previous save has gone through it
      io.gate = false;
      saver.save_step(sd, root, step);
      EXPECT_TRUE(saver.pending());
      // Training goes on: its collectives on the default group while the save runs, and the
      // tensors change at once.
      at::Tensor x = at::ones({1024});
      for (int i = 0; i < 5; ++i) pg.all_reduce(x);
      EXPECT_EQ(x[0].item<float>(), 32.0f);
      sd.at("model").dict().at("w").sharded_tensor().local_shards()[0].tensor.fill_(step + 1 +
                                                                                    pg.rank());
      sd.at("model").dict().at("b").tensor().fill_(step + 1);
      sd.at("model").dict().at("big").tensor().copy_(big_values(step + 1));
      io.gate = true;
    }
    const int64_t staged = saver.staging_bytes();
    EXPECT_EQ(staged, (2 * 256 + 8 + kBig) * 4) << "one set of staging buffers, reused";
    saver.wait();
    EXPECT_FALSE(saver.pending());
    pg.barrier();
    if (pg.rank() == 0) {
      EXPECT_EQ(ckpt::list_steps(root), (std::vector<int64_t>{2, 3}));
      // Step 3 holds the values at its save() call: rank r's rows hold 3 + r.
      const at::Tensor w = saved_w(ckpt::step_dir(root, 3));
      EXPECT_TRUE(at::equal(fsdp::testing::load_tensor(ckpt::step_dir(root, 3), "model.b", {8}),
                            at::full({8}, 3.0f)));
      EXPECT_TRUE(at::equal(
          fsdp::testing::load_tensor(ckpt::step_dir(root, 3), "model.big", {kBig}), big_values(3)));
      EXPECT_TRUE(at::equal(w.narrow(0, 0, 2), at::full({2, 256}, 3.0f)));
      EXPECT_TRUE(at::equal(w.narrow(0, 2, 2), at::full({2, 256}, 4.0f)));
      EXPECT_TRUE(ckpt::verify(ckpt::step_dir(root, 3)).ok());
    }
  });
}

TEST(AsyncSave, ErrorsSurfaceAtTheNextWaitOnEveryRank) {
  TempDir tmp;
  run_ranks(2, [&](ProcessGroup& pg) {
    FailingWrites io;
    io.fail = pg.rank() == 1 ? 1 : 0;
    ckpt::AsyncSaver saver(ckpt::SaveOptions().io(&io));
    saver.save(sample(pg.rank(), 1), tmp.file("c"));  // returns: the failure is in the background
    const std::string err = error_of([&] { saver.wait(); });
    EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
    EXPECT_EQ(error_of([&] { saver.wait(); }), "(no error)") << "an error is reported once";
    // The saver is usable again, and the next save's own error surfaces at save() itself.
    saver.save(sample(pg.rank(), 2), tmp.file("c"));
    saver.wait();
    if (pg.rank() == 0) {
      EXPECT_TRUE(at::equal(saved_w(tmp.file("c")).narrow(0, 0, 2), at::full({2, 256}, 2.0f)));
    }
    io.fail = pg.rank() == 0 ? 1 : 0;
    saver.save(sample(pg.rank(), 3), tmp.file("c"));
    const std::string err2 = error_of([&] { saver.save(sample(pg.rank(), 4), tmp.file("d")); });
    EXPECT_NE(err2.find("No space left on device"), std::string::npos) << err2;
    saver.wait();
  });
}

// The staging copy gives memcpy's bytes for every size around its threshold and its 64-byte
// loop, and every misalignment of either side.
TEST(StreamCopy, SameBytesAsMemcpyAtEverySizeAndAlignment) {
  const size_t min = ckpt::kStreamCopyMinBytes;
  std::vector<unsigned char> src(min + 300);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{63}, min - 1, min, min + 1, min + 63, min + 64, min + 100}) {
    for (size_t s_off : {0, 1, 8, 15}) {
      for (size_t d_off : {0, 3, 16, 33}) {
        std::vector<unsigned char> dst(n + 64, 0xAB), want(n + 64, 0xAB);
        ckpt::stream_copy(dst.data() + d_off, src.data() + s_off, n);
        std::memcpy(want.data() + d_off, src.data() + s_off, n);
        ASSERT_TRUE(dst == want) << n << " bytes, source offset " << s_off
                                 << ", destination offset " << d_off;
      }
    }
  }
}

}  // namespace
