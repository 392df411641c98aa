// fsdp-run's multi-host agent: see rendezvous.h. The thread's work is AgentLoop (agent_loop.h);
// this file holds the launcher's side and the encodings both use.
#include "launch/rendezvous.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "launch/agent_loop.h"

namespace fsdp_run {

namespace agent {

std::string encode(const Failure& f) {
  return std::to_string(f.node) + "\n" + std::to_string(f.code) + "\n" +
         (f.membership_change ? "membership" : "failure") + "\n" + f.what;
}

Failure decode(const std::string& s) {
  Failure f;
  size_t at[3];
  for (int i = 0; i < 3; ++i) {
    at[i] = s.find('\n', i == 0 ? 0 : at[i - 1] + 1);
    if (at[i] == std::string::npos) {
      f.what = s;
      return f;
    }
  }
  try {
    f.node = std::stoi(s.substr(0, at[0]));
    f.code = std::stoi(s.substr(at[0] + 1, at[1] - at[0] - 1));
  } catch (const std::exception&) {
    f.code = 1;
  }
  f.membership_change = s.compare(at[1] + 1, at[2] - at[1] - 1, "membership") == 0;
  f.what = s.substr(at[2] + 1);
  return f;
}

std::string nnodes_text(const AgentConfig& c) {
  return c.elastic() ? std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes)
                     : std::to_string(c.max_nodes);
}

std::string join_list(const std::vector<int>& v) {
  std::string s;
  for (int i : v) s += (s.empty() ? "" : ",") + std::to_string(i);
  return s;
}

std::vector<int> split_list(const std::string& s) {
  std::vector<int> v;
  for (size_t at = 0; at < s.size();) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    v.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return v;
}

}  // namespace agent

std::string new_run_id() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

JobAgent::JobAgent(const AgentConfig& config) : shared_(std::make_shared<Shared>(config)) {
  if (::pipe2(shared_->pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  std::thread([s = shared_] {
    AgentLoop(s).run();
    std::lock_guard<std::mutex> lock(s->mu);
    s->finished = true;
    s->cv.notify_all();
  }).detach();
}

JobAgent::~JobAgent() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
}

int JobAgent::fd() const { return shared_->pipe[0]; }

AgentState JobAgent::state() {
  char buf[64];
  while (::read(shared_->pipe[0], buf, sizeof buf) > 0) {
  }
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->state;
}

void JobAgent::report_failure(int code, const std::string& what) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (!shared_->to_post) shared_->to_post = Failure{shared_->state.node_rank, code, what};
  shared_->cv.notify_all();
}

void JobAgent::next_round(int round) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->next_round = round;
  shared_->state.joined = false;
  shared_->cv.notify_all();
}

void JobAgent::withdraw(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
  shared_->cv.wait_for(lock, limit, [&] { return shared_->finished; });
}

void JobAgent::report_left() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->to_leave = true;
  shared_->cv.notify_all();
}

double JobAgent::silent_for() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->last_heard == agent::Clock::time_point{}) return 0;
  return agent::Seconds(agent::Clock::now() - shared_->last_heard).count();
}

}  // namespace fsdp_run
