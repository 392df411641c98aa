// Process-group creation: environment parsing, rendezvous, backends, sub-groups.
// The collectives themselves live in collectives.cpp and pairwise.cpp, their completion (Work) in
// work.cpp, the byte exchanges in bytes.cpp.
#include "dist/state.h"

#include <signal.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include <torch/cuda.h>

#include "dist/gloo_device.h"
#include "fsdp/compat_backends.h"
#include "fsdp/errors.h"
#include "util/env.h"
#include "util/message.h"
#include "util/net.h"

namespace fsdp {
namespace dist {

using fsdp::detail::env_int;
using fsdp::detail::get_env;
using fsdp::detail::msg;
using fsdp::detail::quote;

namespace {

std::mutex g_default_mu;
ProcessGroup g_default;

}  // namespace

EnvInfo env_info() {
  EnvInfo e;
  // One launcher's variables, whole: mixing (say) torchrun's RANK with Slurm's task count would
  // describe a job that does not exist.
  struct Names {
    const char* launcher;
    const char *rank, *world, *local_rank, *local_world;
  };
  const Names launchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  for (const Names& n : launchers) {
    if (!get_env(n.rank) && !get_env(n.world)) continue;
    e.launcher = n.launcher;
    e.rank = env_int(n.rank, 0);
    e.world_size = env_int(n.world, 1);
    e.local_rank = env_int(n.local_rank, e.rank);
    e.local_world_size = env_int(n.local_world, e.world_size);
    if (e.launcher == "slurm" && !get_env(n.local_world)) {
      // SLURM_TASKS_PER_NODE reads like "4(x2),3": the first node's count.
      if (auto t = get_env("SLURM_TASKS_PER_NODE")) {
        const size_t digits = t->find_first_not_of("0123456789");
        if (digits != 0) e.local_world_size = std::stoi(t->substr(0, digits));
      }
    }
    break;
  }
  e.master_addr = get_env("MASTER_ADDR").value_or("127.0.0.1");
  e.master_port = env_int("MASTER_PORT", 29500);
  // PyTorch's spelling exactly: only the string "True" turns it on.
  e.agent_store = get_env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  e.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  return e;
}

ProcessGroup ProcessGroup::from_backend(compat::BackendPtr backend, std::string name,
                                        std::chrono::milliseconds timeout, compat::StorePtr store,
                                        std::vector<int> global_ranks) {
  if (!backend)
    throw ValueError(msg("ProcessGroup::from_backend: null backend for group ", quote(name)));
  auto s = std::make_shared<State>();
  s->backend = std::move(backend);
  s->name = std::move(name);
  s->rank = s->backend->getRank();
  s->size = s->backend->getSize();
  s->timeout = timeout;
  s->store = std::move(store);
  s->backend_name = s->backend->getBackendName();
  s->device = compat::collective_device(s->backend_name);
  if (global_ranks.empty()) {
    for (int r = 0; r < s->size; ++r) global_ranks.push_back(r);
  }
  if (static_cast<int>(global_ranks.size()) != s->size) {
    throw ValueError(msg("ProcessGroup::from_backend: group ", quote(s->name), " has ", s->size,
                         " ranks but ", global_ranks.size(), " global ranks were given"));
  }
  s->global_ranks = std::move(global_ranks);
  return ProcessGroup(std::move(s));
}

ProcessGroup::State::~State() {
  // The last handle is gone. c10d's NCCL backend, destroyed without shutdown(), aborts its
  // communicators: a rank that finishes first then cuts off a peer still completing the last
  // collective with it ("remote process exited", seen over NCCL's socket transport). PyTorch's
  // destroy_process_group shuts the backend down gracefully first; so do we, unless a collective
  // of this group failed (a graceful shutdown would wait for what a dead peer never finishes).
  if (!backend || failed->load()) return;
  try {
    compat::shutdown_backend(backend, backend_name);
  } catch (...) {
    // A destructor must not throw; the backend's own destructor still releases everything.
  }
}

ProcessGroup::State& detail::GroupInternals::checked_state(const ProcessGroup& self,
                                                           const char* op) {
  if (!self.state_) {
    throw StateError(
        msg(op, ": this process is not a member of the group (placeholder from new_group)"));
  }
  return *self.state_;
}

int ProcessGroup::rank() const { return Internals::checked_state(*this, "rank").rank; }
int ProcessGroup::size() const { return Internals::checked_state(*this, "size").size; }
const std::string& ProcessGroup::name() const {
  return Internals::checked_state(*this, "name").name;
}
std::chrono::milliseconds ProcessGroup::timeout() const {
  return Internals::checked_state(*this, "timeout").timeout;
}
std::string ProcessGroup::backend_name() const {
  return Internals::checked_state(*this, "backend_name").backend_name;
}
const std::vector<int>& ProcessGroup::global_ranks() const {
  return Internals::checked_state(*this, "global_ranks").global_ranks;
}
compat::BackendPtr ProcessGroup::backend() const {
  return Internals::checked_state(*this, "backend").backend;
}
at::Device ProcessGroup::device() const { return Internals::checked_state(*this, "device").device; }

namespace {

// Gloo writes to its sockets without MSG_NOSIGNAL, so when a peer dies mid-collective the next
// write raises SIGPIPE, whose default action kills this process before the collective can fail
// with a DistError naming the peer (seen in tests: a survivor "terminated by signal 13").
// Python ignores SIGPIPE at start-up, which is why PyTorch users never meet this; a C++ program
// usually has the default, so we ignore it, unless the program installed a disposition itself.
void ignore_sigpipe_if_default() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
      !(old.sa_flags & SA_SIGINFO))
    ::signal(SIGPIPE, SIG_IGN);
}

compat::BackendPtr make_backend(const std::string& kind, const compat::StorePtr& store, int rank,
                                int size, std::chrono::milliseconds timeout,
                                const detail::GlooDevice& gloo, int gloo_threads) {
  if (kind == "gloo") {
#ifdef USE_C10D_GLOO
    ignore_sigpipe_if_default();
    return compat::make_gloo_backend(store, rank, size, timeout, gloo.interfaces, gloo.address,
                                     gloo_threads);
#else
    throw ValueError("backend 'gloo' requested but fsdp-cpp was built without USE_C10D_GLOO");
#endif
  }
  if (kind == "nccl") {
#ifdef USE_C10D_NCCL
    (void)gloo;
    (void)gloo_threads;
    return compat::make_nccl_backend(store, rank, size, timeout);
#else
    throw ValueError("backend 'nccl' requested but fsdp-cpp was built without USE_C10D_NCCL");
#endif
  }
  throw ValueError(msg("unknown backend ", quote(kind), " (expected gloo, nccl or auto)"));
}

// Connects to (or, with `hosts_store`, hosts) the TCPStore that `owner` hosts, giving up after
// `timeout`. LibTorch 2.6's
// client checks a new connection with a ping whose reply it waits for without a time limit: when
// the store's host is stopped (SIGSTOP, a hung machine) after it began to listen, a rank hung
// there for good (found by scripts/chaos.py). The constructor runs on a thread of its own that is
// abandoned when the time is up; it holds nothing but the socket, which the process's exit closes.
compat::StorePtr connect_store(const std::string& addr, int port, int rank, int world,
                               bool hosts_store, const std::string& owner,
                               std::chrono::milliseconds timeout) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    compat::StorePtr store;
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, addr, port, world, hosts_store, timeout] {
    compat::StorePtr store;
    std::exception_ptr error;
    try {
      store = compat::make_tcp_store(addr, static_cast<std::uint16_t>(port), hosts_store, world,
                                     timeout);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->store = std::move(store);
    shared->error = error;
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  // The constructor's own connect retries end at `timeout`; a little more lets them say why.
  if (!shared->cv.wait_for(lock, timeout + std::chrono::seconds(2), [&] { return shared->done; }))
    throw DistError(msg("init_process_group: ", fsdp::detail::rank(rank), " of ", world,
                        ": the TCPStore at ", addr, ":", port, " accepted the connection but did ",
                        "not answer within the timeout (", timeout.count(), " ms); is ", owner,
                        "'s process stopped or its host hung?"));
  if (shared->error) std::rethrow_exception(shared->error);
  return shared->store;
}

// NCCL builds its communicator at a group's first collective, and building it waits for every
// peer with no time limit. Doing it while creating the group, when every rank is there, keeps
// later collectives under the group's timeout (c10d's watchdog, or wait() with
// TORCH_NCCL_BLOCKING_WAIT=1), as PyTorch does when init_process_group is given a device_id.
void connect_eagerly(ProcessGroup& g) {
  if (g.backend_name() != "nccl" || g.size() == 1) return;
  at::Tensor t = at::zeros({1}, at::TensorOptions().device(g.device()));
  g.all_reduce(t);
  (void)t.cpu();  // the CPU waits for the collective itself
}

}  // namespace

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) {
  State& s = Internals::checked_state(*this, "new_group");
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= s.size || !seen.insert(r).second) {
      throw ValueError(msg("new_group on group ", quote(s.name), " (size ", s.size,
                           "): ", fsdp::detail::rank(r), " is out of range or repeated"));
    }
  }
  if (ranks.empty())
    throw ValueError(msg("new_group on group ", quote(s.name), ": empty rank list"));
  if (!s.store) {
    throw StateError(msg("new_group on group ", quote(s.name),
                         ": the group has no store (built by from_backend without one)"));
  }
  // Every member counts every call, so all ranks agree on the sub-group's name (and store prefix)
  // without talking.
  return Internals::new_named_group(*this, ranks, s.name + "/" + std::to_string(s.next_subgroup++));
}

// new_group's work, under a name every member agrees on (which is also its store prefix).
ProcessGroup detail::GroupInternals::new_named_group(ProcessGroup& self,
                                                     const std::vector<int>& ranks,
                                                     const std::string& name) {
  State& s = Internals::checked_state(self, "new_group");
  int my_index = -1;
  std::vector<int> global;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == s.rank) my_index = static_cast<int>(i);
    global.push_back(s.global_ranks[ranks[i]]);
  }
  if (my_index < 0) return ProcessGroup();
  auto store = c10::make_intrusive<c10d::PrefixStore>(name, s.store);
  compat::BackendPtr backend;
  try {
    backend = make_backend(s.backend_name, store, my_index, static_cast<int>(ranks.size()),
                           s.timeout, s.gloo_device, s.gloo_threads);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DistError(msg(
        "new_group ", quote(name), ": ", fsdp::detail::rank(s.rank),
        " could not connect to its peers: ", e.what(),
        s.backend_name == "gloo" ? "; " + detail::gloo_device_hint(s.gloo_device) : std::string()));
  }
  ProcessGroup g =
      ProcessGroup::from_backend(std::move(backend), name, s.timeout, s.store, std::move(global));
  g.state_->gloo_device = s.gloo_device;
  g.state_->gloo_threads = s.gloo_threads;
  connect_eagerly(g);
  return g;
}

// InitOptions::device_id: a GPU becomes the current CUDA device, before the backend is made.
static void use_device(const InitOptions& opts) {
  if (!opts.device_id() || !opts.device_id()->is_cuda()) return;
  const at::Device d = *opts.device_id();
  const int index = d.has_index() ? d.index() : 0;
  const int visible = static_cast<int>(torch::cuda::device_count());
  if (index >= visible)
    throw ValueError(msg("init_process_group: device_id ", d.str(), " is not available: ", visible,
                         " CUDA devices are visible"));
  if (!compat::set_cuda_device(index))
    throw ValueError(msg("init_process_group: device_id ", d.str(),
                         " needs fsdp-cpp built with NCCL (USE_C10D_NCCL)"));
}

ProcessGroup init_process_group(const InitOptions& opts) {
  EnvInfo env = env_info();
  const int rank = opts.rank().value_or(env.rank);
  const int world = opts.world_size().value_or(env.world_size);
  const std::string addr = opts.master_addr().value_or(env.master_addr);
  const int port = opts.master_port().value_or(env.master_port);
  if (world < 1 || rank < 0 || rank >= world) {
    throw ValueError(msg("init_process_group: ", fsdp::detail::rank(rank),
                         " is not in [0, world_size=", world, ")"));
  }
  if (!opts.store() && (port < 0 || port > 65535)) {
    throw ValueError(msg("init_process_group: MASTER_PORT ", port, " is out of range"));
  }
  use_device(opts);
  std::string kind = opts.backend();
  if (kind == "auto") {
#ifdef USE_C10D_NCCL
    kind = torch::cuda::is_available() ? "nccl" : "gloo";
#else
    kind = "gloo";
#endif
  }
  // The launcher's layout says whether the job spans hosts: fewer ranks on this host than in all.
  const bool spans_hosts = env.launcher != "none" && env.local_world_size < env.world_size;
  const detail::GlooDevice gloo =
      kind == "gloo"
          ? detail::choose_gloo_device(opts.gloo_hostname(), addr, port, spans_hosts, rank)
          : detail::GlooDevice{};
  // One line per host (its first local rank) when the job may span hosts: which address the
  // others must reach, and what chose it.
  if (kind == "gloo" && (spans_hosts || !fsdp::detail::is_loopback(addr)) && env.local_rank == 0)
    std::fprintf(stderr, "fsdp: rank %d: Gloo transport on %s\n", rank, gloo.describe().c_str());

  compat::StorePtr store = opts.store();
  const std::string where =
      opts.store() ? std::string("the given store") : msg("TCPStore ", addr, ":", port);
  compat::BackendPtr backend;
  try {
    if (!store) {
      // Under a launcher that hosts the store (fsdp-run across hosts, torchrun), rank 0 is a client
      // like the others, and each restart of the job has keys of its own, as in PyTorch.
      const bool agent = env.agent_store;
      store = connect_store(addr, port, rank, world, !agent && rank == 0,
                            agent ? "the launcher" : "rank 0", opts.timeout());
      if (agent) {
        store = c10::make_intrusive<c10d::PrefixStore>(msg("/worker/attempt_", env.restart_count),
                                                       store);
      }
    }
    // A prefix keeps our keys apart from anything else the caller keeps in the same store.
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp", store);
    store = prefixed;
    backend = make_backend(kind, store, rank, world, opts.timeout(), gloo, opts.gloo_threads());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DistError(msg("init_process_group: ", fsdp::detail::rank(rank), " of ", world,
                        " failed to rendezvous via ", where, " (", kind, "): ", e.what(),
                        kind == "gloo" ? "; " + detail::gloo_device_hint(gloo) : std::string()));
  }
  ProcessGroup g = ProcessGroup::from_backend(std::move(backend), "default", opts.timeout(), store);
  Internals::checked_state(g, "init_process_group").gloo_device = gloo;
  Internals::checked_state(g, "init_process_group").gloo_threads = opts.gloo_threads();
  connect_eagerly(g);
  Internals::route_by_host(g, env, opts.host_aware());
  {
    std::lock_guard<std::mutex> lock(g_default_mu);
    g_default = g;
  }
  return g;
}

ProcessGroup& default_group() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  if (!g_default.is_member()) {
    throw StateError("default_group(): init_process_group() has not been called");
  }
  return g_default;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  return g_default.is_member();
}

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  g_default = ProcessGroup();
}

HybridGroups make_hybrid_groups(ProcessGroup& world, int shard_size) {
  const int w = world.size();
  if (shard_size < 1 || w % shard_size != 0) {
    throw ValueError(
        msg("make_hybrid_groups: shard size ", shard_size, " does not divide world size ", w));
  }
  HybridGroups out;
  for (int start = 0; start < w; start += shard_size) {
    std::vector<int> ranks;
    for (int r = start; r < start + shard_size; ++r) ranks.push_back(r);
    ProcessGroup g = world.new_group(ranks);
    if (g.is_member()) out.shard = g;
  }
  for (int pos = 0; pos < shard_size; ++pos) {
    std::vector<int> ranks;
    for (int r = pos; r < w; r += shard_size) ranks.push_back(r);
    ProcessGroup g = world.new_group(ranks);
    if (g.is_member()) out.replicate = g;
  }
  return out;
}

}  // namespace dist
}  // namespace fsdp
