// The store of a job on one node, hosted by fsdp-run itself, as torchrun's agent hosts it
// (issue 62, item 5).
//
// Rank 0 used to host it at a port that fsdp-run had picked free a moment before (and picked
// again for every restart): between the pick and rank 0's bind any process could take the port,
// and the job then failed to start. fsdp-run now binds the store before any rank starts, at the
// port the kernel gives it (or --master-port), and keeps it for every round; the ranks are its
// clients (TORCHELASTIC_USE_AGENT_STORE=True), each round under keys of its own
// (/worker/attempt_<TORCHELASTIC_RESTART_COUNT>/), as across hosts.
#pragma once

#include <memory>
#include <string>

namespace fsdp_run {

struct Options;

/// Hosts the store at o.store_host:o.store_port (0: a port the kernel picks, written back into
/// o.store_port). Returns what keeps it up, or null with `error` saying why not.
std::shared_ptr<void> host_local_store(Options& o, std::string& error);

}  // namespace fsdp_run
