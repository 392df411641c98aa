// fsdp-run's command line: what it asks for, parsed and completed (src/launch/supervisor.cpp).
#pragma once

#include <string>
#include <vector>

namespace fsdp_run {

/// What the command line asks for.
struct Options {
  int nproc = 1, node_rank = 0, master_port = 0;
  std::string nnodes = "1";         // as given: N, or MIN:MAX (elastic)
  int min_nodes = 1, max_nodes = 1;  // parsed from it
  std::string master_addr = "127.0.0.1";
  double grace = 5.0;
  double join_timeout = 600, heartbeat_timeout = 30;  // across hosts (rendezvous.h)
  double last_call_timeout = 30;                      // elastic (rendezvous.h)
  int max_restarts = 0;                               // torchrun's --max-restarts
  bool port_chosen = false;                           // --master-port given (else ours, per round)
  int round = 0;     // TORCHELASTIC_RESTART_COUNT: every start of the ranks after the first
  int restarts = 0;  // of those, the ones after a failure (--max-restarts counts these)
  int group_rank = 0, group_world = 1;  // this node's place in the round, and its node count
  bool no_prefix = false;
  std::vector<std::string> command;  // PROGRAM [ARGS...]
  bool set_omp = false;              // OMP_NUM_THREADS=1 for each rank, as torchrun does
  std::string run_id;                // TORCHELASTIC_RUN_ID
  bool multi_node() const { return max_nodes > 1; }
  bool elastic() const { return min_nodes < max_nodes; }
  int world() const { return nproc * group_world; }
};

/// Parses the command line into `o`. Returns -1 to go on, else the exit code (--help, bad usage),
/// having printed the one line that says why.
int parse_options(int argc, char** argv, Options& o);

/// The settings parse_options leaves open: the port, OMP_NUM_THREADS, the run id. Returns -1 to
/// go on, else the exit code.
int complete_options(Options& o);

/// A TCP port nothing listens on now (the kernel's pick), for a single-node run's store; -1 with
/// errno set if there is none.
int free_port();

}  // namespace fsdp_run
