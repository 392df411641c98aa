// One start of this node's ranks, watched until every one has ended: fsdp-run's core. Each rank
// gets torchrun's variables; its lines go out whole (rank_output.h); the first rank to fail stops
// the others (SIGTERM, then SIGKILL after --grace-period); signals to fsdp-run are passed on.
// Across hosts the rendezvous agent (rendezvous.h) carries this node's first failure to the others
// and theirs to this node, and the round ends on every node alike.
#pragma once

#include <string>

#include "launch/options.h"
#include "launch/rank_output.h"
#include "launch/rendezvous.h"

namespace fsdp_run {

/// Installs fsdp-run's handlers: SIGCHLD, SIGINT, SIGTERM and SIGHUP arrive as one byte each on
/// signal_fd(), so that a poll loop sees them; SIGPIPE is ignored. False (said why) on failure.
bool install_signal_handlers();
/// The read end of the signal pipe (non-blocking).
int signal_fd();

/// How one start of the ranks ended.
struct RoundOutcome {
  int code = 0;             // fsdp-run's exit code if it stops here
  bool restarting = false;  // the job failed and may start again (--max-restarts not used up, no
                            // signal to fsdp-run, the job's store still there), or a membership
                            // change (elastic) asks for the next round
  bool membership_change = false;  // the round was ended for a node waiting to join
  bool failed = false;             // it ended in a failure (not a signal to fsdp-run)
};

/// Starts this node's ranks for round o.round and watches them until all have ended, and, across
/// hosts (`agent` not null), until the other nodes agree on how the round ended. `logs` says
/// where their output goes.
RoundOutcome run_round(const Options& o, RankLogs& logs, JobAgent* agent);

/// "exited with code 3", "was killed by signal 9 (SIGKILL)".
std::string describe(int status);

}  // namespace fsdp_run
