// The rendezvous agent joining a round: the store, a node rank, the job's shape, a round that
// forms while everyone's heartbeat is watched, and the address this node's ranks bind. See
// agent_loop.h and rendezvous.h.
#include <algorithm>
#include <exception>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fsdp/compat_backends.h"
#include "launch/agent_loop.h"
#include "util/net.h"

namespace fsdp_run {

using agent::bytes;
using agent::Clock;
using agent::JoinError;
using agent::kTick;
using agent::ms;
using agent::nnodes_text;
using agent::split_list;
using agent::text;
using fsdp::detail::host_name;

namespace {

std::string config_text(const AgentConfig& c) {
  return "--nnodes " + nnodes_text(c) + " --nproc-per-node " + std::to_string(c.nproc_per_node) +
         " --max-restarts " + std::to_string(c.max_restarts);
}

// The launchers' keys: a job with an id of its own (--rdzv-id) keeps them apart from other jobs'
// in a store that several share.
std::string store_prefix(const AgentConfig& c) {
  return c.rdzv_id.empty() || c.rdzv_id == "none" ? "/fsdp-run" : "/fsdp-run/" + c.rdzv_id;
}

std::string seconds(double s) { return std::to_string(static_cast<int64_t>(s + 0.5)) + " s"; }

}  // namespace

AgentLoop::AgentLoop(std::shared_ptr<JobAgent::Shared> s)
    : s_(std::move(s)),
      cfg_(s_->cfg),
      node_(cfg_.node_rank),
      watch_(cfg_.lost_after, HeartbeatWatch::look_period(cfg_.lost_after)),
      look_period_(HeartbeatWatch::look_period(cfg_.lost_after)) {}

void AgentLoop::run() {
  for (bool first = true;; first = false) {
    try {
      if (first) handshake();
      join_round();
    } catch (const JoinError& e) {
      give_up_join(e.what());
      return;
    } catch (const std::exception& e) {  // a store call failed: the store is gone
      give_up_join("lost the job's store at " + where() + " while the job formed: " + e.what() +
                   "; the host that held it (node 0's, or the one --rdzv-endpoint names) or its "
                   "launcher is gone");
      return;
    }
    if (!watch()) return;  // else the launcher asked for the next round
  }
}

// The store: hosted here (kHost), joined (kClient), or hosted here unless another process on this
// machine already listens on its port (kHostIfFree: two launchers of one job on one machine).
void AgentLoop::open_store() {
  const auto timeout = ms(cfg_.join_timeout);
  const auto port = static_cast<std::uint16_t>(cfg_.store_port);
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  if (cfg_.store_role != StoreRole::kClient) {
    try {
      tcp = fsdp::compat::make_tcp_store(cfg_.store_host, port, true, -1, timeout);
      hosts_store_ = true;
    } catch (const std::exception& e) {
      if (cfg_.store_role == StoreRole::kHost)
        throw JoinError("could not host the job's store on port " +
                        std::to_string(cfg_.store_port) + ": " + e.what() +
                        " (is the port in use? --master-port or --rdzv-endpoint chooses another)");
    }
  }
  if (!tcp) {
    try {
      tcp = fsdp::compat::make_tcp_store(cfg_.store_host, port, false, -1, timeout);
    } catch (const std::exception& e) {
      throw JoinError("could not reach the job's store at " + where() + " within " +
                      seconds(cfg_.join_timeout) + ": " + e.what() +
                      " (is fsdp-run running on the store's host, node rank 0 with the same "
                      "--master-addr and --master-port, or the host that --rdzv-endpoint names?)");
    }
  }
  tcp->setTimeout(ms(cfg_.read_timeout));  // torchrun's read_timeout, once connected
  store_ = c10::make_intrusive<c10d::PrefixStore>(store_prefix(cfg_), tcp);
  learn([&](AgentState& st) { st.hosts_store = hosts_store_; });
  heard();
}

// Node rank `node` is free when every launcher that claimed it was given up as lost (node/<i>
// counts the claims, lost/<i> the ones given up). Two racing claims: the second backs off.
bool AgentLoop::try_claim(int node) {
  const std::string id = std::to_string(node);
  const int64_t lost = count("lost/" + id);
  if (store().add("node/" + id, 1) == lost + 1) {
    lost_at_claim_ = lost;
    return true;
  }
  store().add("node/" + id, -1);  // a claim refused does not stand
  return false;
}

void AgentLoop::claim_node_rank() {
  if (cfg_.node_rank >= 0) {
    node_ = cfg_.node_rank;
    if (try_claim(node_)) return;
    fail_join("two launchers were started with --node-rank " + std::to_string(node_) +
              (late_ ? " (if this one replaces a launcher that is gone, node 0 frees its node "
                       "rank once it has been silent for keep_alive_interval x "
                       "keep_alive_max_attempt: start this one again after that)"
                     : ""));
  }
  for (int i = 0; i < cfg_.max_nodes; ++i) {
    if (try_claim(i)) {
      node_ = i;
      return;
    }
  }
  throw JoinError("every node rank of --nnodes " + nnodes_text(cfg_) +
                  " is taken: " + std::to_string(cfg_.max_nodes) +
                  " launchers hold the job's store at " + where() + " already");
}

// Once per job: the store, a node rank, this node's route to the store, the job's shape checked
// against node 0's. A launcher that comes to a running job (a host back after it was lost, or one
// more, up to MAX) joins the round after the last one that formed.
void AgentLoop::handshake() {
  open_store();
  if (store().check({"formed"})) {
    late_ = true;
    round_ = std::stoi(text(store().get("formed"))) + 1;
  }
  claim_node_rank();
  const std::string id = std::to_string(node_);
  learn([&](AgentState& st) { st.node_rank = node_; });
  store().set("host/" + id, bytes(host_name()));
  const auto route = fsdp::detail::route_towards(cfg_.store_host, cfg_.store_port);
  const NodeRoute self{node_, host_name(), route ? route->local : "", route ? route->remote : ""};
  store().set("route/" + id, bytes(self.encode()));
  beat();  // watched from now on, also while the job forms
  if (hosts_store_) store().set("store_host", bytes(id));
  if (node_ == 0 && !store().check({"config"})) {
    run_id_ = cfg_.run_id.empty() ? new_run_id() : cfg_.run_id;
    store().set("run_id", bytes(run_id_));
    store().set("config", bytes(config_text(cfg_)));  // last: the others read run_id after it
    return;
  }
  const std::string theirs = wait_for_key("config", "node 0's launcher set the job's shape");
  if (theirs != config_text(cfg_))
    fail_join("node " + id + " was started with " + config_text(cfg_) + " but node 0 with " +
              theirs + "; every node must be given the same");
  run_id_ = text(store().get("run_id"));
  // Node 0 hosting the store: its loss is the store's, noticed at once (or by the store's
  // silence), so its heartbeat needs no watching, and this launcher asks the store less (on
  // LibTorch 1.13 a client stopped in the middle of a request stalls the whole store).
  watch_coordinator_ = !(store().check({"store_host"}) && text(store().get("store_host")) == "0");
}

// Waits for `key` (set by node 0) while keeping this node's heartbeat and watching node 0's.
std::string AgentLoop::wait_for_key(const std::string& key, const char* what) {
  const auto deadline = Clock::now() + ms(cfg_.join_timeout);
  for (;;) {
    if (store().check({key})) return text(store().get(key));
    heard();
    if (Clock::now() >= deadline)
      throw JoinError("nothing came from node 0 within " + seconds(cfg_.join_timeout) +
                      " (--join-timeout): waited until " + what);
    bool stopped = false;
    while_forming(stopped);
    if (stopped) throw JoinError("stopped while waiting for the other nodes");
  }
}

// Joins round_ and waits until it has formed with this node (elastic: a node too late for a
// round waits for the next one).
void AgentLoop::join_round() {
  reclaim_after_loss();
  for (;; ++round_) {
    store().set(rk("in/") + std::to_string(node_), bytes("1"));
    store().add(rk("joined"), 1);
    joined_ = true;
    lost_nodes_.clear();
    last_status_ = Clock::now();
    members_ = cfg_.elastic() ? form_round() : everyone();
    if (std::find(members_.begin(), members_.end(), node_) != members_.end()) break;
  }
  posted_ = left_ = all_left_ = known_failure_ = false;
  watch_.clear();  // heartbeats are judged afresh each round
  choose_address();
  const int group_rank =
      static_cast<int>(std::find(members_.begin(), members_.end(), node_) - members_.begin());
  learn([&](AgentState& st) {
    AgentState next;  // nothing of the last round's outcome carries over
    next.node_rank = node_;
    next.hosts_store = hosts_store_;
    next.address = st.address;
    next.news = st.news;
    next.joined = true;
    next.round = round_;
    next.run_id = run_id_;
    next.group_rank = group_rank;
    next.group_world = static_cast<int>(members_.size());
    next.members = agent::join_list(members_);
    st = std::move(next);
  });
}

// A launcher that node 0 gave up (it was silent: its host hung, then came back) claims its node
// rank again, as a new launcher there would: whichever comes first keeps it, and the other leaves
// rather than join twice.
void AgentLoop::reclaim_after_loss() {
  const std::string id = std::to_string(node_);
  const int64_t lost = count("lost/" + id);
  if (lost == lost_at_claim_) return;
  if (store().add("node/" + id, 1) != lost + 1) {
    store().add("node/" + id, -1);
    throw JoinError("node " + id +
                    " was given up as lost (its launcher silent past keep_alive_interval x "
                    "keep_alive_max_attempt, or missing from a round), and another fsdp-run has "
                    "taken node rank " +
                    id + " since");
  }
  lost_at_claim_ = lost;
}

// A job of fixed size: every node, once all have joined.
std::vector<int> AgentLoop::everyone() {
  const auto deadline = Clock::now() + ms(cfg_.join_timeout);
  for (;;) {
    if (auto f = posted_failure()) throw JoinError(f->what);
    if (count(rk("joined")) >= cfg_.max_nodes) break;
    heard();
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int i = 0; i < cfg_.max_nodes; ++i)
        if (!store().check({rk("in/") + std::to_string(i)}))
          missing += (missing.empty() ? "" : ", ") + std::to_string(i);
      fail_join("node rank(s) " + missing + " did not join" +
                (round_ > 0 ? " restart " + std::to_string(round_) : std::string()) + " within " +
                seconds(cfg_.join_timeout) + " (--join-timeout); is fsdp-run running there with " +
                "--nnodes " + nnodes_text(cfg_) + " and the job's store at " + where() + "?");
    }
    bool stopped = false;
    while_forming(stopped);
    if (stopped) {
      withdraw();
      throw JoinError("stopped while waiting for the other nodes");
    }
  }
  if (node_ == 0) store().set("formed", bytes(std::to_string(round_)));
  std::vector<int> all(static_cast<size_t>(cfg_.max_nodes));
  for (int i = 0; i < cfg_.max_nodes; ++i) all[static_cast<size_t>(i)] = i;
  return all;
}

// Elastic: node 0 forms the round once MAX nodes have joined, or MIN have and
// last_call_timeout has passed since; the others wait for the list.
std::vector<int> AgentLoop::form_round() {
  // The others wait longer than node 0, which says why a round could not form.
  const auto deadline =
      Clock::now() + ms(cfg_.join_timeout) + (node_ == 0 ? ms(0) : ms(cfg_.last_call_timeout + 10));
  bool enough = false;  // MIN nodes have joined, since enough_since
  Clock::time_point enough_since{};
  for (;;) {
    if (auto f = posted_failure()) throw JoinError(f->what);
    if (store().check({rk("members")})) return split_list(text(store().get(rk("members"))));
    if (node_ == 0) {
      const int64_t n = count(rk("joined"));
      if (n < cfg_.min_nodes) enough = false;  // a node took its join back, or was lost
      if (n >= cfg_.min_nodes && !enough) {
        enough = true;
        enough_since = Clock::now();
      }
      if (n >= cfg_.max_nodes ||
          (enough && Clock::now() - enough_since >= ms(cfg_.last_call_timeout)))
        return close_round();
    }
    heard();
    if (Clock::now() >= deadline) {
      // --join-timeout bounds the wait for MIN nodes, not the last call after them.
      if (node_ == 0 && count(rk("joined")) >= cfg_.min_nodes) return close_round();
      break;
    }
    bool stopped = false;
    while_forming(stopped);
    if (stopped) {
      withdraw();
      throw JoinError("stopped while waiting for the other nodes");
    }
  }
  if (node_ != 0)
    fail_join((round_ > 0 ? "restart " + std::to_string(round_) : std::string("the job")) +
              " did not form: node 0 named no members (is its fsdp-run running with --nnodes " +
              nnodes_text(cfg_) + "?)");
  fail_join("only " + std::to_string(count(rk("joined"))) + " node(s) joined" +
            (round_ > 0 ? " restart " + std::to_string(round_) : std::string()) + " within " +
            seconds(cfg_.join_timeout) + " (--join-timeout); --nnodes " + nnodes_text(cfg_) +
            " needs at least " + std::to_string(cfg_.min_nodes));
}

// Node 0, elastic: the round's members are the nodes that joined it so far; a node joining
// after this waits for the next round.
std::vector<int> AgentLoop::close_round() {
  std::vector<int> members;
  for (int i = 0; i < cfg_.max_nodes; ++i)
    if (store().check({rk("in/") + std::to_string(i)})) members.push_back(i);
  // A node of the last round that did not come back is given up, so that a new launcher may
  // take its node rank (its old one, if it was only slow, claims it again: join_round).
  for (int i : members_)
    if (std::find(members.begin(), members.end(), i) == members.end()) give_up(i);
  store().set(rk("members"), bytes(agent::join_list(members)));
  store().set("formed", bytes(std::to_string(round_)));
  return members;
}

// One tick of waiting for a round: this node's heartbeat, the others' judged (node 0 judges
// everyone's, the others node 0's), now and then a line on whom we wait for, then a nap.
void AgentLoop::while_forming(bool& stopped) {
  beat();
  if (Clock::now() - last_look_ >= ms(look_period_)) {
    last_look_ = Clock::now();
    if (node_ == 0)
      judge_forming_heartbeats();
    else if (watch_coordinator_)
      check_coordinator();
    if (auto f = posted_failure()) throw JoinError(f->what);
  }
  if (Clock::now() - last_status_ >= ms(cfg_.status_interval)) {
    last_status_ = Clock::now();
    say_whom_we_wait_for();
  }
  stopped = sleep_or_stop(kTick);
}

// Node 0, while a round forms: every launcher holding a node rank beats; one silent for
// lost_after is lost.
void AgentLoop::judge_forming_heartbeats() {
  for (int i = 1; i < cfg_.max_nodes; ++i) {
    const std::string id = std::to_string(i);
    if (count("node/" + id) <= count("lost/" + id)) {  // no launcher holds node rank i
      watch_.forget(i);
      continue;
    }
    const double still = watch_.see(i, count("alive/" + id), Clock::now());
    if (watch_.lost(still)) drop_lost_node(i, still);
  }
}

// Node 0: node `node`'s launcher is gone while the job forms. A job of fixed size cannot start
// without it; an elastic one forms without it (if MIN nodes are left).
void AgentLoop::drop_lost_node(int node, double silent) {
  const std::string id = std::to_string(node), who = node_name(node);
  if (store().deleteKey(rk("in/") + id)) store().add(rk("joined"), -1);
  give_up(node);
  watch_.forget(node);
  const std::string why =
      who + " was lost while " +
      (round_ > 0 ? "round " + std::to_string(round_) : std::string("the job")) +
      " formed: its launcher sent no heartbeat for " + seconds(silent) +
      " (keep_alive_interval x keep_alive_max_attempt: " + seconds(cfg_.lost_after) + ")";
  if (!cfg_.elastic()) fail_join(why);
  lost_nodes_ += (lost_nodes_.empty() ? "" : ", ") + who;
  store().set(rk("lost_nodes"), bytes(lost_nodes_));
  news("fsdp-run: " + why + "; the round forms without it");
}

void AgentLoop::say_whom_we_wait_for() {
  std::vector<int> in;
  std::string missing;
  for (int i = 0; i < cfg_.max_nodes; ++i) {
    if (store().check({rk("in/") + std::to_string(i)}))
      in.push_back(i);
    else
      missing += (missing.empty() ? "" : ", ") + std::to_string(i);
  }
  std::string line = "fsdp-run: node " + std::to_string(node_) + ": " +
                     (round_ > 0 ? "restart " + std::to_string(round_) : std::string("the job")) +
                     " waits: " + std::to_string(in.size()) + " of --nnodes " + nnodes_text(cfg_) +
                     " joined (node" + (in.size() == 1 ? " " : "s ") + agent::join_list(in) + ")";
  if (cfg_.elastic())
    line += "; it forms at " + std::to_string(cfg_.min_nodes) + " after the last call";
  else
    line += "; waiting for node rank(s) " + missing;
  if (store().check({rk("lost_nodes")}))
    line += "; lost while it formed: " + text(store().get(rk("lost_nodes")));
  news(line);
}

// Once the round formed: the address this node's ranks bind, from the members' routes to the
// store (node_address.h). A node whose ranks would bind loopback while others are elsewhere
// refuses to start, unless the user chose the ranks' address (GLOO_SOCKET_IFNAME, ...).
void AgentLoop::choose_address() {
  AddressFacts f;
  f.local_addr = cfg_.local_addr;
  f.store = cfg_.store_host;
  for (int m : members_) {
    const std::string key = "route/" + std::to_string(m);
    if (!store().check({key})) continue;
    auto r = NodeRoute::decode(m, text(store().get(key)));
    if (!r) continue;
    if (m == node_)
      f.self = *r;
    else
      f.others.push_back(*r);
  }
  f.route_from_here = [](const std::string& a) {
    return fsdp::detail::local_address_towards(a, 1);
  };
  f.interface_of = [](const std::string& a) { return fsdp::detail::interface_of(a); };
  NodeAddress a = choose_node_address(f);
  const std::string who = "node " + std::to_string(node_) + " (" + host_name() + ")";
  if (a.refusal && !cfg_.gloo_address_given) fail_join(who + " refuses to start: " + *a.refusal);
  // Said once per job, and again when an elastic round changes who is where.
  const std::string line =
      cfg_.gloo_address_given
          ? "fsdp-run: " + who +
                ": GLOO_SOCKET_IFNAME or FSDP_GLOO_HOSTNAME chooses its ranks' "
                "address (else " +
                a.describe() + ": " + a.why + ")"
          : "fsdp-run: " + who + ": its ranks bind " + a.describe() + " for Gloo: " + a.why;
  if (line != last_address_line_) news(line);
  last_address_line_ = line;
  learn([&](AgentState& st) { st.address = a; });
}

// Fails the join for everyone with `what`, and for this launcher. A launcher that came to a
// running job fails alone: the job goes on without it.
void AgentLoop::fail_join(const std::string& what) {
  if (!late_) post_failure(Failure{node_, 2, what});
  throw JoinError(what);
}

// This launcher was stopped (Ctrl-C) while it waited for a round: it takes its join back, so
// that node 0 neither counts it into the round nor (elastic) restarts the running job for it.
// If the round closed with it meanwhile, the others would wait for its ranks until its
// heartbeat is missed: it posts a failure instead, which starts the next round without it.
void AgentLoop::withdraw() {
  if (!joined_) return;
  try {
    const std::string id = std::to_string(node_);
    if (store().deleteKey(rk("in/") + id)) store().add(rk("joined"), -1);
    joined_ = false;
    if (store().check({rk("members")})) {
      const std::vector<int> m = split_list(text(store().get(rk("members"))));
      if (std::find(m.begin(), m.end(), node_) != m.end())
        post_failure(Failure{
            node_, 2,
            "node " + id + " was stopped as round " + std::to_string(round_) + " formed with it"});
    }
  } catch (const std::exception&) {
    // The store is gone: there is no join left to take back.
  }
}

// The join failed: the store's host keeps it up a little for the others to read why (until every
// launcher that had joined this round has given up too, at most close_timeout), then the
// launcher hears of it.
void AgentLoop::give_up_join(const std::string& why) {
  if (store_ && joined_) {
    const auto until = Clock::now() + ms(cfg_.close_timeout);
    try {
      store().add(rk("gave_up"), 1);
      if (hosts_store_)
        while (Clock::now() < until && count(rk("gave_up")) < count(rk("joined")))
          if (sleep_or_stop(kTick)) break;
    } catch (const std::exception&) {
    }
  }
  learn([&](AgentState& st) { st.join_error = why; });
}

}  // namespace fsdp_run
