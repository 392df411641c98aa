// Collectives routed by host (InitOptions::host_aware): on a job of H hosts with L ranks each,
// the large all-gathers, reduce-scatters and all-reduces of the default group cross the host
// boundary once per piece of data that must cross it.
//
// Why: Gloo's ring (all-gather, all-reduce) and our pairwise reduce-scatter do not know where the
// hosts are. A ring over 2 hosts x 2 ranks crosses the boundary on 2 of its 4 edges, each carrying
// (W-1)/W of the data, so a host sends 3/4 of an all-gather where 1/2 must cross; the pairwise
// reduce-scatter sends every remote rank its chunk from every local rank, all of the data where
// half must cross. Measured on emulated hosts: 1.5-1.8x the minimum (docs/performance.md).
//
// How, with `piece(k, j)` the piece of global rank k * L + j:
//  * all-gather: each rank exchanges its piece with the ranks of its local rank on the other hosts
//    (group `across`), received straight into place, then forwards each piece to the ranks of its
//    own host (group `local`). Receives are all posted at the start; the forwarding sends go out in
//    wait(), in host order (every receiver posted its receives in that order), so the slow part
//    (across hosts) runs in the background and only the local copy waits for wait().
//  * reduce-scatter: a pairwise reduce-scatter within the host, local rank j receiving the host's
//    sum of piece(k, j) for every host k, then one across hosts of those sums. The first step runs
//    before the call returns (it is local, and the second needs its result), the second in the
//    background. Every rank adds in the same order: each host's ranks first, then the hosts.
//  * all-reduce: the reduce-scatter within the host, Gloo's all-reduce of the 1/L shard across
//    hosts, then a pairwise all-gather within the host in wait(). The last N % L elements (fewer
//    than L) go through a flat all-reduce beside it.
// Every step is point-to-point under a tag reserved at the call (pairwise.cpp), so steps posted
// later (in wait) never take another collective's messages.
#include <array>
#include <cstdio>
#include <string>

#include "dist/state.h"
#include "fsdp/errors.h"
#include "util/env.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace dist {

using fsdp::detail::msg;

namespace {

// From this size (the output of an all-gather, the input of a reduce-scatter, the tensor of an
// all-reduce) AUTO routes by host. Below it the extra step's latency outweighs the bytes saved;
// what small collectives carry (flags, sizes, norms) is no traffic worth saving.
constexpr int64_t kRoutedMinBytes = int64_t{64} << 10;

// FSDP_HOST_AWARE: "0" or "1"; anything else is a mistake worth stopping for.
std::optional<bool> host_aware_from_env() {
  const std::optional<std::string> v = fsdp::detail::get_env("FSDP_HOST_AWARE");
  if (!v || v->empty()) return std::nullopt;
  if (*v == "0" || *v == "1") return *v == "1";
  throw ValueError(msg("FSDP_HOST_AWARE=", *v, ": expected 0 or 1"));
}

// What each rank sends: its LOCAL_WORLD_SIZE and LOCAL_RANK, and whether it wants routes.
enum Wish { kOff = 0, kOn = 1, kAuto = 2 };

// Why the layouts do not allow routing ("" if they do): every rank's "L l wish" in rank order.
// `asked` tells whether some rank asked for routes explicitly.
std::string layout_problem(const std::vector<std::string>& layouts, int world, int* per_host,
                           bool* asked) {
  std::vector<std::array<int, 3>> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto& [size, local, wish] = all[static_cast<size_t>(r)];
    if (std::sscanf(layouts[static_cast<size_t>(r)].c_str(), "%d %d %d", &size, &local, &wish) !=
        3) {
      return msg("rank ", r, " sent no layout");
    }
    *asked = *asked || wish == kOn;
  }
  for (int r = 0; r < world; ++r) {
    if (all[static_cast<size_t>(r)][2] == kOff)
      return msg("switched off on rank ", r, " (InitOptions::host_aware or FSDP_HOST_AWARE=0)");
  }
  int common = -1;
  for (int r = 0; r < world; ++r) {
    const auto [size, local, wish] = all[static_cast<size_t>(r)];
    if (common < 0) common = size;
    if (size != common) {
      return msg("the hosts have different numbers of ranks (LOCAL_WORLD_SIZE ", common,
                 " on rank 0, ", size, " on rank ", r, ")");
    }
    if (size <= 1 || size >= world || world % size != 0) {
      return msg("LOCAL_WORLD_SIZE ", size, " at world size ", world,
                 " is not several hosts of more than one rank");
    }
    if (local != r % size) {
      return msg("rank ", r, " has LOCAL_RANK ", local, ", not ", r % size,
                 ": ranks are not numbered host by host");
    }
  }
  *per_host = common;
  return "";
}

}  // namespace

int ProcessGroup::hosts() const {
  const State& s = Internals::checked_state(*this, "hosts");
  return s.routes ? s.routes->hosts : 1;
}

void detail::GroupInternals::route_by_host(ProcessGroup& self, const EnvInfo& env,
                                           std::optional<bool> wanted) {
  State& s = Internals::checked_state(self, "route_by_host");
  if (s.size == 1 || s.backend_name != "gloo") return;  // NCCL routes by topology itself
  if (!wanted) wanted = host_aware_from_env();
  // Every rank takes part in the exchange, even one that does not want routes: were it to skip
  // it, its first collective would meet the others' exchange. One that says no keeps all flat.
  const int wish = !wanted ? kAuto : *wanted ? kOn : kOff;
  // The environment describes this job only if it names this rank and world.
  const bool env_is_ours = env.world_size == s.size && env.rank == s.rank;
  const std::string mine =
      env_is_ours ? msg(env.local_world_size, " ", env.local_rank, " ", wish) : msg("0 -1 ", wish);
  const std::vector<std::string> layouts = self.all_gather_bytes(mine);
  int per_host = 0;
  bool asked = false;
  const std::string problem = layout_problem(layouts, s.size, &per_host, &asked);
  if (!problem.empty()) {
    // Asked for explicitly: say why not. Left to the default: a single host is the common case.
    if (asked && s.rank == 0) {
      std::fprintf(stderr, "fsdp: collectives not routed by host: %s\n", problem.c_str());
    }
    return;
  }
  auto routes = std::make_shared<HostRoutes>();
  routes->per_host = per_host;
  routes->hosts = s.size / per_host;
  routes->host = s.rank / per_host;
  routes->local_rank = s.rank % per_host;
  // Every rank creates every group, in the same order (new_group's contract).
  for (int h = 0; h < routes->hosts; ++h) {
    std::vector<int> ranks;
    for (int j = 0; j < per_host; ++j) ranks.push_back(h * per_host + j);
    ProcessGroup g = Internals::new_named_group(self, ranks, msg(s.name, "/host", h));
    if (g.is_member()) routes->local = g;
  }
  for (int j = 0; j < per_host; ++j) {
    std::vector<int> ranks;
    for (int h = 0; h < routes->hosts; ++h) ranks.push_back(h * per_host + j);
    ProcessGroup g = Internals::new_named_group(self, ranks, msg(s.name, "/local-rank", j));
    if (g.is_member()) routes->across = g;
  }
  if (s.rank == 0) {
    std::fprintf(stderr, "fsdp: collectives routed by host: %d hosts x %d ranks\n", routes->hosts,
                 per_host);
  }
  s.routes = std::move(routes);
}

bool detail::GroupInternals::routed(const ProcessGroup& self, const char* op, bool hierarchical,
                                    bool automatic, int64_t bytes) {
  const State& s = Internals::checked_state(self, op);
  if (hierarchical && !s.routes) {
    throw ValueError(msg(detail::describe(op, self),
                         ": HIERARCHICAL needs a group routed by host (the default group of a "
                         "job on several hosts, InitOptions::host_aware); this one is not"));
  }
  return hierarchical || (automatic && s.routes && bytes >= kRoutedMinBytes);
}

Work detail::GroupInternals::routed_all_gather(ProcessGroup& self, const at::Tensor& out,
                                               const at::Tensor& in) {
  const char* op = "all_gather_into_tensor";
  const HostRoutes& r = *Internals::checked_state(self, op).routes;
  const int hosts = r.hosts, per_host = r.per_host, h = r.host, l = r.local_rank;
  const int64_t n = in.numel();
  auto piece = [out, n, per_host](int k, int j) {
    return out.narrow(0, (static_cast<int64_t>(k) * per_host + j) * n, n);
  };
  // Both calls' tags now, in the same order on every rank.
  auto across =
      detail::start_exchange(r.across.state_->next_point_to_point(detail::describe(op, r.across)));
  auto local =
      detail::start_exchange(r.local.state_->next_point_to_point(detail::describe(op, r.local)));
  // A failure in either exchange leaves the other's posted receives writing into `out`: both are
  // then kept alive for good.
  auto abandon_both = [across, local]() {
    detail::exchange_abandon(across);
    detail::exchange_abandon(local);
  };
  // Forwarding goes in host order; only host 0's own piece can go at the start.
  auto forward = [local, piece, per_host, l](int k) {
    for (int e = 1; e < per_host; ++e)
      detail::exchange_send(local, (l + e) % per_host, piece(k, l));
  };
  int forwarded = 0;
  try {
    for (int d = 1; d < hosts; ++d) {
      const int k = (h + d) % hosts;  // not every rank to host 0 first
      detail::exchange_recv(across, k, piece(k, l));
    }
    for (int d = 1; d < hosts; ++d) detail::exchange_send(across, (h + d) % hosts, in);
    at::Tensor own = piece(h, l);
    if (in.data_ptr() != own.data_ptr()) own.copy_(in);  // the caller refused any other overlap
    for (int e = 1; e < per_host; ++e) {
      const int j = (l + e) % per_host;
      for (int k = 0; k < hosts; ++k) detail::exchange_recv(local, j, piece(k, j));
    }
    if (h == 0) forward(forwarded++);
  } catch (...) {
    abandon_both();
    throw;
  }
  auto finish = [across, local, forward, abandon_both, forwarded, hosts, h]() {
    try {
      for (int k = forwarded; k < hosts; ++k) {
        if (k != h) detail::exchange_wait_from(across, k);
        forward(k);
      }
      detail::exchange_finish(across);
      detail::exchange_finish(local);
    } catch (...) {
      abandon_both();
      throw;
    }
  };
  return Internals::launch(self, op, {}, std::move(finish));
}

Work detail::GroupInternals::routed_reduce_scatter(ProcessGroup& self, const char* op,
                                                   const at::Tensor& out_flat,
                                                   std::vector<std::vector<at::Tensor>> chunks,
                                                   ReduceOp op_kind, std::vector<double> divisors) {
  const HostRoutes& r = *Internals::checked_state(self, op).routes;
  const int hosts = r.hosts, per_host = r.per_host;
  const int64_t n = out_flat.numel();
  // AVG's division by the world size is already in `divisors`.
  const ReduceOp step_op = op_kind == ReduceOp::AVG ? ReduceOp::SUM : op_kind;
  // Within the host, local rank j gets the host's sums of chunk k * L + j for k = 0 .. H-1.
  std::vector<std::vector<at::Tensor>> within(static_cast<size_t>(per_host));
  for (int j = 0; j < per_host; ++j) {
    for (int k = 0; k < hosts; ++k) {
      auto& c = chunks[static_cast<size_t>(k * per_host + j)];
      for (auto& t : c) within[static_cast<size_t>(j)].push_back(std::move(t));
    }
  }
  chunks.clear();
  at::Tensor sums = fsdp::detail::empty_buffer(hosts * n, out_flat.options());
  detail::PointToPointCall first =
      r.local.state_->next_point_to_point(detail::describe(op, r.local));
  detail::PointToPointCall second =
      r.across.state_->next_point_to_point(detail::describe(op, r.across));
  detail::start_pairwise_reduce_scatter(std::move(first), sums, std::move(within), step_op, {})();
  return Internals::launch(self, op, {},
                           detail::start_pairwise_reduce_scatter(
                               std::move(second), out_flat, detail::equal_chunks(sums, hosts, n),
                               step_op, std::move(divisors)));
}

Work detail::GroupInternals::routed_all_reduce(ProcessGroup& self, const at::Tensor& tensor,
                                               ReduceOp op_kind) {
  const char* op = "all_reduce";
  const State& s = Internals::checked_state(self, op);
  const HostRoutes& r = *s.routes;
  const int per_host = r.per_host, world = s.size;
  const ReduceOp step_op = op_kind == ReduceOp::AVG ? ReduceOp::SUM : op_kind;
  at::Tensor flat = tensor.view(-1);
  const int64_t whole = flat.numel() - flat.numel() % per_host, shard_numel = whole / per_host;
  auto tail = std::make_shared<Work>();
  if (whole < flat.numel()) {
    *tail = self.all_reduce_async(flat.narrow(0, whole, flat.numel() - whole), step_op);
  }
  at::Tensor head = flat.narrow(0, 0, whole);
  at::Tensor shard = fsdp::detail::empty_buffer(shard_numel, flat.options());
  detail::PointToPointCall first =
      r.local.state_->next_point_to_point(detail::describe(op, r.local));
  detail::start_pairwise_reduce_scatter(
      std::move(first), shard, detail::equal_chunks(head, per_host, shard_numel), step_op, {})();
  ProcessGroup across_hosts = r.across;  // a handle: collectives are not const
  auto across = std::make_shared<Work>(across_hosts.all_reduce_async(shard, step_op));
  detail::PointToPointCall last =
      r.local.state_->next_point_to_point(detail::describe(op, r.local));
  return Internals::launch(self, op, {},
                           [across, tail, last, head, shard, tensor, op_kind, world]() {
                             across->wait();
                             detail::start_pairwise_all_gather(last, head, shard)();
                             detail::release_completed(shard);
                             tail->wait();
                             if (op_kind == ReduceOp::AVG) tensor.div_(world);
                           });
}

}  // namespace dist
}  // namespace fsdp
