// This host's network addresses: see net.h.
#include "util/net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

namespace fsdp {
namespace detail {

namespace {

// The numeric form of an IPv4 or IPv6 socket address; empty for any other family.
std::string numeric(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* where = nullptr;
  if (sa->sa_family == AF_INET)
    where = &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
  else if (sa->sa_family == AF_INET6)
    where = &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  if (where == nullptr || ::inet_ntop(sa->sa_family, where, text, sizeof text) == nullptr)
    return "";
  return text;
}

// getaddrinfo's answers for `host` (a stream socket's), or null; free with freeaddrinfo.
addrinfo* lookup(const std::string& host, int port, int socktype) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = socktype;
  addrinfo* found = nullptr;
  const std::string service = port > 0 ? std::to_string(port) : std::string();
  if (::getaddrinfo(host.c_str(), service.empty() ? nullptr : service.c_str(), &hints, &found) != 0)
    return nullptr;
  return found;
}

}  // namespace

std::vector<InterfaceAddress> interface_addresses() {
  std::vector<InterfaceAddress> out;
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return out;
  for (const ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || !(a->ifa_flags & IFF_UP)) continue;
    std::string addr = numeric(a->ifa_addr);
    if (!addr.empty()) out.push_back({a->ifa_name, std::move(addr)});
  }
  ::freeifaddrs(all);
  return out;
}

std::optional<std::string> interface_of(const std::string& address) {
  for (const auto& a : interface_addresses())
    if (a.address == address) return a.interface;
  // 127.0.1.1 and the rest of 127/8 belong to lo without being listed on it.
  if (is_loopback_address(address)) return std::string("lo");
  return std::nullopt;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

bool is_loopback_address(const std::string& address) {
  in_addr v4{};
  if (::inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, address.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

std::vector<std::string> resolve(const std::string& host) {
  std::vector<std::string> out;
  addrinfo* found = lookup(host, 0, SOCK_STREAM);
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    std::string addr = numeric(a->ai_addr);
    if (!addr.empty() && std::find(out.begin(), out.end(), addr) == out.end())
      out.push_back(std::move(addr));
  }
  if (found != nullptr) ::freeaddrinfo(found);
  return out;
}

std::optional<Route> route_towards(const std::string& host, int port) {
  addrinfo* found = lookup(host, port, SOCK_DGRAM);
  std::optional<Route> out;
  for (addrinfo* a = found; a != nullptr && !out; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      Route r{numeric(reinterpret_cast<const sockaddr*>(&local)), numeric(a->ai_addr)};
      if (!r.local.empty() && !r.remote.empty()) out = std::move(r);
    }
    ::close(fd);
  }
  if (found != nullptr) ::freeaddrinfo(found);
  return out;
}

std::string local_address_towards(const std::string& host, int port) {
  const auto r = route_towards(host, port);
  return r ? r->local : std::string();
}

bool names_this_machine(const std::string& host) {
  if (is_loopback(host) || host == host_name()) return true;
  const auto mine = interface_addresses();
  for (const std::string& addr : resolve(host)) {
    if (is_loopback_address(addr)) return true;
    for (const auto& a : mine)
      if (a.address == addr) return true;
  }
  return false;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown host";
  return buf;
}

}  // namespace detail
}  // namespace fsdp
