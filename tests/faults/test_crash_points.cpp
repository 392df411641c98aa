// A crash at every I/O point (issue 39, item 3), for a save_step with keep_last, a save replacing
// a checkpoint, a first save into a new directory, an async save, both exports, and a node-local
// save_step across two hosts (issue 40; checkpoint_operations.h lists the operations).
//
// Each operation runs once through crash::JournalIO on real ranks; the journal's every prefix is
// then replayed with each loss pattern POSIX allows for writes and names not yet made durable by
// fsync (none lost, all lost, each single one lost, and for several hosts all of one host's;
// crash_fs.h), and every distinct tree is checked as a restart would see it: `latest` names the
// old or the new checkpoint, that one verifies and loads exactly, after the save returned it is
// the new one, and the next save goes through over whatever was left.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdio>
#include <string>

#include "checkpoint_operations.h"
#include "crash_fs.h"
#include "multi_rank.h"
#include "point_sampler.h"

namespace crash = fsdp::testing::crash;
using fsdp::dist::ProcessGroup;
using fsdp::testing::operation;
using fsdp::testing::Operation;
using fsdp::testing::PointSampler;
using fsdp::testing::run_ranks;
using fsdp::testing::RunOptions;
using fsdp::testing::scratch_base;
using fsdp::testing::TempDir;

namespace {

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
  if (op.host_of) model.set_hosts(op.host_of);
  RunOptions opts;
  opts.deadline = std::chrono::minutes(10);
  run_ranks(
      op.restart_world,
      [&](ProcessGroup& pg) {
        // Every restart rank builds the same states in the same order, each in its own tree.
        const std::string out = tmp.file("restart" + std::to_string(pg.rank()));
        PointSampler sampler(op.stride);
        const crash::CrashCounts c =
            model.for_each_state(out, [&](const std::string& what, bool after_return) {
              if (sampler.take(crash_label(what, after_return)))
                op.check(pg, out, after_return, what);
            });
        if (pg.rank() == 0)
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
TEST(CrashPoints, NodeLocalSaveStep) { crash_everywhere(operation("node-local save_step")); }
TEST(CrashPoints, NodeLocalSaveStepWithCopies) {
  crash_everywhere(operation("node-local save_step with copies on the other host"));
}
}  // namespace
