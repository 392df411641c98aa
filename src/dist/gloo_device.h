// Which network address Gloo's transport uses on this host (issue 40).
//
// PyTorch users pick it with GLOO_SOCKET_IFNAME (interface names, comma-separated); without it,
// Gloo binds the address the host's name resolves to, which on a stock Debian /etc/hosts is
// loopback: a job across hosts then fails with "connect [127.0.0.1]:..." on one side while the
// other side waits. We honour GLOO_SOCKET_IFNAME, keep FSDP_GLOO_HOSTNAME and
// InitOptions::gloo_hostname, and otherwise take the local address of the route to the master,
// which is the address the other hosts can reach whenever they can reach the master.
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
  std::string chosen_by;                // what decided it, for the log line and for errors

  // "10.77.7.2 (the route to MASTER_ADDR 10.77.7.1)", "interfaces eth1,eth2 (GLOO_SOCKET_IFNAME)".
  std::string describe() const;
};

// The device for a rank whose master (the TCPStore's host) is `master_addr`:`master_port`.
// `option` is InitOptions::gloo_hostname. Order: the option, FSDP_GLOO_HOSTNAME,
// GLOO_SOCKET_IFNAME, 127.0.0.1 for a loopback master, the route to the master, and last Gloo's
// default (the address of the host's name) when there is no route.
GlooDevice choose_gloo_device(const std::optional<std::string>& option,
                              const std::string& master_addr, int master_port);

// The local address this host would send from to reach `host`:`port` (no packet is sent: a
// connected UDP socket only asks the routing table). Empty when `host` does not resolve or has
// no route.
std::string local_address_towards(const std::string& host, int port);

// Whether `addr` names this host's loopback ("localhost", "::1", 127.x.y.z).
bool is_loopback(const std::string& addr);

// How to choose another device, for an error that follows a failed connection.
std::string gloo_device_hint(const GlooDevice& device);

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
