// Running the project's programs as a user runs them, for tests of fsdp-ckpt, fsdp-run and
// fsdp-train: a shell command's combined output, exit status and wall time, or a command left
// running in the background to be signalled.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fsdp {
namespace testing {

struct CommandResult {
  int rc = -1;      // exit code, or 128 + signal
  std::string out;  // stdout and stderr together
  double seconds = 0;
};

inline int exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/// Runs `cmd` through /bin/sh, stderr merged into stdout.
inline CommandResult run_shell(const std::string& cmd) {
  CommandResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(("( " + cmd + " ) 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.rc = exit_code(pclose(p));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

/// `cmd` running in the background (exec'd by /bin/sh, so pid() is the command itself), its
/// output going to `log`.
class Background {
 public:
  Background(const std::string& cmd, const std::string& log) : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string line = "exec " + cmd + " > '" + log + "' 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  /// The direct children of the command (e.g. the ranks fsdp-run started), oldest first.
  std::vector<pid_t> children() const {
    std::vector<pid_t> out;
    const std::string path =
        "/proc/" + std::to_string(pid_) + "/task/" + std::to_string(pid_) + "/children";
    std::ifstream f(path);
    for (pid_t c; f >> c;) out.push_back(c);
    return out;
  }
  /// Waits up to `limit` for the command to end; its exit code, or -1 if it is still running.
  int wait(std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        done_ = true;
        return exit_code(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }
  std::string output() const {
    std::ifstream f(log_);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool done_ = false;
};

/// Lines of `text` that contain `needle`.
inline int count_lines_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

}  // namespace testing
}  // namespace fsdp
