// fsdp-run: start one process per rank on this node, as PyTorch's torchrun does (issue 12).
//
//   fsdp-run --nproc-per-node 2 ./fsdp-train --steps 100
//   fsdp-run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500
//            --nproc-per-node 4 ./fsdp-train ...            (and --node-rank 1 on node1)
//
// Each process gets torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID (and
// OMP_NUM_THREADS=1 when unset and more than one process shares the node, as torchrun does), so
// fsdp::dist::init_process_group() needs no arguments. Every line a process prints comes out
// prefixed with its rank ("[r1] ..."), stdout to stdout and stderr to stderr, whole lines only.
//
// When one process exits non-zero or dies of a signal, the others get SIGTERM and, after the
// grace period, SIGKILL; fsdp-run then names that rank and its status and exits non-zero (the
// rank's exit code, or 128 + the signal's number). SIGINT and SIGTERM sent to fsdp-run are
// forwarded to every process. If fsdp-run itself is killed, the kernel kills its processes
// (PR_SET_PDEATHSIG), so no rank is left waiting on a collective that will never complete.
//
// With --max-restarts N, a failed job is started again (every rank, on every node) at most N times,
// with TORCHELASTIC_RESTART_COUNT counting the restarts, as with torchrun; the program resumes
// from its latest checkpoint by itself.
//
// With --nnodes MIN:MAX the job is elastic, as with torchrun: a round starts once MAX launchers
// have joined, or MIN have and --last-call-timeout has passed; its nodes are numbered densely in
// the order of their --node-rank (GROUP_RANK, RANK and WORLD_SIZE follow). A lost node (its
// launcher silent past --heartbeat-timeout) fails the round like a failed rank; the next round
// forms without it if at least MIN remain. A launcher started on a node rank that was lost, or
// one that was never there (up to MAX), waits for the next round, and node 0 ends the running
// round so that it starts with it (a membership change, which --max-restarts does not count;
// TORCHELASTIC_RESTART_COUNT counts every start, as the ranks' store keys are kept per start).
//
// Across hosts (--nnodes > 1), the launchers meet in the job's TCPStore, which the launcher of node
// rank 0 hosts at --master-addr:--master-port (rendezvous.h), as torchrun's agents do: they check
// that they agree on the job's shape, start their ranks only once all have joined (within
// --join-timeout), and tell each other of the first failure, so that a rank failing or dying on
// any host stops every host's ranks within a second or so, and every launcher exits non-zero
// naming the node, host and rank that failed first. A launcher that stops answering (its host
// gone) is noticed by its heartbeat (--heartbeat-timeout). The ranks connect to the same store as
// clients (TORCHELASTIC_USE_AGENT_STORE=True, PyTorch's convention), under keys of their own.
//
// It links c10d's TCPStore only (no torch/torch.h): it starts in a fraction of a second.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launch/rendezvous.h"
#include "launch/options.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using fsdp_run::AgentConfig;
using fsdp_run::Failure;
using fsdp_run::free_port;
using fsdp_run::JobAgent;
using fsdp_run::Options;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

// Writes all of `s` to `fd` (one write per line keeps lines from different ranks whole).
void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone (closed pipe): nothing better to do
    done += static_cast<size_t>(n);
  }
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// One output stream of one rank: bytes read so far that do not end a line yet.
struct Stream {
  int fd = -1;         // read end; -1 once closed
  int out = 1;         // where its lines go
  std::string prefix;  // "[rN] ", or "" with --no-prefix
  std::string pending;
};

struct Rank {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

void flush_lines(Stream& s, bool all) {
  const std::string& prefix = s.prefix;
  size_t start = 0;
  std::string out;
  for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1)
    out += prefix + s.pending.substr(start, nl - start + 1);
  s.pending.erase(0, start);
  if (all && !s.pending.empty()) {
    out += prefix + s.pending + "\n";
    s.pending.clear();
  }
  if (!out.empty()) write_all(s.out, out);
}

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (const Rank& r : ranks)
    if (r.running) ::kill(-r.pid, sig);  // its process group: the program and what it started
}

// Signals arrive on g_signal_pipe (on_signal), so that the poll loop sees them.
bool install_signal_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::fprintf(stderr, "fsdp-run: pipe: %s\n", std::strerror(errno));
    return false;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return true;
}

// In the forked child: becomes rank `r` with torchrun's environment and runs the program. Never
// returns.
// Signals arrive blocked (start_ranks): until the defaults are back, a SIGTERM meant for the rank
// would run fsdp-run's handler, which writes to fsdp-run's own signal pipe (inherited), so that
// fsdp-run took a stop of its ranks for a signal sent to itself and ended the job (found when
// --max-restarts did not restart 1 time in 5). Blocked, it stays pending and kills the rank.
[[noreturn]] void exec_rank(const Options& o, const Rank& r, int (&fds)[2][2],
                            const sigset_t& old_mask) {
  ::setpgid(0, 0);  // its own group: fsdp-run forwards terminal signals and stops the rest
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) _exit(1);  // fsdp-run already gone
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  ::dup2(fds[0][1], 1);
  ::dup2(fds[1][1], 2);
  auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
  set("RANK", std::to_string(r.rank));
  set("LOCAL_RANK", std::to_string(r.local_rank));
  set("WORLD_SIZE", std::to_string(o.world()));
  set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
  set("GROUP_RANK", std::to_string(o.group_rank));
  set("GROUP_WORLD_SIZE", std::to_string(o.group_world));
  set("ROLE_RANK", std::to_string(r.rank));
  set("ROLE_WORLD_SIZE", std::to_string(o.world()));
  set("MASTER_ADDR", o.master_addr);
  set("MASTER_PORT", std::to_string(o.master_port));
  set("TORCHELASTIC_RUN_ID", o.run_id);
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(o.round));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
  // Across hosts the launcher of node 0 hosts the store, and every rank is a client of it.
  set("TORCHELASTIC_USE_AGENT_STORE", o.multi_node() ? "True" : "False");
  if (o.set_omp) set("OMP_NUM_THREADS", "1");
  std::vector<std::string> command = o.command;
  std::vector<char*> args;
  for (auto& a : command) args.push_back(a.data());
  args.push_back(nullptr);
  ::execvp(args[0], args.data());
  std::fprintf(stderr, "fsdp-run: cannot run %s: %s\n", args[0], std::strerror(errno));
  _exit(127);
}

// Forks every local rank, its stdout and stderr on pipes of ours. False (the ranks started so
// far killed) if a pipe or a fork fails.
bool start_ranks(const Options& o, std::vector<Rank>& ranks) {
  ranks.assign(o.nproc, Rank{});
  for (int local = 0; local < o.nproc; ++local) {
    Rank& r = ranks[local];
    r.local_rank = local;
    r.rank = o.group_rank * o.nproc + local;
    int fds[2][2];
    for (auto& p : fds) {
      if (::pipe2(p, O_CLOEXEC) != 0) {
        std::fprintf(stderr, "fsdp-run: pipe: %s\n", std::strerror(errno));
        signal_all(ranks, SIGKILL);
        return false;
      }
    }
    sigset_t all, old_mask;
    sigfillset(&all);
    ::sigprocmask(SIG_BLOCK, &all, &old_mask);  // until the child has its own handlers
    const pid_t pid = ::fork();
    if (pid == 0) exec_rank(o, r, fds, old_mask);
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      std::fprintf(stderr, "fsdp-run: fork: %s\n", std::strerror(errno));
      signal_all(ranks, SIGKILL);
      return false;
    }
    ::setpgid(pid, pid);  // also here, so that a signal sent right away finds the group
    r.pid = pid;
    r.running = true;
    for (int s = 0; s < 2; ++s) {
      ::close(fds[s][1]);
      r.streams[s].fd = fds[s][0];
      r.streams[s].out = s == 0 ? 1 : 2;
      r.streams[s].prefix = o.no_prefix ? "" : "[r" + std::to_string(r.rank) + "] ";
    }
  }
  return true;
}

// Watches the running ranks until every one has exited and its output is drained: passes their
// lines on, stops the others when one fails or a signal arrives, and says how the job ended.
// Across hosts it also reports this node's first failure to the job's agent and stops this node's
// ranks when the agent hears of a failure elsewhere (or loses the store).
class Supervisor {
 public:
  Supervisor(std::vector<Rank>& ranks, const Options& o, JobAgent* agent)
      : ranks_(ranks), o_(o), agent_(agent) {}

  // The launcher's exit code.
  int run() {
    for (;;) {
      reap();
      bool any_running = false, any_open = false;
      for (const Rank& r : ranks_) {
        any_running |= r.running;
        for (const Stream& s : r.streams) any_open |= s.fd >= 0;
      }
      if (!any_running && !any_open) break;
      if (stopping_ && any_running && Clock::now() >= kill_at_) {
        signal_all(ranks_, SIGKILL);
        kill_at_ = Clock::now() + std::chrono::hours(1);
      }
      if (agent_ && !job_failure_ && agent_->silent_for() > o_.heartbeat_timeout) {
        store_lost_ = true;
        on_job_failure(Failure{0, 1,
                               "the job's store at " + o_.master_addr + ":" +
                                   std::to_string(o_.master_port) + " has not answered for " +
                                   std::to_string(static_cast<int>(agent_->silent_for())) +
                                   " s (node 0's host hung or unreachable?)"});
      }
      if (!pump(any_running)) {
        signal_all(ranks_, SIGKILL);
        return 2;
      }
    }
    if (agent_) settle_with_other_nodes();
    restart_ = may_restart();
    return outcome();
  }

  /// After run(): the job failed and may be restarted (--max-restarts not used up, no signal to
  /// fsdp-run, the job's store still there).
  bool restarting() const { return restart_; }
  /// After run(): the round ended in a failure (not a signal to fsdp-run, nor a membership
  /// change).
  bool failed() const {
    return (first_failed_ >= 0 || job_failure_) && forwarded_ == 0 && !membership_change();
  }
  /// After run(): the round was ended for a node waiting to join (elastic), not by a failure.
  /// The job's first posted event decides, on every node alike: ranks that failed after it (a
  /// peer stopped under them) do not make it a failure here.
  bool membership_change() const { return job_failure_ && job_failure_->membership_change; }

 private:
  // "rank 3 (local rank 1)" (with its pid: "rank 3 (local rank 1, pid 812)"), and
  // " on node 1 (host)" across hosts.
  std::string name(const Rank& r, bool with_pid) const {
    std::string s = "rank " + std::to_string(r.rank) + " (local rank " +
                    std::to_string(r.local_rank) +
                    (with_pid ? ", pid " + std::to_string(r.pid) : std::string()) + ")";
    if (agent_)
      s += " on node " + std::to_string(o_.node_rank) + " (" + JobAgent::host_name() + ")";
    return s;
  }

  // Sends `sig` to every rank still running; the first time, starts the grace period after which
  // the ones still running get SIGKILL.
  void stop_all(int sig) {
    signal_all(ranks_, sig);
    if (stopping_) return;
    stopping_ = true;
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace * 1000));
  }

  // Reaps whatever has exited; the first rank to fail stops the others.
  void reap() {
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (size_t i = 0; i < ranks_.size(); ++i) {
        Rank& r = ranks_[i];
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && first_failed_ < 0 && !stopping_) {
          first_failed_ = static_cast<int>(i);
          std::fprintf(stderr, "fsdp-run: %s %s; stopping the others\n", name(r, true).c_str(),
                       describe(status).c_str());
          if (agent_)
            agent_->report_failure(exit_code_of(status), name(r, false) + " " + describe(status));
          stop_all(SIGTERM);
        }
      }
    }
  }

  // A failure elsewhere in the job (or the store lost): this node's ranks stop too.
  void on_job_failure(const Failure& f) {
    if (job_failure_) return;
    job_failure_ = f;
    const bool ours = f.node == o_.node_rank && first_failed_ >= 0;
    if (ours || stopping_) return;
    std::fprintf(stderr, "fsdp-run: %s; stopping this node's ranks\n", f.what.c_str());
    stop_all(SIGTERM);
  }

  void read_agent() {
    const fsdp_run::AgentState st = agent_->state();
    if (st.failure) on_job_failure(*st.failure);
    store_lost_ |= st.store_lost;
    left_ = st.left;
    all_left_ = st.all_left;
    all_done_ = st.all_done;
  }

  // One poll over the signal pipe, the agent and the ranks' streams. False if poll itself fails.
  bool pump(bool any_running) {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
    fds.push_back({agent_ ? agent_->fd() : -1, POLLIN, 0});  // a negative fd is ignored
    std::vector<Stream*> of;
    for (Rank& r : ranks_)
      for (Stream& s : r.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          of.push_back(&s);
        }
    // Streams can stay open after their rank exited (a grandchild holding them): once every rank
    // is gone, give them a moment, then stop waiting.
    const int timeout_ms = !any_running ? 2000 : stopping_ ? 100 : 1000;
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      std::fprintf(stderr, "fsdp-run: poll: %s\n", std::strerror(errno));
      return false;
    }
    if (n == 0 && !any_running) {
      for (Stream* s : of) {
        ::close(s->fd);
        s->fd = -1;
      }
      return true;
    }
    if (n <= 0) return true;
    if (fds[0].revents & POLLIN) read_signals();
    if (fds[1].revents & POLLIN) read_agent();
    for (size_t k = 2; k < fds.size(); ++k)
      if (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) drain(*of[k - 2]);
    return true;
  }

  void read_signals() {
    unsigned char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (sig == SIGCHLD) continue;  // reaped at the top of the loop
      forwarded_ = sig;
      stop_all(sig);  // a rank that ignores it is killed after the grace period
    }
  }

  // Reads what `s` has and passes its complete lines on; closes it at its end.
  void drain(Stream& s) {
    const ssize_t got = ::read(s.fd, buf_, sizeof buf_);
    if (got < 0 && errno == EINTR) return;
    if (got <= 0) {
      flush_lines(s, true);
      ::close(s.fd);
      s.fd = -1;
      return;
    }
    s.pending.append(buf_, static_cast<size_t>(got));
    flush_lines(s, false);
  }

  // The round failed: here, elsewhere, or by a signal to this launcher.
  bool round_failed() const { return first_failed_ >= 0 || job_failure_ || forwarded_ != 0; }
  bool may_restart() const {
    if (forwarded_ != 0 || store_lost_) return false;
    return membership_change() ||
           ((first_failed_ >= 0 || job_failure_) && o_.restarts < o_.max_restarts);
  }

  // This node's ranks have all ended: tell the others, and learn how the round ended everywhere
  // (a node whose ranks all succeeded may still have to restart with the others). A failed round
  // ends for this node once it said it left (node 0, with no restart coming, once everyone has,
  // for at most 5 s); a successful one once every node's ranks have ended, and node 0, whose
  // process hosts the store, goes last (torchrun's exit barrier, at most 300 s).
  void settle_with_other_nodes() {
    read_agent();
    if (store_lost_) return;  // nobody to tell
    agent_->report_left();
    auto deadline = Clock::now() + std::chrono::seconds(300);
    bool short_wait = false;
    for (;;) {
      read_agent();
      if (store_lost_) return;
      const bool failed = round_failed();
      if (failed && !short_wait) {
        deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
        short_wait = true;
      }
      if (failed ? left_ && (o_.node_rank != 0 || may_restart() || all_left_)
                 : (o_.node_rank == 0 ? all_done_ : all_left_))
        return;
      if (Clock::now() >= deadline) break;
      pollfd fds[2] = {{g_signal_pipe[0], POLLIN, 0}, {agent_->fd(), POLLIN, 0}};
      if (::poll(fds, 2, 200) > 0 && (fds[0].revents & POLLIN)) read_signals();
    }
    if (!round_failed()) {
      std::fprintf(stderr,
                   "fsdp-run: node %d's ranks are done, but not every other node's ended within "
                   "300 s of them\n",
                   o_.node_rank);
      exit_barrier_timed_out_ = true;
    }
  }

  int outcome() const {
    if (membership_change()) return 1;  // the next round follows (said by main)
    const bool elsewhere =
        job_failure_ && !(job_failure_->node == o_.node_rank && first_failed_ >= 0);
    if (first_failed_ >= 0) {
      const Rank& r = ranks_[first_failed_];
      std::fprintf(stderr, "fsdp-run: failed: %s %s\n", name(r, false).c_str(),
                   describe(r.status).c_str());
      if (elsewhere)
        std::fprintf(stderr, "fsdp-run: the job's first failure: %s\n", job_failure_->what.c_str());
      const int code = elsewhere ? job_failure_->code : exit_code_of(r.status);
      return code != 0 ? code : 1;
    }
    if (job_failure_) {
      std::fprintf(stderr, "fsdp-run: failed: %s\n", job_failure_->what.c_str());
      return job_failure_->code != 0 ? job_failure_->code : 1;
    }
    if (forwarded_) {
      std::fprintf(stderr, "fsdp-run: stopped by signal %d\n", forwarded_);
      return 128 + forwarded_;
    }
    return exit_barrier_timed_out_ ? 1 : 0;
  }

  std::vector<Rank>& ranks_;
  const Options& o_;
  JobAgent* agent_;                     // null on a single node
  int first_failed_ = -1;               // index into ranks_
  int forwarded_ = 0;                   // a signal fsdp-run was sent and passed on
  std::optional<Failure> job_failure_;  // the job's first failure, from the agent
  bool left_ = false, all_left_ = false, all_done_ = false, exit_barrier_timed_out_ = false;
  bool store_lost_ = false, restart_ = false;
  bool stopping_ = false;
  Clock::time_point kill_at_{};
  char buf_[65536];
};

// Across hosts: waits, still answering signals, until every node's launcher has joined round
// o.round. Returns -1 to go on, else the exit code.
int await_round(Options& o, JobAgent& agent) {
  // The agent's own waits end at the join timeout (plus the last call, and node 0's own settling
  // before it forms a round); this bounds a store call that never returns (a store host stopped
  // after it began to listen).
  const double limit = o.join_timeout + (o.elastic() ? o.last_call_timeout : 0) + o.grace + 20;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(limit * 1000));
  for (;;) {
    if (Clock::now() >= deadline) {
      std::fprintf(stderr,
                   "fsdp-run: node %d: the job cannot start: the job's store at %s:%d did not "
                   "answer within --join-timeout (%g s)\n",
                   o.node_rank, o.master_addr.c_str(), o.master_port, o.join_timeout);
      return 2;
    }
    pollfd fds[2] = {{g_signal_pipe[0], POLLIN, 0}, {agent.fd(), POLLIN, 0}};
    if (::poll(fds, 2, 1000) < 0 && errno != EINTR) {
      std::fprintf(stderr, "fsdp-run: poll: %s\n", std::strerror(errno));
      return 2;
    }
    unsigned char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (sig == SIGCHLD) continue;
      std::fprintf(stderr, "fsdp-run: stopped by signal %d while waiting for the other nodes\n",
                   sig);
      agent.withdraw(std::chrono::seconds(2));  // this node's join taken back, as it goes
      return 128 + sig;
    }
    const fsdp_run::AgentState st = agent.state();
    if (st.join_error) {
      std::fprintf(stderr, "fsdp-run: node %d: the job cannot %s: %s\n", o.node_rank,
                   o.round == 0 ? "start" : "restart", st.join_error->c_str());
      return 2;
    }
    if (st.joined && st.round >= o.round) {
      o.run_id = st.run_id;  // every node hands its ranks node 0's
      o.round = st.round;    // later than asked where this node came too late for a round
      o.group_rank = st.group_rank;
      o.group_world = st.group_world;
      if (o.elastic())
        std::fprintf(stderr,
                     "fsdp-run: round %d formed with nodes %s (%d of --nnodes %s): node %d is "
                     "group rank %d, ranks %d-%d of %d\n",
                     o.round, st.members.c_str(), o.group_world, o.nnodes.c_str(), o.node_rank,
                     o.group_rank, o.group_rank * o.nproc, (o.group_rank + 1) * o.nproc - 1,
                     o.world());
      return -1;
    }
  }
}

// Across hosts: starts the agent (round 0) or asks it for the next round, and waits for it.
int join_job(Options& o, std::unique_ptr<JobAgent>& agent) {
  if (agent) {
    agent->next_round(o.round);
    return await_round(o, *agent);
  }
  AgentConfig c;
  c.min_nodes = o.min_nodes;
  c.max_nodes = o.max_nodes;
  c.last_call_timeout = o.last_call_timeout;
  c.node_rank = o.node_rank;
  c.nproc_per_node = o.nproc;
  c.master_addr = o.master_addr;
  c.master_port = o.master_port;
  c.join_timeout = o.join_timeout;
  c.heartbeat_timeout = o.heartbeat_timeout;
  c.max_restarts = o.max_restarts;
  try {
    agent = std::make_unique<JobAgent>(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-run: %s\n", e.what());
    return 2;
  }
  return await_round(o, *agent);
}

// Across hosts the agent's thread may be inside a store call when the launcher is done: leave
// without running static destructors under it.
[[noreturn]] void leave(int code) {
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (int code = parse_options(argc, argv, o); code >= 0) return code;
  if (int code = complete_options(o); code >= 0) return code;
  if (!install_signal_handlers()) return 2;
  std::unique_ptr<JobAgent> agent;
  for (;; ++o.round) {
    if (o.multi_node()) {
      if (int code = join_job(o, agent); code >= 0) leave(code);
    } else if (o.round > 0 && !o.port_chosen && (o.master_port = free_port()) < 0) {
      std::fprintf(stderr, "fsdp-run: could not find a free port: %s\n", std::strerror(errno));
      return 2;
    }
    if (o.round > 0 && agent && !o.elastic())
      std::fprintf(stderr, "fsdp-run: restart %d: every node has rejoined; starting the ranks\n",
                   o.round);
    std::vector<Rank> ranks;
    if (!start_ranks(o, ranks)) return 2;
    Supervisor supervisor(ranks, o, agent.get());
    const int code = supervisor.run();
    if (supervisor.restarting() && supervisor.membership_change()) {
      std::fprintf(stderr,
                   "fsdp-run: restarting every rank for the membership change (--max-restarts "
                   "does not count it), TORCHELASTIC_RESTART_COUNT=%d\n",
                   o.round + 1);
      continue;
    }
    if (supervisor.restarting()) {
      ++o.restarts;
      std::fprintf(stderr,
                   "fsdp-run: restarting every rank: restart %d of %d (--max-restarts), "
                   "TORCHELASTIC_RESTART_COUNT=%d\n",
                   o.restarts, o.max_restarts, o.round + 1);
      continue;
    }
    if (supervisor.failed() && o.max_restarts > 0 && o.restarts == o.max_restarts)
      std::fprintf(stderr, "fsdp-run: no restarts left (--max-restarts %d)\n", o.max_restarts);
    if (agent) leave(code);
    return code;
  }
}
