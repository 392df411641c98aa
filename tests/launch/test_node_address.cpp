// Which address a node's ranks bind (src/launch/node_address.h), from the routes the launchers
// wrote into the job's store: the cases of a stock Debian /etc/hosts, where the store's own host
// resolves its name to loopback, and the refusal when no reachable address is found.
#include <gtest/gtest.h>

#include "launch/node_address.h"

namespace {

using fsdp_run::AddressFacts;
using fsdp_run::NodeRoute;

// Node 0 holds the store at node0, which resolves to 127.0.1.1 on node0 itself; node 1 reached it
// at 10.0.0.1 from 10.0.0.2. This host's interfaces: lo and eth0 (10.0.0.1).
AddressFacts store_host_facts() {
  AddressFacts f;
  f.store = "node0";
  f.self = NodeRoute{0, "node0", "127.0.0.1", "127.0.1.1"};
  f.others = {NodeRoute{1, "node1", "10.0.0.2", "10.0.0.1"}};
  f.interface_of = [](const std::string& a) -> std::optional<std::string> {
    if (a == "10.0.0.1") return std::string("eth0");
    if (a.rfind("127.", 0) == 0) return std::string("lo");
    return std::nullopt;
  };
  f.route_from_here = [](const std::string& a) {
    return a == "10.0.0.2" ? std::string("10.0.0.1") : std::string();
  };
  return f;
}

TEST(NodeAddress, TheStoresHostTakesTheAddressTheOthersReachedItBy) {
  const auto a = fsdp_run::choose_node_address(store_host_facts());
  EXPECT_FALSE(a.refusal);
  EXPECT_EQ(a.address, "10.0.0.1");
  EXPECT_EQ(a.interface, "eth0");
  EXPECT_EQ(a.describe(), "10.0.0.1 (eth0)");
  EXPECT_EQ(a.why,
            "the address node 1 (node1)'s launcher reached the job's store at; node0 resolves to "
            "127.0.1.1 here");
}

TEST(NodeAddress, ANodeElsewhereTakesItsRouteToTheStore) {
  AddressFacts f = store_host_facts();
  std::swap(f.self, f.others[0]);
  f.interface_of = [](const std::string&) { return std::optional<std::string>("eth0"); };
  const auto a = fsdp_run::choose_node_address(f);
  EXPECT_EQ(a.address, "10.0.0.2");
  EXPECT_EQ(a.why, "the route to the job's store at node0 (10.0.0.1)");
}

TEST(NodeAddress, EveryNodeOnThisHostStaysOnLoopback) {
  AddressFacts f = store_host_facts();
  f.others = {NodeRoute{1, "node0", "127.0.0.1", "127.0.1.1"}};
  const auto a = fsdp_run::choose_node_address(f);
  EXPECT_FALSE(a.refusal);
  EXPECT_EQ(a.address, "127.0.0.1");
  EXPECT_EQ(a.why, "every node of the job is on this host");
}

TEST(NodeAddress, LocalAddrWinsAndARouteToAPeerIsTheFallback) {
  AddressFacts f = store_host_facts();
  f.local_addr = "192.168.1.5";
  EXPECT_EQ(fsdp_run::choose_node_address(f).address, "192.168.1.5");
  EXPECT_EQ(fsdp_run::choose_node_address(f).why, "--local-addr");
  // The others reached the store through an address that is not this host's (a NAT, a proxy):
  // the route from here to one of them.
  f = store_host_facts();
  f.others[0].reached = "172.16.0.1";
  const auto a = fsdp_run::choose_node_address(f);
  EXPECT_EQ(a.address, "10.0.0.1");
  EXPECT_EQ(a.why, "the route to node 1 (node1) at 10.0.0.2");
}

// Negative control: nothing but loopback on the way to a node on another host: no silent
// loopback, a refusal naming the address and what fixes it.
TEST(NodeAddress, LoopbackWhileAnotherNodeIsElsewhereIsRefused) {
  AddressFacts f = store_host_facts();
  f.others[0].reached = "172.16.0.1";
  f.route_from_here = [](const std::string&) { return std::string("127.0.0.1"); };
  const auto a = fsdp_run::choose_node_address(f);
  ASSERT_TRUE(a.refusal);
  EXPECT_NE(a.refusal->find("this node's ranks would bind 127.0.0.1 (node0 resolves to 127.0.1.1 "
                            "here), which node 1 (node1) at 10.0.0.2 cannot reach"),
            std::string::npos)
      << *a.refusal;
  EXPECT_NE(a.refusal->find("GLOO_SOCKET_IFNAME=<interface>"), std::string::npos);
  EXPECT_NE(a.refusal->find("--local-addr"), std::string::npos);
}

TEST(NodeAddress, RoutesRoundTripThroughTheStoresText) {
  const NodeRoute r{3, "host with spaces", "10.0.0.3", "10.0.0.1"};
  const auto back = NodeRoute::decode(3, r.encode());
  ASSERT_TRUE(back);
  EXPECT_EQ(back->local, "10.0.0.3");
  EXPECT_EQ(back->reached, "10.0.0.1");
  EXPECT_EQ(back->host, "host with spaces");
  EXPECT_FALSE(NodeRoute::decode(3, ""));
  EXPECT_FALSE(NodeRoute::decode(3, "only-one"));
}

}  // namespace
