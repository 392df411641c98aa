#include "multi_rank.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "fsdp/errors.h"

namespace fsdp {
namespace testing {
namespace {

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

[[noreturn]] void child_main(int rank, int world, uint16_t port, int fd, const RankBody& body,
                             const RunOptions& opts) {
  // One intra-op thread per rank: ranks share two cores, and libgomp's pool does not survive fork.
  at::set_num_threads(1);
  ::setenv("FSDP_TEST_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  std::string msg;
  try {
    dist::ProcessGroup pg;
    if (opts.init_group) {
      auto store = compat::make_tcp_store("127.0.0.1", port, false, world, opts.collective_timeout);
      pg = dist::init_process_group(dist::InitOptions()
                                        .rank(rank)
                                        .world_size(world)
                                        .store(store)
                                        .timeout(opts.collective_timeout)
                                        .gloo_hostname("127.0.0.1"));
    }
    body(pg);
    if (::testing::Test::HasFailure()) {
      code = 1;
      msg = "GoogleTest assertion failed on this rank (see its output above)";
    }
    dist::destroy_process_group();
  } catch (const c10::Error& e) {
    code = 2;
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    code = 2;
    msg = e.what();
  } catch (...) {
    code = 3;
    msg = "unknown exception";
  }
  write_all(fd, msg);
  ::close(fd);
  std::fflush(stdout);
  std::fflush(stderr);
  // _exit: the child must not run the parent's atexit handlers or GoogleTest's teardown.
  ::_exit(code);
}

}  // namespace

at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

std::vector<RankResult> run_ranks(int world_size, const RankBody& body, const RunOptions& opts) {
  // The parent hosts the store, as torchrun's agent does; port 0 lets the OS pick a free port.
  auto server = compat::make_tcp_store("127.0.0.1", 0, true, world_size, opts.collective_timeout);
  const uint16_t port = server->getPort();
  std::fflush(stdout);
  std::fflush(stderr);

  struct Child {
    pid_t pid = -1;
    int fd = -1;
    bool done = false;
  };
  std::vector<Child> kids(world_size);
  std::vector<RankResult> results(world_size);
  for (int r = 0; r < world_size; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(fds[0]);
      child_main(r, world_size, port, fds[1], body, opts);
    }
    ::close(fds[1]);
    kids[r].pid = pid;
    kids[r].fd = fds[0];
    results[r].rank = r;
  }

  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto kill_at = start + opts.deadline;
  int remaining = world_size;
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < world_size; ++r) {
      if (kids[r].done) continue;
      int status = 0;
      pid_t got = ::waitpid(kids[r].pid, &status, WNOHANG);
      if (got != kids[r].pid) continue;
      progressed = true;
      kids[r].done = true;
      --remaining;
      std::string msg = read_all(kids[r].fd);
      ::close(kids[r].fd);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        results[r].ok = true;
      } else {
        if (WIFSIGNALED(status)) {
          msg = "terminated by signal " + std::to_string(WTERMSIG(status)) +
                (msg.empty() ? "" : ": " + msg);
        } else if (msg.empty()) {
          msg = "exited with status " + std::to_string(WEXITSTATUS(status));
        }
        results[r].message = msg;
        // The first failure starts the grace period for the others.
        kill_at = std::min(kill_at, clock::now() + opts.grace);
      }
    }
    if (remaining > 0 && clock::now() >= kill_at) {
      for (int r = 0; r < world_size; ++r) {
        if (kids[r].done) continue;
        ::kill(kids[r].pid, SIGKILL);
        ::waitpid(kids[r].pid, nullptr, 0);
        std::string msg = read_all(kids[r].fd);
        ::close(kids[r].fd);
        kids[r].done = true;
        --remaining;
        results[r].killed = true;
        results[r].message = "killed by the harness (deadline or another rank's failure)" +
                             (msg.empty() ? std::string() : ": " + msg);
      }
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (opts.report) {
    for (const auto& res : results) {
      if (!res.ok)
        ADD_FAILURE() << "rank " << res.rank << " of " << world_size << ": " << res.message;
    }
  }
  return results;
}

TempDir::TempDir() : owner_pid_(static_cast<int>(::getpid())) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/fsdp_test_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw std::runtime_error("TempDir: mkdtemp(" + tmpl + ") failed: " + std::strerror(errno));
  }
  path_ = buf.data();
}

TempDir::~TempDir() {
  if (static_cast<int>(::getpid()) != owner_pid_) return;  // a forked rank: the parent cleans up
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace testing
}  // namespace fsdp
