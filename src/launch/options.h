// fsdp-run's command line: torchrun's options, in both spellings (--nproc-per-node and
// --nproc_per_node), each also read from torchrun's PET_<NAME> variable when not given (as
// torchrun does: PET_NPROC_PER_NODE=2), plus fsdp-run's own; parsed, checked and completed
// (src/launch/supervisor.cpp runs what they ask for). docs/running.md maps every torchrun option to
// what fsdp-run does with it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "launch/rendezvous.h"

namespace fsdp_run {

/// The keys of torchrun's --rdzv-conf that fsdp-run honours (seconds unless said otherwise), with
/// torchrun's defaults.
struct RdzvConf {
  double join_timeout = 600;      // every node must have joined a round by then
  double last_call_timeout = 30;  // elastic: once MIN nodes joined, how long a round waits for more
  double close_timeout = 30;      // how long the store's host waits for the others at a failed join
  double read_timeout = 60;       // c10d's store timeout: a store call that waits for a key
  double timeout = 0;             // static rendezvous' name for the join timeout (0: not given)
  double keep_alive_interval = 5;  // a launcher's heartbeat, this often
  int keep_alive_max_attempt = 3;  // missed heartbeats before a launcher is lost
  std::optional<bool> is_host;     // c10d: this launcher hosts the store (default: when
                                   // --rdzv-endpoint names this machine)
};

/// What the command line asks for (the torchrun groups first, then fsdp-run's own), and what
/// complete_options() derives from it.
struct Options {
  // Worker/node size.
  std::string nnodes = "1";          // N, or MIN:MAX (elastic)
  int min_nodes = 1, max_nodes = 1;  // parsed from it
  std::string nproc_per_node = "1";  // N, auto, cpu or gpu
  int nproc = 1;                     // resolved from it

  // Rendezvous.
  std::string rdzv_backend = "static";  // static (--master-addr) or c10d (--rdzv-endpoint)
  std::string rdzv_endpoint;            // HOST[:PORT]
  std::string rdzv_id = "none";
  std::string rdzv_conf;  // as given; parsed into conf
  RdzvConf conf;
  bool standalone = false;

  // User-code launch.
  int max_restarts = 0;
  double monitor_interval = 0.1;  // accepted: fsdp-run wakes on every event instead
  std::string start_method = "spawn";
  std::string role = "default";  // ROLE_NAME
  bool no_python = false;        // what fsdp-run always does
  std::string log_dir;
  std::string redirects = "0", tee = "0";  // 0-3, or "LOCAL_RANK:0-3,..."
  std::string local_ranks_filter;          // "0,1": only these local ranks on the console

  // Compatible with torch.distributed.launch.
  int node_rank = -1;  // -1: not given (static: 0; c10d: the rendezvous assigns one)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: not given
  std::string local_addr;

  // fsdp-run's own.
  double grace = 5.0;
  double heartbeat_timeout = 0;  // 0: keep_alive_interval x keep_alive_max_attempt
  double status_interval = 30;
  bool no_prefix = false;
  std::vector<std::string> command;  // PROGRAM [ARGS...]

  // Derived by complete_options().
  std::string store_host;  // the job's store (several nodes), or rank 0's (one node)
  int store_port = 0;
  bool port_chosen = false;  // the store's port was given (one node: else the kernel picks it)
  double lost_after = 15;    // a launcher silent this long is lost
  double keep_alive = 5;     // the heartbeat's period
  bool set_omp = false;      // OMP_NUM_THREADS=1 for each rank, as torchrun does
  bool gloo_address_given = false;  // GLOO_SOCKET_IFNAME or FSDP_GLOO_HOSTNAME in the environment
  std::string run_id;               // TORCHELASTIC_RUN_ID

  // The state of the job as it runs.
  int round = 0;     // TORCHELASTIC_RESTART_COUNT: every start of the ranks after the first
  int restarts = 0;  // of those, the ones after a failure (--max-restarts counts these)
  int group_rank = 0, group_world = 1;   // this node's place in the round, and its node count
  std::string node_addr, node_addr_why;  // across hosts: the address this node's ranks bind

  bool c10d() const { return rdzv_backend == "c10d"; }
  bool multi_node() const { return max_nodes > 1; }
  bool elastic() const { return min_nodes < max_nodes; }
  int world() const { return nproc * group_world; }
};

/// Parses the command line into `o` and checks it. Returns -1 to go on, else the exit code
/// (--help, bad usage), having printed the one line that says why.
int parse_options(int argc, char** argv, Options& o);

/// The settings parse_options leaves open: the number of processes for auto/cpu/gpu, the job's
/// store, the heartbeat, OMP_NUM_THREADS, the run id. Returns -1 to go on, else the exit code.
int complete_options(Options& o);

/// The rendezvous agent's settings for a job across hosts: who hosts the store (static: node 0;
/// c10d: is_host, else the launcher on the machine --rdzv-endpoint names, unless its port is
/// taken), the timeouts and heartbeat, the job's id.
AgentConfig agent_config(const Options& o);

/// How many NVIDIA GPUs this process may use (the CUDA driver's count, which honours
/// CUDA_VISIBLE_DEVICES); 0 without a driver. fsdp-run links no CUDA: the driver is loaded here
/// only to count.
int gpu_count();

/// The option among `known` nearest to `given` (edit distance), for "did you mean"; empty when
/// none is near.
std::string nearest(const std::string& given, const std::vector<std::string>& known);

}  // namespace fsdp_run
