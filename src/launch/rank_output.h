// Where the ranks' output goes: whole lines to the console, prefixed "[r<rank>] ", and, with
// torchrun's --log-dir / --redirects / --tee, into per-rank files laid out as torchrun lays them
// out:
//
//   <log dir>/<run id>_<8 random characters>/attempt_<restart>/<local rank>/stdout.log
//                                                                          /stderr.log
//                                                                          /error.json
//
// (error.json is TORCHELASTIC_ERROR_FILE, for a program that records its failure there.)
// --redirects sends a stream to its file only, --tee to its file and the console; either takes
// 0 (none), 1 (stdout), 2 (stderr), 3 (both), or a value per local rank ("0:1,1:3").
// --local-ranks-filter 0,1 keeps the other local ranks off the console (their files still get
// everything). Without --log-dir, a redirect or tee writes under a new torchelastic_XXXXXXXX in
// the temporary directory, as torchrun's does.
#pragma once

#include <map>
#include <set>
#include <string>

namespace fsdp_run {

struct Options;

/// One output stream of one rank: bytes read so far that do not end a line yet, and where its
/// lines go.
struct Stream {
  int fd = -1;          // read end; -1 once closed
  int out = 1;          // the console stream its lines go to (1 or 2)
  bool console = true;  // whether they go there
  std::string prefix;   // "[rN] ", or "" with --no-prefix
  int file = -1;        // its log file, or -1
  std::string pending;
};

/// Passes `s`'s complete lines on (with `all`, the last partial one too).
void flush_lines(Stream& s, bool all);

/// Closes the stream's pipe and file.
void close_stream(Stream& s);

/// Writes all of `s` to `fd` (one write per line keeps lines from different ranks whole).
void write_all(int fd, const std::string& s);

/// torchrun's log layout for one launcher (see above).
class RankLogs {
 public:
  /// From --log-dir, --redirects, --tee and --local-ranks-filter (already checked).
  explicit RankLogs(const Options& o);

  /// Whether any file is written at all.
  bool enabled() const { return enabled_; }

  /// Before each start of the ranks: makes attempt_<restart>/<local rank>/ for `nproc` ranks
  /// (the run's directory the first time). Empty, or why it could not.
  std::string start_attempt(const std::string& run_id, int restart, int nproc);

  /// The log file of `stream` (1 stdout, 2 stderr) of `local_rank`, or empty when it has none.
  std::string file(int local_rank, int stream) const;
  /// Whether `stream` of `local_rank` goes to the console.
  bool console(int local_rank, int stream) const;
  /// TORCHELASTIC_ERROR_FILE for `local_rank`, or empty.
  std::string error_file(int local_rank) const;

  const std::string& run_dir() const { return run_dir_; }

 private:
  int redirect(int local_rank) const;
  int tee(int local_rank) const;

  bool enabled_ = false;
  std::string root_, run_dir_, attempt_dir_;
  int redirect_all_ = 0, tee_all_ = 0;
  std::map<int, int> redirect_each_, tee_each_;
  std::set<int> filter_;  // empty: every local rank on the console
};

}  // namespace fsdp_run
