// Choosing Gloo's network address: see gloo_device.h.
#include "dist/gloo_device.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <utility>

#include "util/env.h"
#include "util/message.h"

namespace fsdp {
namespace dist {
namespace detail {

using fsdp::detail::msg;

namespace {

// "eth0,eth1" -> {"eth0", "eth1"}, empty names dropped, as PyTorch splits GLOO_SOCKET_IFNAME.
std::vector<std::string> split_names(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) out.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

}  // namespace

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[INET6_ADDRSTRLEN] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* where =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, where, text, sizeof text) != nullptr) out = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return out;
}

GlooDevice choose_gloo_device(const std::optional<std::string>& option,
                              const std::string& master_addr, int master_port) {
  GlooDevice d;
  if (option) {
    d.address = *option;
    d.chosen_by = "InitOptions::gloo_hostname";
  } else if (auto h = fsdp::detail::get_env("FSDP_GLOO_HOSTNAME")) {
    d.address = *h;
    d.chosen_by = "FSDP_GLOO_HOSTNAME";
  } else if (auto names = split_names(fsdp::detail::get_env("GLOO_SOCKET_IFNAME").value_or(""));
             !names.empty()) {
    d.interfaces = std::move(names);
    d.chosen_by = "GLOO_SOCKET_IFNAME";
  } else if (is_loopback(master_addr)) {
    d.address = "127.0.0.1";
    d.chosen_by = msg("MASTER_ADDR ", master_addr, " is on this host");
  } else if (std::string local = local_address_towards(master_addr, master_port); !local.empty()) {
    d.address = local;
    d.chosen_by = msg("the route to MASTER_ADDR ", master_addr);
  } else {
    d.chosen_by = msg("no route to MASTER_ADDR ", master_addr, ": the address of the host's name");
  }
  return d;
}

std::string GlooDevice::describe() const {
  if (!interfaces.empty()) {
    std::string names;
    for (const auto& n : interfaces) names += (names.empty() ? "" : ",") + n;
    return msg("interface", interfaces.size() > 1 ? "s " : " ", names, " (", chosen_by, ")");
  }
  return msg(address.empty() ? std::string("Gloo's default device") : address, " (", chosen_by,
             ")");
}

std::string gloo_device_hint(const GlooDevice& device) {
  return msg("this rank's Gloo transport is on ", device.describe(),
             "; GLOO_SOCKET_IFNAME=<interface> or FSDP_GLOO_HOSTNAME=<address> chooses another");
}

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
