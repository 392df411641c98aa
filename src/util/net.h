// Internal: this host's network addresses, as the library (which address Gloo binds) and the
// launcher (which address a node's ranks are reached by) both need to know them. Plain POSIX: no
// LibTorch, so that fsdp-run's launcher layer can use it too.
//
// Addresses are numeric strings ("10.0.0.2", "fe80::1"); a host may be a name or an address.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

/// One address of one of this host's interfaces (getifaddrs).
struct InterfaceAddress {
  std::string interface;  // "eth0", "lo"
  std::string address;    // numeric
};

/// Every IPv4 and IPv6 address of this host's interfaces that are up.
std::vector<InterfaceAddress> interface_addresses();

/// The interface that holds `address` (numeric), or nullopt when none of this host's does.
std::optional<std::string> interface_of(const std::string& address);

/// Whether `host` is written as a loopback address: "localhost", "::1" or 127.x.y.z. A name that
/// only resolves to loopback (a host's own name in a stock Debian /etc/hosts) is not.
bool is_loopback(const std::string& host);

/// Whether the numeric `address` is a loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z).
bool is_loopback_address(const std::string& address);

/// `host`'s addresses, numeric, in the order getaddrinfo gives them (the order a TCP client,
/// c10d's among them, tries them in); empty when it does not resolve.
std::vector<std::string> resolve(const std::string& host);

/// A route from this host: the local address it sends from, to the remote address it reaches.
struct Route {
  std::string local, remote;  // numeric
};

/// The route to `host`:`port` (no packet is sent: a connected UDP socket only asks the routing
/// table), for the first of `host`'s addresses that has one; nullopt when `host` does not
/// resolve or has no route.
std::optional<Route> route_towards(const std::string& host, int port);

/// route_towards(host, port)'s local address, or empty.
std::string local_address_towards(const std::string& host, int port);

/// Whether `host` names this machine, as torchrun decides who hosts a c10d rendezvous store:
/// "localhost", a loopback address, this machine's host name, or a name or address that resolves
/// to one of this machine's interface addresses.
bool names_this_machine(const std::string& host);

/// This machine's host name ("unknown host" if it has none).
std::string host_name();

}  // namespace detail
}  // namespace fsdp
