// Which network address Gloo's transport uses on this host (issues 40, 60).
//
// PyTorch users pick it with GLOO_SOCKET_IFNAME (interface names, comma-separated); without it,
// Gloo binds the address the host's name resolves to, which on a stock Debian /etc/hosts is
// loopback: a job across hosts then fails with "connect [127.0.0.1]:..." on one side while the
// other side waits. We honour GLOO_SOCKET_IFNAME, keep FSDP_GLOO_HOSTNAME and
// InitOptions::gloo_hostname; then take the address fsdp-run chose for this node (FSDP_NODE_ADDR:
// on the store's own host it is the address the other hosts reached the store by, see
// src/launch/node_address.h); and otherwise the local address of the route to the master, which
// is the address the other hosts can reach whenever they can reach the master. A job that spans
// hosts and would still bind loopback (MASTER_ADDR is this host's name, which resolves to
// loopback here) is refused with the variables that fix it, rather than left to hang.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace dist {
namespace detail {

struct GlooDevice {
  std::vector<std::string> interfaces;  // non-empty: one Gloo device per interface, by name
  std::string address;                  // else this address; empty: Gloo's default device
  std::string interface;                // the interface that holds `address`, when known
  std::string chosen_by;                // what decided it, for the log line and for errors

  // "10.77.7.2 (eth0; the route to MASTER_ADDR 10.77.7.1)",
  // "interfaces eth1,eth2 (GLOO_SOCKET_IFNAME)".
  std::string describe() const;
};

// The device for a rank whose master (the TCPStore's host) is `master_addr`:`master_port`.
// `option` is InitOptions::gloo_hostname; `spans_hosts` says the launcher put the job's ranks on
// several hosts. Order: the option, FSDP_GLOO_HOSTNAME, GLOO_SOCKET_IFNAME, FSDP_NODE_ADDR (set by
// fsdp-run), 127.0.0.1 for a master written as a loopback address, the route to the master, and
// last Gloo's default (the address of the host's name) when there is no route. Throws ValueError
// when the job spans hosts and the route to the master is loopback.
GlooDevice choose_gloo_device(const std::optional<std::string>& option,
                              const std::string& master_addr, int master_port, bool spans_hosts,
                              int rank);

// How to choose another device, for an error that follows a failed connection.
std::string gloo_device_hint(const GlooDevice& device);

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
