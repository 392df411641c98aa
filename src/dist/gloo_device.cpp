// Choosing Gloo's network address: see gloo_device.h.
#include "dist/gloo_device.h"

#include <utility>

#include "fsdp/errors.h"
#include "util/env.h"
#include "util/message.h"
#include "util/net.h"

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

GlooDevice at(std::string address, std::string chosen_by) {
  GlooDevice d;
  d.interface = fsdp::detail::interface_of(address).value_or("");
  d.address = std::move(address);
  d.chosen_by = std::move(chosen_by);
  return d;
}

}  // namespace

GlooDevice choose_gloo_device(const std::optional<std::string>& option,
                              const std::string& master_addr, int master_port, bool spans_hosts,
                              int rank) {
  using fsdp::detail::get_env;
  if (option) return at(*option, "InitOptions::gloo_hostname");
  if (auto h = get_env("FSDP_GLOO_HOSTNAME")) return at(*h, "FSDP_GLOO_HOSTNAME");
  if (auto names = split_names(get_env("GLOO_SOCKET_IFNAME").value_or("")); !names.empty()) {
    GlooDevice d;
    d.interfaces = std::move(names);
    d.chosen_by = "GLOO_SOCKET_IFNAME";
    return d;
  }
  if (auto a = get_env("FSDP_NODE_ADDR"))
    return at(*a,
              msg("fsdp-run: ", get_env("FSDP_NODE_ADDR_WHY").value_or("its launcher's choice")));
  if (fsdp::detail::is_loopback(master_addr))
    return at("127.0.0.1", msg("MASTER_ADDR ", master_addr, " is on this host"));
  const auto route = fsdp::detail::route_towards(master_addr, master_port);
  if (!route) {
    GlooDevice d;
    d.chosen_by = msg("no route to MASTER_ADDR ", master_addr, ": the address of the host's name");
    return d;
  }
  if (spans_hosts && fsdp::detail::is_loopback_address(route->local))
    throw ValueError(msg(
        "init_process_group: ", fsdp::detail::rank(rank), ": the job spans hosts, but MASTER_ADDR ",
        master_addr, " resolves to ", route->remote, " on this host, so Gloo would bind ",
        route->local,
        ", which the other hosts cannot reach; set GLOO_SOCKET_IFNAME=<interface> (as "
        "with PyTorch) or FSDP_GLOO_HOSTNAME=<this host's address> (fsdp-run finds the address by "
        "itself)"));
  return at(route->local, msg("the route to MASTER_ADDR ", master_addr));
}

std::string GlooDevice::describe() const {
  if (!interfaces.empty()) {
    std::string names;
    for (const auto& n : interfaces) names += (names.empty() ? "" : ",") + n;
    return msg("interface", interfaces.size() > 1 ? "s " : " ", names, " (", chosen_by, ")");
  }
  return msg(address.empty() ? std::string("Gloo's default device") : address, " (",
             interface.empty() ? std::string() : interface + "; ", chosen_by, ")");
}

std::string gloo_device_hint(const GlooDevice& device) {
  return msg("this rank's Gloo transport is on ", device.describe(),
             "; GLOO_SOCKET_IFNAME=<interface> or FSDP_GLOO_HOSTNAME=<address> chooses another");
}

}  // namespace detail
}  // namespace dist
}  // namespace fsdp
