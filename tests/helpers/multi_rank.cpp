#include "multi_rank.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ftw.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "fsdp/compat_backends.h"
#include "fsdp/errors.h"

// Built with AddressSanitizer (-DFSDP_SANITIZE=address,...): ranks check for leaks themselves,
// since they leave by _exit, which skips LeakSanitizer's check at exit.
#include "sanitizers.h"
#if FSDP_TEST_ASAN
#include <sanitizer/lsan_interface.h>
#endif

namespace fsdp {
namespace testing {

std::string test_backend() {
  const char* b = std::getenv("FSDP_TEST_BACKEND");
  return b != nullptr && *b != '\0' ? b : "gloo";
}

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

[[noreturn]] void child_main(int rank, int world, uint16_t port, int fd, int go_fd,
                             const RankBody& body, const RunOptions& opts) {
  // Wait for the parent's store to be up (see run_ranks); EOF means the parent gave up on us.
  char go = 0;
  if (::read(go_fd, &go, 1) != 1) ::_exit(4);
  ::close(go_fd);
  // One intra-op thread per rank: ranks share two cores, and libgomp's pool does not survive fork.
  at::set_num_threads(1);
  ::setenv("FSDP_TEST_RANK", std::to_string(rank).c_str(), 1);
  // The harness's store, already listening: a body that initialises on its own can use it rather
  // than have rank 0 bind a port picked earlier, which another socket may take first.
  ::setenv("FSDP_TEST_STORE_PORT", std::to_string(port).c_str(), 1);
  int code = 0;
  std::string msg;
  try {
    const std::string backend = test_backend();
    if (backend == "nccl" && std::getenv("NCCL_HOSTID") == nullptr) {
      // NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless they seem to be on
      // different hosts; then they talk over NCCL's socket transport. Lets the suite run over
      // NCCL on a machine with a single GPU (scripts/gpu-check.sh).
      ::setenv("NCCL_HOSTID", ("fsdp-test-rank-" + std::to_string(rank)).c_str(), 1);
    }
    dist::ProcessGroup pg;
    if (opts.init_group) {
      auto store = compat::make_tcp_store("127.0.0.1", port, false, world, opts.collective_timeout);
      pg = dist::init_process_group(dist::InitOptions()
                                        .backend(backend)
                                        .rank(rank)
                                        .world_size(world)
                                        .store(store)
                                        .timeout(opts.collective_timeout)
                                        .gloo_hostname("127.0.0.1")
                                        .gloo_threads(opts.gloo_threads));
    }
    body(pg);
    if (pg.is_member() && pg.backend_name() == "nccl") {
      // NCCL completes a collective on one rank before its peer has all the data; a rank that
      // exits at once can cut its peer off ("remote process exiting prematurely"). All leave
      // together, as PyTorch recommends before destroy_process_group.
      try {
        torch::cuda::synchronize();  // collectives of sub-groups (HYBRID_SHARD) included
        pg.barrier();
      } catch (...) {
      }
    }
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
#if FSDP_TEST_ASAN
  if (code == 0 && __lsan_do_recoverable_leak_check() != 0) {
    code = 5;
    msg = "LeakSanitizer found leaks on this rank (its report is above)";
  }
#endif
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

uint16_t free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(s);
    throw std::runtime_error("cannot find a free port");
  }
  ::close(s);
  return ntohs(addr.sin_port);
}

namespace {

struct Child {
  pid_t pid = -1;
  int fd = -1;
  bool done = false;
};

}  // namespace

std::vector<RankResult> run_ranks(int world_size, const RankBody& body, const RunOptions& opts) {
  // The parent hosts the store, as torchrun's agent does, but starts it only after forking every
  // rank: a store server runs a background thread, and a child forked while that thread holds a
  // lock can block on it forever (seen with LibTorch 2.6: now and then the last rank hung in
  // init_process_group and the others timed out). The ranks' clients retry connecting until the
  // server is up. If another process took the port meanwhile, the ranks are killed and started
  // again on another.
  std::fflush(stdout);
  std::fflush(stderr);
  c10::intrusive_ptr<c10d::TCPStore> server;
  std::vector<Child> kids(world_size);
  std::vector<RankResult> results(world_size);
  for (int attempt = 0; !server; ++attempt) {
    const uint16_t port = free_port();
    std::vector<int> go(world_size, -1);
    for (int r = 0; r < world_size; ++r) {
      int fds[2], gfd[2];
      if (::pipe(fds) != 0 || ::pipe(gfd) != 0) throw std::runtime_error("pipe failed");
      pid_t pid = ::fork();
      if (pid < 0) throw std::runtime_error("fork failed");
      if (pid == 0) {
        ::close(fds[0]);
        ::close(gfd[1]);
        for (int q = 0; q < r; ++q) ::close(go[q]);
        child_main(r, world_size, port, fds[1], gfd[0], body, opts);
      }
      ::close(fds[1]);
      ::close(gfd[0]);
      go[r] = gfd[1];
      kids[r] = Child{pid, fds[0], false};
      results[r].rank = r;
    }
    std::string failure;
    try {
      server = compat::make_tcp_store("127.0.0.1", port, true, world_size, opts.collective_timeout);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    for (int r = 0; r < world_size; ++r) {
      if (server) write_all(go[r], "g");
      ::close(go[r]);  // without the byte: the child exits
    }
    if (!server) {
      for (auto& k : kids) {
        ::waitpid(k.pid, nullptr, 0);
        ::close(k.fd);
      }
      if (attempt == 4) throw std::runtime_error("run_ranks: cannot host the store: " + failure);
    }
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

TempDir::TempDir()
    : TempDir([] {
        const char* base = std::getenv("TMPDIR");
        return std::string(base && *base ? base : "/tmp");
      }()) {}

TempDir::TempDir(const std::string& base) : owner_pid_(static_cast<int>(::getpid())) {
  std::string tmpl = base + "/fsdp_test_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw std::runtime_error("TempDir: mkdtemp(" + tmpl + ") failed: " + std::strerror(errno));
  }
  path_ = buf.data();
}

TempDir::~TempDir() {
  if (static_cast<int>(::getpid()) != owner_pid_) return;  // a forked rank: the parent cleans up
  // nftw rather than std::filesystem::remove_all: the latter crashed the test programs built
  // against the CUDA wheel's LibTorch on the GPU machine (libstdc++ of another ABI); plain POSIX
  // works wherever the tests do.
  auto remove_entry = [](const char* p, const struct stat*, int, struct FTW*) {
    ::remove(p);
    return 0;
  };
  ::nftw(path_.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

dist::ProcessGroup init_as_hosts(int world, int per_host, std::optional<bool> host_aware,
                                 int (*local_rank_of)(int rank, int per_host),
                                 std::chrono::milliseconds timeout) {
  const char* rank_var = std::getenv("FSDP_TEST_RANK");
  const char* store_port = std::getenv("FSDP_TEST_STORE_PORT");
  if (rank_var == nullptr || store_port == nullptr)
    throw std::runtime_error("init_as_hosts runs under run_ranks only");
  const int rank = std::atoi(rank_var);
  const int local = local_rank_of ? local_rank_of(rank, per_host) : rank % per_host;
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(per_host).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", store_port, 1);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  auto opts = dist::InitOptions().timeout(timeout).gloo_hostname("127.0.0.1");
  if (host_aware) opts.host_aware(*host_aware);
  return dist::init_process_group(opts);
}

}  // namespace testing
}  // namespace fsdp
