// A rank killed or stopped inside the collectives the library issues (issue 39, item 5).
//
// One workflow on two ranks covers the distributed operations a trainer meets: a training step
// (unshard, gradient reduce-scatter), get_state_dict, a checkpoint save (its plan and verdict
// exchanges), a load with set_state_dict (the optimizer load's exchanges), and set_state_dict with
// broadcast_from_rank0. A first run lists every collective rank 1 starts, through the library's
// fault hook (src/dist/fault_point.h), each labelled with the workflow's phase. Then, for every
// collective in turn, rank 1 kills itself (SIGKILL) as it starts; at the first of each phase it
// also stops itself instead (SIGSTOP: a hang, not a closed socket). Rank 0 must raise
// DistError naming that collective within the timeout, and a save that was under way must not have
// been committed.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "dist/fault_point.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "point_sampler.h"
#include "sd_matrix_model.h"

namespace ckpt = fsdp::checkpoint;
namespace mx = fsdp::testing::matrix;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::dist::ProcessGroup;
using fsdp::testing::run_ranks;
using fsdp::testing::RunOptions;
using fsdp::testing::TempDir;

namespace {

// The hook's state (a plain function pointer takes no captures). Each rank is a process of its
// own, so these are per rank.
std::string g_phase;                        // the workflow's current phase
std::vector<std::string>* g_log = nullptr;  // "phase|collective", when listing
int g_fail_at = 0;                          // the collective (1-based) to fail at; 0: none
int g_signal = SIGKILL;
int g_calls = 0;

// "all_gather_into_tensor on group 'default' (...)" -> "all_gather_into_tensor".
std::string op_name(const char* what) {
  const std::string w = what;
  return w.substr(0, w.find(" on group "));
}

void hook(const char* what) {
  ++g_calls;
  if (g_log) g_log->push_back(g_phase + "|" + op_name(what));
  if (g_calls == g_fail_at) ::raise(g_signal);
}

// The workflow. `dir` receives the checkpoint.
void workflow(ProcessGroup& pg, const std::string& dir) {
  g_phase = "wrap";
  mx::MatrixNet net(1);
  FullyShardedDataParallel model(net, mx::matrix_options(net, ShardingStrategy::FULL_SHARD,
                                                         /*use_orig_params=*/false, pg.size()));
  std::vector<std::vector<at::Tensor>> params(mx::unit_names().size());
  for (const auto& pf : model->param_fqns()) params[mx::unit_of(pf.fqns[0])].push_back(pf.param);
  mx::Optimizers optims = mx::make_optimizers(params);
  g_phase = "train";
  optims.zero_grad();
  auto idx = mx::matrix_tokens(0, pg.rank(), pg.size());
  mx::matrix_loss(model->forward(idx), idx).backward();
  optims.step();
  g_phase = "get_state_dict";
  auto [msd, osd] = ckpt::get_state_dict(model, optims.list());
  g_phase = "save";
  StateDict sd;
  sd.insert_or_assign("model", msd);
  sd.insert_or_assign("optim", osd);
  ckpt::save(sd, dir);
  g_phase = "load";
  ckpt::load(sd, dir);
  ckpt::set_state_dict(model, optims.list(), sd.at("model").dict(), sd.at("optim").dict());
  g_phase = "broadcast_from_rank0";
  const auto full = ckpt::StateDictOptions().full_state_dict(true);
  auto [fm, fo] = ckpt::get_state_dict(model, optims.list(), full);
  ckpt::set_state_dict(model, optims.list(), pg.rank() == 0 ? fm : StateDict(),
                       pg.rank() == 0 ? fo : StateDict(),
                       ckpt::StateDictOptions().full_state_dict(true).broadcast_from_rank0(true));
  g_phase = "done";
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

TEST(CollectiveFailures, ARankKilledOrStoppedInsideEachCollective) {
  TempDir tmp;
  // Every collective rank 1 starts, in order, labelled with its phase.
  std::vector<std::string> calls;
  {
    const std::string list = tmp.file("calls");
    run_ranks(2, [&](ProcessGroup& pg) {
      std::vector<std::string> log;
      if (pg.rank() == 1) g_log = &log;
      fsdp::dist::detail::set_fault_hook(hook);
      workflow(pg, tmp.file("listing"));
      fsdp::dist::detail::set_fault_hook(nullptr);
      if (pg.rank() == 1) {
        std::FILE* f = std::fopen(list.c_str(), "w");
        for (const auto& l : log) std::fprintf(f, "%s\n", l.c_str());
        std::fclose(f);
      }
    });
    std::FILE* f = std::fopen(list.c_str(), "r");
    ASSERT_NE(f, nullptr);
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
      std::string l = line;
      if (!l.empty() && l.back() == '\n') l.pop_back();
      calls.push_back(l);
    }
    std::fclose(f);
  }
  ASSERT_GT(calls.size(), 10u);
  // The points: SIGKILL at every call; SIGSTOP at each phase's first. (Under sanitize.sh the
  // kills sample the calls: point_sampler.h.)
  struct Point {
    size_t index;
    int signal;
  };
  std::vector<Point> points;
  std::set<std::string> seen, phases;
  fsdp::testing::PointSampler sampler;
  for (size_t i = 0; i < calls.size(); ++i) {
    // A dead peer's closed sockets fail the others at once.
    if (sampler.take(calls[i])) points.push_back({i, SIGKILL});
    seen.insert(calls[i]);
    const std::string phase = calls[i].substr(0, calls[i].find('|'));
    if (phases.insert(phase).second) points.push_back({i, SIGSTOP});  // a full timeout each
  }
  const auto timeout = std::chrono::milliseconds(4000);
  int killed = 0, stopped = 0, committed = 0;
  for (const Point& p : points) {
    const std::string& call = calls[p.index];
    const std::string op = call.substr(call.find('|') + 1);
    const std::string what = std::string(p.signal == SIGKILL ? "killed" : "stopped") + " in call " +
                             std::to_string(p.index + 1) + " (" + call + ")";
    SCOPED_TRACE(what);
    const std::string dir =
        tmp.file("ckpt" + std::to_string(p.index) + "_" + std::to_string(p.signal));
    RunOptions opts;
    opts.collective_timeout = timeout;
    opts.grace = 4 * timeout;  // tearing down a group whose peer is gone may wait once more
    opts.report = false;
    // A stopped rank stays until the deadline once rank 0 is through: keep it short.
    opts.deadline = 3 * timeout + std::chrono::seconds(5);
    const auto started = std::chrono::steady_clock::now();
    const auto results = run_ranks(
        2,
        [&](ProcessGroup& pg) {
          const std::string pid_file = dir + ".pid";
          if (pg.rank() == 1) {
            g_fail_at = static_cast<int>(p.index) + 1;
            g_signal = p.signal;
            std::FILE* f = std::fopen(pid_file.c_str(), "w");
            std::fprintf(f, "%d\n", static_cast<int>(::getpid()));
            std::fclose(f);
          }
          pg.barrier();
          fsdp::dist::detail::set_fault_hook(hook);
          const auto t0 = std::chrono::steady_clock::now();
          std::string error = "(no error)";
          try {
            workflow(pg, dir);
          } catch (const fsdp::DistError& e) {
            error = e.what();
          } catch (const std::exception& e) {
            error = std::string("(not a DistError) ") + e.what();
          }
          const auto took = std::chrono::steady_clock::now() - t0;
          // A stopped rank 1 would stay until the harness's deadline: rank 0, done with it, ends
          // it.
          if (pg.rank() == 0 && p.signal == SIGSTOP) {
            int pid = 0;
            if (std::FILE* f = std::fopen(pid_file.c_str(), "r")) {
              if (std::fscanf(f, "%d", &pid) != 1) pid = 0;
              std::fclose(f);
            }
            if (pid > 0) ::kill(pid, SIGKILL);
          }
          // Rank 0 names the collective it was in, and gives up within the timeout (plus the
          // workflow's own time up to there).
          if (error.find(op) == std::string::npos || error.find("(not a DistError)") == 0)
            throw std::runtime_error("expected a DistError naming " + op + ", got: " + error);
          if (took > 2 * timeout + std::chrono::seconds(3))
            throw std::runtime_error(
                "took " +
                std::to_string(
                    std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                " ms");
        },
        opts);
    ASSERT_EQ(results.size(), 2u);
    if (std::getenv("FSDP_TEST_VERBOSE"))
      std::fprintf(stderr, "%s: %lld ms, rank 0 %s %s; rank 1: %s\n", what.c_str(),
                   static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              std::chrono::steady_clock::now() - started)
                                              .count()),
                   results[0].ok ? "ok" : "failed:", results[0].message.c_str(),
                   results[1].message.c_str());
    EXPECT_TRUE(results[0].ok) << results[0].message;
    EXPECT_FALSE(results[1].ok) << "rank 1 should have died";
    // A save that lost a rank commits nothing, except where every rank's data was written and
    // reported and only the verdict's broadcast was left: rank 0 then committed a complete
    // checkpoint before its broadcast failed (and raised the DistError all the same).
    if (call.rfind("save|", 0) == 0 && exists(dir + "/.metadata")) {
      EXPECT_TRUE(ckpt::verify(dir).ok()) << "a save that lost a rank committed an incomplete one";
      EXPECT_EQ(call, "save|broadcast") << "a save that lost a rank before its verdict committed";
      ++committed;
    }
    (p.signal == SIGKILL ? killed : stopped)++;
  }
  std::printf(
      "%zu collectives in the workflow, %zu distinct (phase, collective) points: %d kills, "
      "%d stops, rank 0 failed with a DistError naming the collective at each; %d complete "
      "checkpoint(s) committed before the verdict's broadcast failed%s\n",
      calls.size(), seen.size(), killed, stopped, committed, sampler.note().c_str());
  for (const std::string& s : seen) std::printf("  %s\n", s.c_str());
}

}  // namespace
