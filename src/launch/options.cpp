// fsdp-run's command line: see options.h.
#include "launch/options.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "launch/rendezvous.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fsdp_run {

namespace {

// "N" or "MIN:MAX" into o.min_nodes and o.max_nodes; false if it is neither.
bool parse_nnodes(Options& o) {
  const std::string& s = o.nnodes;
  const size_t colon = s.find(':');
  auto number = [](const std::string& t, int& out) {
    if (t.empty() || t.size() > 7 || t.find_first_not_of("0123456789") != std::string::npos)
      return false;
    out = std::stoi(t);
    return out >= 1;
  };
  if (colon == std::string::npos) {
    if (!number(s, o.min_nodes)) return false;
    o.max_nodes = o.min_nodes;
    return true;
  }
  return number(s.substr(0, colon), o.min_nodes) && number(s.substr(colon + 1), o.max_nodes) &&
         o.min_nodes <= o.max_nodes;
}

}  // namespace

int parse_options(int argc, char** argv, Options& o) {
  CLI::App app{
      "fsdp-run: start one process per rank on this node, as torchrun does.\n"
      "Usage: fsdp-run [OPTIONS] PROGRAM [ARGS...]",
      "fsdp-run"};
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc, "Processes on this node")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", o.nnodes,
                 "Nodes taking part (each runs fsdp-run): N, or MIN:MAX to go on with fewer "
                 "after a node is lost, and take one back when it returns");
  app.add_option("--node-rank,--node_rank", o.node_rank,
                 "This node's index, 0 .. nnodes-1 (MAX-1); node 0 hosts the job's store")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "One node: rank 0's host (runs the TCPStore); several: node 0's host, whose "
                 "fsdp-run hosts the job's TCPStore");
  app.add_option("--master-port,--master_port", o.master_port,
                 "Port of the TCPStore (default: a free one on a single node, else 29500)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--grace-period", o.grace,
                 "Seconds between SIGTERM and SIGKILL when stopping the other ranks")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "Restart every rank (on every node) after a failure, at most this many times")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--join-timeout", o.join_timeout,
                 "Across hosts: seconds to wait for every node's fsdp-run to join (default 600)")
      ->check(CLI::Range(0.1, 86400.0));
  app.add_option("--heartbeat-timeout", o.heartbeat_timeout,
                 "Across hosts: seconds after which a node whose fsdp-run is silent is lost "
                 "(default 30)")
      ->check(CLI::Range(1.0, 86400.0));
  app.add_option("--last-call-timeout", o.last_call_timeout,
                 "With --nnodes MIN:MAX: seconds a round waits for more nodes once MIN have "
                 "joined (default 30)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_flag("--no-prefix", o.no_prefix, "Pass output through without \"[rN] \" prefixes");
  app.prefix_command();  // everything from PROGRAM on belongs to PROGRAM
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "fsdp-run: %s (see fsdp-run --help)\n", e.what());
    return 2;
  }
  o.command = app.remaining();
  if (o.command.empty()) {
    std::fprintf(stderr, "fsdp-run: no PROGRAM given (see fsdp-run --help)\n");
    return 2;
  }
  if (o.command[0] == "--") {
    o.command.erase(o.command.begin());
  } else if (o.command[0].size() > 1 && o.command[0][0] == '-') {
    std::fprintf(stderr, "fsdp-run: unknown option %s (see fsdp-run --help)\n",
                 o.command[0].c_str());
    return 2;
  }
  if (o.command.empty()) {
    std::fprintf(stderr, "fsdp-run: no PROGRAM given after --\n");
    return 2;
  }
  if (!parse_nnodes(o)) {
    std::fprintf(stderr,
                 "fsdp-run: --nnodes %s: expected N or MIN:MAX with 1 <= MIN <= MAX (see "
                 "fsdp-run --help)\n",
                 o.nnodes.c_str());
    return 2;
  }
  if (o.node_rank >= o.max_nodes) {
    std::fprintf(stderr, "fsdp-run: --node-rank %d is not below %s--nnodes %s\n", o.node_rank,
                 o.elastic() ? "MAX of " : "", o.nnodes.c_str());
    return 2;
  }
  o.group_rank = o.node_rank;
  o.group_world = o.max_nodes;
  return -1;
}

int complete_options(Options& o) {
  o.port_chosen = o.master_port != 0;
  if (o.master_port == 0) {
    if (o.multi_node()) {
      o.master_port = 29500;  // every node must agree on it without talking: torchrun's default
    } else if ((o.master_port = free_port()) < 0) {
      std::fprintf(stderr, "fsdp-run: could not find a free port: %s\n", std::strerror(errno));
      return 2;
    }
  }
  o.set_omp = o.nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
  if (o.set_omp)
    std::fprintf(stderr,
                 "fsdp-run: setting OMP_NUM_THREADS=1 for each process (as torchrun does); set it "
                 "yourself to override\n");
  o.run_id = fsdp_run::new_run_id();
  return -1;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

}  // namespace fsdp_run
