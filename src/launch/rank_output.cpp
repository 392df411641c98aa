// Where the ranks' output goes: see rank_output.h.
#include "launch/rank_output.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "launch/options.h"

namespace fsdp_run {

void write_all(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone (closed pipe): nothing better to do
    done += static_cast<size_t>(n);
  }
}

void flush_lines(Stream& s, bool all) {
  size_t start = 0;
  std::string out, raw;
  for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1) {
    out += s.prefix + s.pending.substr(start, nl - start + 1);
    raw.append(s.pending, start, nl - start + 1);
  }
  s.pending.erase(0, start);
  if (all && !s.pending.empty()) {
    out += s.prefix + s.pending + "\n";
    raw += s.pending;
    s.pending.clear();
  }
  if (s.file >= 0 && !raw.empty()) write_all(s.file, raw);
  if (s.console && !out.empty()) write_all(s.out, out);
}

void close_stream(Stream& s) {
  if (s.fd >= 0) ::close(s.fd);
  if (s.file >= 0) ::close(s.file);
  s.fd = s.file = -1;
}

namespace {

// "3" into `all`, or "0:1,1:3" into `each` (checked by parse_options).
void parse_streams(const std::string& spec, int& all, std::map<int, int>& each) {
  if (spec.find(':') == std::string::npos) {
    all = std::atoi(spec.c_str());
    return;
  }
  for (size_t at = 0; at < spec.size();) {
    size_t comma = spec.find(',', at);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = spec.substr(at, comma - at);
    const size_t colon = item.find(':');
    each[std::atoi(item.substr(0, colon).c_str())] = std::atoi(item.substr(colon + 1).c_str());
    at = comma + 1;
  }
}

bool make_dir(const std::string& path, std::string& error) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (!ec) return true;
  error = "cannot create " + path + ": " + ec.message();
  return false;
}

// mkdtemp of `dir`/`prefix`XXXXXXXX (torchrun's tempfile.mkdtemp); empty, with `error`, if not.
std::string make_temp_dir(const std::string& dir, const std::string& prefix, std::string& error) {
  std::string name = dir + "/" + prefix + "XXXXXXXX";
  if (::mkdtemp(name.data()) == nullptr) {
    error = "cannot create a directory in " + dir + ": " + std::strerror(errno);
    return "";
  }
  return name;
}

}  // namespace

RankLogs::RankLogs(const Options& o) : root_(o.log_dir) {
  parse_streams(o.redirects, redirect_all_, redirect_each_);
  parse_streams(o.tee, tee_all_, tee_each_);
  for (size_t at = 0; at < o.local_ranks_filter.size();) {
    size_t comma = o.local_ranks_filter.find(',', at);
    if (comma == std::string::npos) comma = o.local_ranks_filter.size();
    filter_.insert(std::atoi(o.local_ranks_filter.substr(at, comma - at).c_str()));
    at = comma + 1;
  }
  const bool any = redirect_all_ || tee_all_ || !redirect_each_.empty() || !tee_each_.empty();
  enabled_ = !root_.empty() || any;
}

std::string RankLogs::start_attempt(const std::string& run_id, int restart, int nproc) {
  if (!enabled_) return "";
  std::string error;
  if (run_dir_.empty()) {
    if (root_.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      root_ = make_temp_dir(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "torchelastic_", error);
      if (root_.empty()) return error;
    } else if (!make_dir(root_, error)) {
      return error;
    }
    run_dir_ = make_temp_dir(root_, run_id + "_", error);
    if (run_dir_.empty()) return error;
  }
  attempt_dir_ = run_dir_ + "/attempt_" + std::to_string(restart);
  std::error_code ignored;
  std::filesystem::remove_all(attempt_dir_, ignored);  // as torchrun: an attempt's logs are its own
  if (!make_dir(attempt_dir_, error)) return error;
  for (int r = 0; r < nproc; ++r)
    if (!make_dir(attempt_dir_ + "/" + std::to_string(r), error)) return error;
  return "";
}

int RankLogs::redirect(int local_rank) const {
  auto it = redirect_each_.find(local_rank);
  return it != redirect_each_.end() ? it->second : redirect_all_;
}

int RankLogs::tee(int local_rank) const {
  auto it = tee_each_.find(local_rank);
  return it != tee_each_.end() ? it->second : tee_all_;
}

std::string RankLogs::file(int local_rank, int stream) const {
  if (attempt_dir_.empty() || !((redirect(local_rank) | tee(local_rank)) & stream)) return "";
  return attempt_dir_ + "/" + std::to_string(local_rank) +
         (stream == 1 ? "/stdout.log" : "/stderr.log");
}

bool RankLogs::console(int local_rank, int stream) const {
  if (!filter_.empty() && filter_.count(local_rank) == 0) return false;
  // Redirected (and not teed): to its file only.
  return !(redirect(local_rank) & stream) || (tee(local_rank) & stream);
}

std::string RankLogs::error_file(int local_rank) const {
  if (attempt_dir_.empty()) return "";
  return attempt_dir_ + "/" + std::to_string(local_rank) + "/error.json";
}

}  // namespace fsdp_run
