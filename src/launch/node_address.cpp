// Which address a node's ranks bind: see node_address.h.
#include "launch/node_address.h"

#include <sstream>

#include "util/net.h"

namespace fsdp_run {

using fsdp::detail::is_loopback_address;

std::string NodeRoute::encode() const { return local + " " + reached + " " + host; }

std::optional<NodeRoute> NodeRoute::decode(int node, const std::string& text) {
  NodeRoute r;
  r.node = node;
  std::istringstream in(text);
  if (!(in >> r.local >> r.reached)) return std::nullopt;
  std::getline(in >> std::ws, r.host);
  return r;
}

std::string NodeAddress::describe() const {
  return interface.empty() ? address : address + " (" + interface + ")";
}

namespace {

NodeAddress chosen(const AddressFacts& f, const std::string& address, std::string why) {
  NodeAddress a;
  a.address = address;
  a.interface = f.interface_of ? f.interface_of(address).value_or("") : "";
  a.why = std::move(why);
  return a;
}

std::string node_name(const NodeRoute& r) {
  return "node " + std::to_string(r.node) + (r.host.empty() ? "" : " (" + r.host + ")");
}

}  // namespace

NodeAddress choose_node_address(const AddressFacts& f) {
  if (!f.local_addr.empty()) return chosen(f, f.local_addr, "--local-addr");
  if (!is_loopback_address(f.self.local))
    return chosen(f, f.self.local,
                  "the route to the job's store at " + f.store + " (" + f.self.reached + ")");
  // The store is on this host. The nodes whose own route to it is not loopback are elsewhere.
  std::vector<const NodeRoute*> elsewhere;
  for (const NodeRoute& r : f.others)
    if (!is_loopback_address(r.local)) elsewhere.push_back(&r);
  if (elsewhere.empty()) return chosen(f, f.self.local, "every node of the job is on this host");
  for (const NodeRoute* r : elsewhere)
    if (!is_loopback_address(r->reached) && f.interface_of && f.interface_of(r->reached))
      return chosen(f, r->reached,
                    "the address " + node_name(*r) + "'s launcher reached the job's store at; " +
                        f.store + " resolves to " + f.self.reached + " here");
  for (const NodeRoute* r : elsewhere) {
    const std::string here = f.route_from_here ? f.route_from_here(r->local) : std::string();
    if (!here.empty() && !is_loopback_address(here))
      return chosen(f, here, "the route to " + node_name(*r) + " at " + r->local);
  }
  NodeAddress a = chosen(f, f.self.local, "");
  a.refusal = "this node's ranks would bind " + f.self.local + " (" + f.store + " resolves to " +
              f.self.reached + " here), which " + node_name(*elsewhere.front()) + " at " +
              elsewhere.front()->local +
              " cannot reach, and no address of this host was found on a route to it; set "
              "GLOO_SOCKET_IFNAME=<interface> (as with PyTorch) or FSDP_GLOO_HOSTNAME=<this "
              "host's address>, or give fsdp-run --local-addr <this host's address>";
  return a;
}

}  // namespace fsdp_run
