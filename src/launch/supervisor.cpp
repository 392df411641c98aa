// Starting this node's ranks and watching them: see supervisor.h. (fsdp-run's main, with the
// rounds across hosts, is tools/fsdp_run.cpp.)
//
// Each process gets torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
// TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE with a log directory (and
// OMP_NUM_THREADS=1 when unset and more than one process shares the node, as torchrun does), so
// fsdp::dist::init_process_group() needs no arguments; across hosts also FSDP_NODE_ADDR and
// FSDP_NODE_ADDR_WHY, the address its launcher chose for this node's ranks (node_address.h).
//
// When one process exits non-zero or dies of a signal, the others get SIGTERM and, after the
// grace period, SIGKILL; fsdp-run then names that rank and its status and exits non-zero (the
// rank's exit code, or 128 + the signal's number). SIGINT and SIGTERM sent to fsdp-run are
// forwarded to every process. If fsdp-run itself is killed, the kernel kills its processes
// (PR_SET_PDEATHSIG), so no rank is left waiting on a collective that will never complete.
#include "launch/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "util/net.h"

namespace fsdp_run {

namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct Rank {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream streams[2];
};

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (const Rank& r : ranks)
    if (r.running) ::kill(-r.pid, sig);  // its process group: the program and what it started
}

// In the forked child: becomes rank `r` with torchrun's environment and runs the program. Never
// returns.
// Signals arrive blocked (start_ranks): until the defaults are back, a SIGTERM meant for the rank
// would run fsdp-run's handler, which writes to fsdp-run's own signal pipe (inherited), so that
// fsdp-run took a stop of its ranks for a signal sent to itself and ended the job (found when
// --max-restarts did not restart 1 time in 5). Blocked, it stays pending and kills the rank.
[[noreturn]] void exec_rank(const Options& o, const RankLogs& logs, const Rank& r, int (&fds)[2][2],
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
  set("ROLE_NAME", o.role);
  set("ROLE_RANK", std::to_string(r.rank));
  set("ROLE_WORLD_SIZE", std::to_string(o.world()));
  set("MASTER_ADDR", o.store_host);
  set("MASTER_PORT", std::to_string(o.store_port));
  set("TORCHELASTIC_RUN_ID", o.run_id);
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(o.round));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
  // A launcher hosts the job's store (on one node, fsdp-run itself), and every rank is a client.
  set("TORCHELASTIC_USE_AGENT_STORE", "True");
  if (const std::string e = logs.error_file(r.local_rank); !e.empty())
    set("TORCHELASTIC_ERROR_FILE", e);
  if (!o.node_addr.empty()) {  // the address this node's ranks are reached by (node_address.h)
    set("FSDP_NODE_ADDR", o.node_addr);
    set("FSDP_NODE_ADDR_WHY", o.node_addr_why);
  }
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
bool start_ranks(const Options& o, const RankLogs& logs, std::vector<Rank>& ranks) {
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
    if (pid == 0) exec_rank(o, logs, r, fds, old_mask);
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
      Stream& st = r.streams[s];
      st.fd = fds[s][0];
      st.out = s + 1;
      st.console = logs.console(local, s + 1);
      st.prefix = o.no_prefix ? "" : "[r" + std::to_string(r.rank) + "] ";
      if (const std::string f = logs.file(local, s + 1); !f.empty()) {
        st.file = ::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (st.file < 0)
          std::fprintf(stderr, "fsdp-run: cannot write %s: %s\n", f.c_str(), std::strerror(errno));
      }
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
      if (agent_ && !job_failure_ && agent_->silent_for() > o_.lost_after) {
        store_lost_ = true;
        on_job_failure(Failure{0, 1,
                               "the job's store at " + o_.store_host + ":" +
                                   std::to_string(o_.store_port) + " has not answered for " +
                                   std::to_string(static_cast<int>(agent_->silent_for())) +
                                   " s (its host hung or unreachable?)"});
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
      s += " on node " + std::to_string(o_.node_rank) + " (" + fsdp::detail::host_name() + ")";
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
    hosts_store_ = st.hosts_store;
    left_ = st.left;
    all_left_ = st.all_left;
    all_done_ = st.all_done;
  }

  // One poll over the signal pipe, the agent and the ranks' streams. False if poll itself fails.
  bool pump(bool any_running) {
    std::vector<pollfd> fds{{signal_fd(), POLLIN, 0}};
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
        flush_lines(*s, true);
        close_stream(*s);
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
    while (::read(signal_fd(), &sig, 1) == 1) {
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
      close_stream(s);
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
  // ends for this node once it said it left (the store's host, with no restart coming, once
  // everyone has, for at most 5 s); a successful one once every node's ranks have ended, and the
  // store's host goes last (torchrun's exit barrier, at most 300 s).
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
      if (failed ? left_ && (!hosts_store_ || may_restart() || all_left_)
                 : (hosts_store_ ? all_done_ : all_left_))
        return;
      if (Clock::now() >= deadline) break;
      pollfd fds[2] = {{signal_fd(), POLLIN, 0}, {agent_->fd(), POLLIN, 0}};
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
  bool store_lost_ = false, restart_ = false, hosts_store_ = false;
  bool stopping_ = false;
  Clock::time_point kill_at_{};
  char buf_[65536];
};

}  // namespace

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

int signal_fd() { return g_signal_pipe[0]; }

RoundOutcome run_round(const Options& o, RankLogs& logs, JobAgent* agent) {
  RoundOutcome out;
  const bool first_logs = logs.run_dir().empty();
  if (const std::string why = logs.start_attempt(o.run_id, o.round, o.nproc); !why.empty()) {
    std::fprintf(stderr, "fsdp-run: log directory: %s\n", why.c_str());
    out.code = 2;
    return out;
  }
  if (first_logs && !logs.run_dir().empty())
    std::fprintf(stderr, "fsdp-run: log directory set to: %s\n", logs.run_dir().c_str());
  std::vector<Rank> ranks;
  if (!start_ranks(o, logs, ranks)) {
    out.code = 2;
    return out;
  }
  Supervisor supervisor(ranks, o, agent);
  out.code = supervisor.run();
  out.restarting = supervisor.restarting();
  out.membership_change = supervisor.membership_change();
  out.failed = supervisor.failed();
  return out;
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

}  // namespace fsdp_run
