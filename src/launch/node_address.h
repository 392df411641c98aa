// Which address a node's ranks bind for Gloo, decided by its launcher once a round has formed
// (issue 60).
//
// A rank picks its Gloo address by itself from the route to MASTER_ADDR (dist/gloo_device.h). On
// the host that holds the job's store that route can be loopback: a stock Debian /etc/hosts maps
// the host's own name to 127.0.1.1, so `--master-addr node0` resolves to loopback on node0 and
// to node0's real address everywhere else. Ranks that bound loopback there would work only as
// long as no other host ever dials them. The launchers know better: each writes into the job's
// store the route it took to the store (its own address on that route, and the store's address
// as it resolved it), and the launcher on the store's host takes the address the others reached
// it by. fsdp-run hands the choice to its ranks as FSDP_NODE_ADDR (with FSDP_NODE_ADDR_WHY for
// the start-up line); GLOO_SOCKET_IFNAME, FSDP_GLOO_HOSTNAME and InitOptions::gloo_hostname still
// take precedence in the ranks.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_run {

/// What one launcher wrote about its route to the job's store.
struct NodeRoute {
  int node = 0;
  std::string host;     // its host name, for messages
  std::string local;    // its own address on the route to the store (loopback: the store is on
                        // its host)
  std::string reached;  // the store's address, as that launcher resolved it

  /// One line for the store: "local reached host".
  std::string encode() const;
  /// The inverse of encode(); nullopt for a malformed line.
  static std::optional<NodeRoute> decode(int node, const std::string& text);
};

/// The choice, or why the job must not start.
struct NodeAddress {
  std::string address;                 // numeric
  std::string interface;               // the interface that holds it, or empty when unknown
  std::string why;                     // what chose it, for the start-up line
  std::optional<std::string> refusal;  // set: this node's ranks would bind loopback although
                                       // other nodes are on other hosts
  /// "10.0.0.1 (eth0)".
  std::string describe() const;
};

/// What the choice is made from.
struct AddressFacts {
  std::string local_addr;         // --local-addr, or empty
  std::string store;              // the store's host as the user wrote it ("node0"), for messages
  NodeRoute self;                 // this node's own route to the store
  std::vector<NodeRoute> others;  // the round's other nodes
  // The local address this host would send from towards a numeric address ("" for none).
  std::function<std::string(const std::string&)> route_from_here;
  // The interface that holds a local numeric address.
  std::function<std::optional<std::string>(const std::string&)> interface_of;
};

/// In order: --local-addr; this node's own route to the store when it is not loopback (the store
/// is elsewhere); else (the store is on this host) loopback when every node's route is loopback
/// too (all on this machine); else the store address another node reached, when it is one of
/// this host's; else the route from here to another node; else a refusal naming the address and
/// what fixes it.
NodeAddress choose_node_address(const AddressFacts& facts);

}  // namespace fsdp_run
