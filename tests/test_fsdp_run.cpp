// fsdp-run, the launcher (issue 12), run as a user runs it, with small shell programs as ranks:
// torchrun's variables, rank-prefixed whole lines, a dying rank stopping the others (SIGTERM,
// then SIGKILL after the grace period) with a non-zero exit naming it, SIGINT forwarded, and bad
// usage answered with one line. fsdp-train's tests run real Gloo programs under it.
#include <gtest/gtest.h>

#include <set>

#include "command_testing.h"
#include "multi_rank.h"

namespace {

using fsdp::testing::Background;
using fsdp::testing::count_lines_with;
using fsdp::testing::run_shell;

const std::string kRun = FSDP_RUN_BIN;

TEST(FsdpRun, GivesEachRankTorchrunsVariablesAndPrefixesItsLines) {
  const auto r = run_shell(kRun +
                           " --nproc-per-node 3 sh -c 'echo \"vars $RANK $LOCAL_RANK $WORLD_SIZE "
                           "$LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT\"; "
                           "echo to-stderr >&2; printf no-newline'");
  ASSERT_EQ(r.rc, 0) << r.out;
  std::set<std::string> ports;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string want = "[r" + std::to_string(rank) + "] vars " + std::to_string(rank) + " " +
                             std::to_string(rank) + " 3 3 0 127.0.0.1 ";
    const size_t at = r.out.find(want);
    ASSERT_NE(at, std::string::npos) << want << "\n" << r.out;
    ports.insert(r.out.substr(at + want.size(), r.out.find('\n', at) - at - want.size()));
    const std::string prefix = "[r" + std::to_string(rank) + "] ";
    EXPECT_EQ(count_lines_with(r.out, prefix + "to-stderr"), 1) << r.out;
    EXPECT_EQ(count_lines_with(r.out, prefix + "no-newline"), 1) << "a last partial line\n"
                                                                 << r.out;
  }
  ASSERT_EQ(ports.size(), 1u) << "every rank must get the same MASTER_PORT\n" << r.out;
  EXPECT_GT(std::stoi(*ports.begin()), 0);

  // Node 1 of 2: global ranks 2 and 3, the given store address, no prefixes when asked.
  const auto n =
      run_shell(kRun +
                " --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.7 "
                "--master-port 1234 --no-prefix sh -c 'echo \"$RANK/$WORLD_SIZE "
                "$LOCAL_RANK/$LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR:$MASTER_PORT\"'");
  ASSERT_EQ(n.rc, 0) << n.out;
  EXPECT_EQ(count_lines_with(n.out, "2/4 0/2 1 10.0.0.7:1234"), 1) << n.out;
  EXPECT_EQ(count_lines_with(n.out, "3/4 1/2 1 10.0.0.7:1234"), 1) << n.out;
  EXPECT_EQ(count_lines_with(n.out, "[r"), 0) << n.out;
}

// Rank 1 dies of SIGKILL; rank 0 ignores SIGTERM (so it takes SIGKILL after the grace period),
// rank 2 stops on SIGTERM. fsdp-run names rank 1 and exits 128 + 9 within seconds, not after the
// 60 s the others would sleep.
TEST(FsdpRun, OneRankDyingStopsTheOthers) {
  const auto r = run_shell(kRun +
                           " --nproc-per-node 3 --grace-period 1 sh -c '"
                           "if [ $RANK = 0 ]; then trap \"echo ignoring TERM\" TERM; fi; "
                           "if [ $RANK = 1 ]; then sleep 0.3; kill -9 $$; fi; "
                           "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'");
  EXPECT_EQ(r.rc, 128 + 9) << r.out;
  EXPECT_NE(r.out.find("fsdp-run: failed: rank 1 (local rank 1) was killed by signal 9 (SIGKILL)"),
            std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 30) << "the other ranks were not stopped\n" << r.out;

  const auto e = run_shell(kRun + " --nproc-per-node 2 sh -c '[ $RANK = 1 ] && exit 3; exit 0'");
  EXPECT_EQ(e.rc, 3) << e.out;
  EXPECT_NE(e.out.find("rank 1 (local rank 1) exited with code 3"), std::string::npos) << e.out;
  EXPECT_EQ(run_shell(kRun + " --nproc-per-node 2 true").rc, 0);
}

TEST(FsdpRun, ForwardsSigintToEveryRank) {
  fsdp::testing::TempDir dir;
  Background run(kRun +
                     " --nproc-per-node 2 sh -c 'trap \"echo got INT; exit 5\" INT; "
                     "echo ready; while :; do sleep 0.1; done'",
                 dir.file("log"));
  for (int i = 0; i < 100 && count_lines_with(run.output(), "ready") < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(count_lines_with(run.output(), "ready"), 2) << run.output();
  ::kill(run.pid(), SIGINT);
  EXPECT_EQ(run.wait(std::chrono::seconds(30)), 128 + SIGINT) << run.output();
  EXPECT_EQ(count_lines_with(run.output(), "got INT"), 2) << run.output();
}

TEST(FsdpRun, BadUsageIsOneLine) {
  struct Case {
    std::string args, message;
    int rc;
  } cases[] = {
      {"", "no PROGRAM given", 2},
      {"--bogus true", "unknown option --bogus", 2},
      {"--nnodes 2 --node-rank 2 true", "--node-rank 2 is not below --nnodes 2", 2},
      {"--nproc-per-node 0 true", "--nproc-per-node", 2},
      {"/nonexistent/program", "cannot run /nonexistent/program", 127},
  };
  for (const auto& c : cases) {
    const auto r = run_shell(kRun + " " + c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << "\n" << r.out;
  }
  const auto h = run_shell(kRun + " --help");
  EXPECT_EQ(h.rc, 0);
  EXPECT_NE(h.out.find("--nproc-per-node"), std::string::npos) << h.out;
}

}  // namespace
