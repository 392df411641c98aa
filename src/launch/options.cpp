// fsdp-run's command line: see options.h.
#include "launch/options.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include "launch/rendezvous.h"
#include "util/net.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>

namespace fsdp_run {

namespace {

// torchrun reads each option from PET_<DEST> when it is not given: the same names here.
std::string pet(std::string dest) {
  for (char& c : dest) c = c == '-' ? '_' : static_cast<char>(std::toupper(c));
  return "PET_" + dest;
}

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

int usage(const std::string& why) {
  std::fprintf(stderr, "fsdp-run: %s (see fsdp-run --help)\n", why.c_str());
  return 2;
}

// torchrun's get_as_bool spellings.
std::optional<bool> parse_bool(std::string v) {
  for (char& c : v) c = static_cast<char>(std::tolower(c));
  if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y") return true;
  if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n") return false;
  return std::nullopt;
}

// --rdzv-conf "key=value,key=value" into o.conf; an error message, or empty.
std::string parse_rdzv_conf(const std::string& text, RdzvConf& c) {
  static const std::vector<std::string> keys = {
      "join_timeout",        "last_call_timeout",      "close_timeout", "read_timeout", "timeout",
      "keep_alive_interval", "keep_alive_max_attempt", "is_host",       "store_type"};
  std::string item;
  for (size_t at = 0; at <= text.size(); at += item.size() + 1) {
    item = text.substr(at, text.find(',', at) - at);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq),
                      value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      const std::string near = nearest(key, keys);
      return "--rdzv-conf: unknown key '" + key + "'" +
             (near.empty() ? "" : " (did you mean " + near + "?)") + "; fsdp-run knows " +
             "join_timeout, last_call_timeout, close_timeout, read_timeout, timeout, " +
             "keep_alive_interval, keep_alive_max_attempt, is_host and store_type";
    }
    if (key == "is_host") {
      c.is_host = parse_bool(value);
      if (!c.is_host) return "--rdzv-conf: is_host=" + value + " is not a boolean";
      continue;
    }
    if (key == "store_type") {
      if (value != "tcp")
        return "--rdzv-conf: store_type=" + value + ": fsdp-run's rendezvous store is c10d's " +
               "TCPStore (store_type=tcp)";
      continue;
    }
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(v > 0) || v > 1e7)
      return "--rdzv-conf: " + key + "=" + value + " is not a positive number";
    if (key == "keep_alive_max_attempt") {
      if (v != static_cast<int>(v)) return "--rdzv-conf: keep_alive_max_attempt must be whole";
      c.keep_alive_max_attempt = static_cast<int>(v);
    }
    double* field = key == "join_timeout"          ? &c.join_timeout
                    : key == "last_call_timeout"   ? &c.last_call_timeout
                    : key == "close_timeout"       ? &c.close_timeout
                    : key == "read_timeout"        ? &c.read_timeout
                    : key == "timeout"             ? &c.timeout
                    : key == "keep_alive_interval" ? &c.keep_alive_interval
                                                   : nullptr;
    if (field != nullptr) *field = v;
  }
  return "";
}

// The options of fsdp-run's own that name a --rdzv-conf key too: the flag wins where both agree.
struct Aliases {
  double join_timeout = 0, last_call_timeout = 0;
};

void add_size_options(CLI::App& app, Options& o) {
  const char* g = "Worker/node size (torchrun's)";
  app.add_option("--nnodes", o.nnodes,
                 "Nodes taking part (each runs fsdp-run): N, or MIN:MAX to go on with fewer "
                 "after a node is lost, and take one back when it returns")
      ->envname(pet("nnodes"))
      ->group(g);
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Processes on this node: N, auto (one per GPU, else per CPU), cpu or gpu")
      ->envname(pet("nproc_per_node"))
      ->group(g);
}

void add_rendezvous_options(CLI::App& app, Options& o) {
  const char* g = "Rendezvous (torchrun's)";
  app.add_option("--rdzv-backend,--rdzv_backend", o.rdzv_backend,
                 "static: the store at --master-addr:--master-port, hosted by node 0's fsdp-run; "
                 "c10d: the store at --rdzv-endpoint, node ranks in order of arrival")
      ->envname(pet("rdzv_backend"))
      ->group(g);
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint,
                 "HOST[:PORT] of the job's store (c10d: default port 29400); the fsdp-run on "
                 "HOST hosts it, or a TCPStore already listening there")
      ->envname(pet("rdzv_endpoint"))
      ->group(g);
  app.add_option("--rdzv-id,--rdzv_id", o.rdzv_id,
                 "The job's id: TORCHELASTIC_RUN_ID, and its launchers' keys in the store")
      ->envname(pet("rdzv_id"))
      ->group(g);
  app.add_option("--rdzv-conf,--rdzv_conf", o.rdzv_conf,
                 "key=value,...: join_timeout, last_call_timeout, close_timeout, read_timeout, "
                 "timeout, keep_alive_interval, keep_alive_max_attempt, is_host")
      ->envname(pet("rdzv_conf"))
      ->group(g);
  app.add_flag("--standalone", o.standalone,
               "One node, its store at a free local port (any --rdzv-* values are ignored)")
      ->envname(pet("standalone"))
      ->group(g);
}

void add_launch_options(CLI::App& app, Options& o, bool& module, bool& run_path) {
  const char* g = "User-code launch (torchrun's)";
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "Restart every rank (on every node) after a failure, at most this many times")
      ->check(CLI::Range(0, 1000000))
      ->envname(pet("max_restarts"))
      ->group(g);
  app.add_option("--monitor-interval,--monitor_interval", o.monitor_interval,
                 "Accepted; fsdp-run wakes on every event (a rank's exit or output, the store)")
      ->check(CLI::Range(0.0, 86400.0))
      ->envname(pet("monitor_interval"))
      ->group(g);
  app.add_option("--start-method,--start_method", o.start_method,
                 "Accepted: every rank is a new process running PROGRAM (fork, then exec)")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}))
      ->envname(pet("start_method"))
      ->group(g);
  app.add_option("--role", o.role, "The ranks' ROLE_NAME")->envname(pet("role"))->group(g);
  app.add_flag("-m,--module", module, "Refused: PROGRAM is run as given; use python3 -m MODULE")
      ->envname(pet("module"))
      ->group(g);
  app.add_flag("--no-python,--no_python", o.no_python,
               "Accepted: fsdp-run always runs PROGRAM itself")
      ->envname(pet("no_python"))
      ->group(g);
  app.add_flag("--run-path,--run_path", run_path, "Refused: a Python interpreter's runpy")
      ->envname(pet("run_path"))
      ->group(g);
  app.add_option("--log-dir,--log_dir", o.log_dir,
                 "Logs under DIR/<run id>_<random>/attempt_<restart>/<local rank>/")
      ->envname(pet("log_dir"))
      ->group(g);
  app.add_option("-r,--redirects", o.redirects,
                 "Streams into the log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
                 "local rank (0:1,1:2)")
      ->envname(pet("redirects"))
      ->group(g);
  app.add_option("-t,--tee", o.tee, "Streams into the log files and the console (as -r)")
      ->envname(pet("tee"))
      ->group(g);
  app.add_option("--local-ranks-filter,--local_ranks_filter", o.local_ranks_filter,
                 "Only these local ranks on the console (0,1); the log files keep everything")
      ->envname(pet("local_ranks_filter"))
      ->group(g);
}

void add_compat_options(CLI::App& app, Options& o, std::string& logs_specs) {
  const char* g = "Compatible with torch.distributed.launch (torchrun's)";
  app.add_option("--node-rank,--node_rank", o.node_rank,
                 "This node's index, 0 .. nnodes-1 (MAX-1); static: node 0 hosts the store")
      ->check(CLI::NonNegativeNumber)
      ->envname(pet("node_rank"))
      ->group(g);
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "Static: node 0's host, whose fsdp-run hosts the job's store")
      ->envname(pet("master_addr"))
      ->group(g);
  app.add_option("--master-port,--master_port", o.master_port,
                 "Static: the store's port (default: one the kernel picks on one node, else 29500)")
      ->check(CLI::Range(1, 65535))
      ->envname(pet("master_port"))
      ->group(g);
  app.add_option("--local-addr,--local_addr", o.local_addr,
                 "The address the other hosts reach this node's ranks by (default: found from "
                 "the routes to the job's store)")
      ->envname(pet("local_addr"))
      ->group(g);
  app.add_option("--logs-specs,--logs_specs", logs_specs, "Refused: a Python entry point")
      ->group(g);
}

void add_own_options(CLI::App& app, Options& o, Aliases& a) {
  const char* g = "fsdp-run's own";
  app.add_option("--grace-period", o.grace,
                 "Seconds between SIGTERM and SIGKILL when stopping the other ranks")
      ->check(CLI::Range(0.0, 3600.0))
      ->group(g);
  app.add_option("--join-timeout", a.join_timeout,
                 "Seconds to wait for every node to join (--rdzv-conf join_timeout; default 600)")
      ->check(CLI::Range(0.1, 86400.0))
      ->group(g);
  app.add_option("--heartbeat-timeout", o.heartbeat_timeout,
                 "Seconds after which a silent node is lost (default: keep_alive_interval x "
                 "keep_alive_max_attempt, 15)")
      ->check(CLI::Range(1.0, 86400.0))
      ->group(g);
  app.add_option("--last-call-timeout", a.last_call_timeout,
                 "MIN:MAX: seconds a round waits for more once MIN joined (--rdzv-conf "
                 "last_call_timeout; default 30)")
      ->check(CLI::Range(0.0, 86400.0))
      ->group(g);
  app.add_option("--status-interval", o.status_interval,
                 "While a round forms, say whom it waits for this often (default 30 s)")
      ->check(CLI::Range(0.1, 86400.0))
      ->group(g);
  app.add_flag("--no-prefix", o.no_prefix, "Pass output through without \"[rN] \" prefixes")
      ->group(g);
}

// Every long option name, for "did you mean".
std::vector<std::string> long_names(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* opt : app.get_options())
    for (const std::string& n : opt->get_lnames()) out.push_back("--" + n);
  return out;
}

// The program and its arguments from what CLI11 left over; an exit code, or -1.
int take_command(const CLI::App& app, Options& o) {
  o.command = app.remaining();
  if (o.command.empty()) return usage("no PROGRAM given");
  if (o.command[0] == "--") {
    o.command.erase(o.command.begin());
  } else if (o.command[0].size() > 1 && o.command[0][0] == '-') {
    const std::string given = o.command[0].substr(0, o.command[0].find('='));
    const std::string near = nearest(given, long_names(app));
    return usage("unknown option " + given + (near.empty() ? "" : " (did you mean " + near + "?)"));
  }
  if (o.command.empty()) return usage("no PROGRAM given after --");
  return -1;
}

bool valid_streams(const std::string& s) {
  static const std::regex all("[0-3]"), each("[0-9]+:[0-3](,[0-9]+:[0-3])*");
  return std::regex_match(s, all) || std::regex_match(s, each);
}

// Everything CLI11 cannot check by itself; an exit code, or -1.
int check_options(Options& o, const Aliases& a, bool module, bool run_path,
                  const std::string& logs_specs) {
  if (module)
    return usage(
        "-m/--module runs PROGRAM as a Python module; fsdp-run runs PROGRAM itself, as "
        "torchrun --no-python does: write fsdp-run ... python3 -u -m MODULE");
  if (run_path)
    return usage(
        "--run-path runs a script in torchrun's own Python interpreter, which a C++ "
        "launcher has not: write fsdp-run ... python3 -u SCRIPT");
  if (!logs_specs.empty())
    return usage(
        "--logs-specs names a Python entry point (torchrun.logs_specs); fsdp-run lays "
        "out its logs as torchrun's default does (--log-dir)");
  if (!parse_nnodes(o))
    return usage("--nnodes " + o.nnodes + ": expected N or MIN:MAX with 1 <= MIN <= MAX");
  static const std::regex nproc("auto|cpu|gpu|[1-9][0-9]{0,3}");
  if (!std::regex_match(o.nproc_per_node, nproc))
    return usage("--nproc-per-node " + o.nproc_per_node +
                 ": expected N (1-9999), auto, cpu or gpu");
  if (o.rdzv_backend == "etcd" || o.rdzv_backend == "etcd-v2")
    return usage("--rdzv-backend " + o.rdzv_backend + " needs an etcd server; fsdp-run's " +
                 "rendezvous is c10d's TCPStore: --rdzv-backend c10d --rdzv-endpoint HOST:PORT");
  if (o.rdzv_backend != "static" && o.rdzv_backend != "c10d")
    return usage("--rdzv-backend " + o.rdzv_backend + ": expected static or c10d");
  if (std::string why = parse_rdzv_conf(o.rdzv_conf, o.conf); !why.empty()) return usage(why);
  if (a.join_timeout > 0) {
    if ((o.rdzv_conf.find("join_timeout=") != std::string::npos &&
         o.conf.join_timeout != a.join_timeout) ||
        (o.conf.timeout > 0 && o.conf.timeout != a.join_timeout))
      return usage("--join-timeout and --rdzv-conf's join_timeout (or timeout) disagree");
    o.conf.join_timeout = a.join_timeout;
  } else if (o.conf.timeout > 0 && o.rdzv_conf.find("join_timeout=") == std::string::npos) {
    o.conf.join_timeout = o.conf.timeout;  // the static rendezvous' name for it
  }
  if (a.last_call_timeout > 0) o.conf.last_call_timeout = a.last_call_timeout;
  if (!valid_streams(o.redirects) || !valid_streams(o.tee))
    return usage("--redirects/--tee: expected 0, 1, 2 or 3, or LOCAL_RANK:0-3,... (0:1,1:3)");
  static const std::regex ranks("[0-9]+(,[0-9]+)*");
  if (!o.local_ranks_filter.empty() && !std::regex_match(o.local_ranks_filter, ranks))
    return usage("--local-ranks-filter must be a comma-separated list of integers, e.g. 0,1,2");
  if (o.standalone && o.max_nodes > 1)
    return usage("--standalone starts a job on this node only; it cannot take --nnodes " +
                 o.nnodes);
  if (o.node_rank >= o.max_nodes)
    return usage("--node-rank " + std::to_string(o.node_rank) + " is not below " +
                 (o.elastic() ? "MAX of " : "") + "--nnodes " + o.nnodes);
  return -1;
}

// HOST[:PORT] or [IPV6]:PORT into host and port (`fallback` when none is given); false if the
// port is not a number.
bool split_endpoint(const std::string& e, int fallback, std::string& host, int& port) {
  std::string rest;
  if (!e.empty() && e[0] == '[') {
    const size_t close = e.find(']');
    if (close == std::string::npos) return false;
    host = e.substr(1, close - 1);
    rest = e.substr(close + 1);
    if (!rest.empty() && rest[0] != ':') return false;
  } else {
    const size_t colon = e.rfind(':');
    host = e.substr(0, colon);
    if (colon != std::string::npos) rest = e.substr(colon);
  }
  if (host.empty()) host = "localhost";
  if (rest.size() <= 1) {
    port = fallback;
    return rest.empty();
  }
  char* end = nullptr;
  const long p = std::strtol(rest.c_str() + 1, &end, 10);
  port = static_cast<int>(p);
  return *end == '\0' && p >= 0 && p <= 65535;
}

}  // namespace

int parse_options(int argc, char** argv, Options& o) {
  CLI::App app{
      "fsdp-run: start one process per rank on this node, as torchrun does, with torchrun's "
      "options.\nUsage: fsdp-run [OPTIONS] PROGRAM [ARGS...]",
      "fsdp-run"};
  bool module = false, run_path = false;
  std::string logs_specs;
  Aliases aliases;
  add_size_options(app, o);
  add_rendezvous_options(app, o);
  add_launch_options(app, o, module, run_path);
  add_compat_options(app, o, logs_specs);
  add_own_options(app, o, aliases);
  app.prefix_command();  // everything from PROGRAM on belongs to PROGRAM
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    return usage(e.what());
  }
  if (int code = take_command(app, o); code >= 0) return code;
  return check_options(o, aliases, module, run_path, logs_specs);
}

namespace {

// --nproc-per-node auto|cpu|gpu as torchrun decides it; an exit code, or -1.
int resolve_nproc(Options& o) {
  const std::string& spec = o.nproc_per_node;
  if (spec != "auto" && spec != "cpu" && spec != "gpu") {
    o.nproc = std::stoi(spec);
    return -1;
  }
  const int cpus = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  const int gpus = spec == "cpu" ? 0 : gpu_count();
  if (spec == "gpu" && gpus == 0) return usage("--nproc-per-node gpu: CUDA is not available");
  const bool on_gpus = gpus > 0;
  o.nproc = on_gpus ? gpus : cpus;
  std::fprintf(stderr, "fsdp-run: --nproc-per-node %s: %d processes, one per %s\n", spec.c_str(),
               o.nproc, on_gpus ? "GPU" : "CPU");
  return -1;
}

// Where the ranks' store (one node) or the launchers' (several) is; an exit code, or -1.
int place_store(Options& o) {
  if (o.standalone) {
    if (o.rdzv_backend != "static" || !o.rdzv_endpoint.empty() || o.rdzv_id != "none")
      std::fprintf(stderr,
                   "fsdp-run: --standalone sets the rendezvous itself (this node, a free port, a "
                   "fresh id): the given --rdzv-backend, --rdzv-endpoint and --rdzv-id are "
                   "ignored\n");
    o.rdzv_backend = "c10d";
    o.rdzv_endpoint.clear();
    o.rdzv_id = "none";
  }
  if (!o.multi_node()) {
    // One node: fsdp-run hosts its ranks' store (local_store.h), at --master-port or at a port
    // the kernel picks when it binds (0 here), for every round.
    o.store_host = o.master_addr;
    o.port_chosen = o.master_port != 0 && !o.c10d();
    o.store_port = o.port_chosen ? o.master_port : 0;
    return -1;
  }
  if (o.c10d() && o.master_addr != "127.0.0.1" && o.rdzv_endpoint.empty())
    std::fprintf(stderr,
                 "fsdp-run: --master-addr is only used by --rdzv-backend static and when "
                 "--rdzv-endpoint is not given\n");
  o.port_chosen = true;
  // torchrun's defaults: the static rendezvous at --master-addr:--master-port (29500), c10d's at
  // --rdzv-endpoint (localhost:29400).
  const int fallback = o.c10d() ? 29400 : (o.master_port != 0 ? o.master_port : 29500);
  if (!o.c10d() && o.rdzv_endpoint.empty()) {
    o.store_host = o.master_addr;
    o.store_port = fallback;
    return -1;
  }
  if (!split_endpoint(o.rdzv_endpoint, fallback, o.store_host, o.store_port) || o.store_port == 0)
    return usage("--rdzv-endpoint " + o.rdzv_endpoint +
                 ": expected HOST[:PORT] with a port of 1-65535");
  return -1;
}

}  // namespace

int complete_options(Options& o) {
  if (int code = resolve_nproc(o); code >= 0) return code;
  if (int code = place_store(o); code >= 0) return code;
  if (o.node_rank < 0 && !o.c10d()) o.node_rank = 0;  // static: torchrun's default
  o.keep_alive = o.conf.keep_alive_interval;
  o.lost_after = o.conf.keep_alive_interval * o.conf.keep_alive_max_attempt;
  if (o.heartbeat_timeout > 0) {
    o.lost_after = o.heartbeat_timeout;
    o.keep_alive = std::min(o.keep_alive, o.heartbeat_timeout / 3);
  }
  o.set_omp = o.nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
  if (o.set_omp)
    std::fprintf(stderr,
                 "fsdp-run: setting OMP_NUM_THREADS=1 for each process (as torchrun does); set it "
                 "yourself to override\n");
  for (const char* v : {"GLOO_SOCKET_IFNAME", "FSDP_GLOO_HOSTNAME"})
    if (const char* s = std::getenv(v); s != nullptr && *s != '\0') o.gloo_address_given = true;
  o.run_id = o.rdzv_id != "none" ? o.rdzv_id : new_run_id();
  return -1;
}

AgentConfig agent_config(const Options& o) {
  AgentConfig c;
  c.min_nodes = o.min_nodes;
  c.max_nodes = o.max_nodes;
  c.node_rank = o.node_rank;
  c.nproc_per_node = o.nproc;
  c.store_host = o.store_host;
  c.store_port = o.store_port;
  if (!o.c10d())
    c.store_role = o.node_rank == 0 ? StoreRole::kHost : StoreRole::kClient;
  else if (o.conf.is_host)
    c.store_role = *o.conf.is_host ? StoreRole::kHost : StoreRole::kClient;
  else  // torchrun's guess: the endpoint names this machine, unless its port is taken
    c.store_role = fsdp::detail::names_this_machine(o.store_host) ? StoreRole::kHostIfFree
                                                                  : StoreRole::kClient;
  c.rdzv_id = o.rdzv_id;
  c.run_id = o.rdzv_id != "none" ? o.rdzv_id : "";
  c.join_timeout = o.conf.join_timeout;
  c.last_call_timeout = o.conf.last_call_timeout;
  c.close_timeout = o.conf.close_timeout;
  c.read_timeout = o.conf.read_timeout;
  c.keep_alive_interval = o.keep_alive;
  c.lost_after = o.lost_after;
  c.status_interval = o.status_interval;
  c.max_restarts = o.max_restarts;
  c.local_addr = o.local_addr;
  c.gloo_address_given = o.gloo_address_given;
  return c;
}

int gpu_count() {
  void* cuda = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == nullptr) return 0;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  auto init = reinterpret_cast<Init>(::dlsym(cuda, "cuInit"));
  auto count = reinterpret_cast<Count>(::dlsym(cuda, "cuDeviceGetCount"));
  int n = 0;
  if (init == nullptr || count == nullptr || init(0) != 0 || count(&n) != 0) n = 0;
  // Not dlclose'd: the driver keeps threads of its own once initialised.
  return n;
}

std::string nearest(const std::string& given, const std::vector<std::string>& known) {
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diag = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  };
  std::string best;
  size_t best_d = std::max<size_t>(2, given.size() / 4) + 1;  // nothing further is "near"
  for (const std::string& k : known) {
    const size_t d = distance(given, k);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

}  // namespace fsdp_run
