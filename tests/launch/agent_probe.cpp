// One launcher's rendezvous agent as a process of its own, for the tests of src/launch/ that need
// a launcher to die or hang (a process can be SIGKILLed or SIGSTOPped; a thread cannot): it
// takes fsdp-run's options (a PROGRAM is required by the parser but never run), joins the job as
// fsdp-run would, and prints what it learns, one line each:
//
//   node <n>                          its node rank, once claimed
//   news: <line>                      what the agent has to say (whom a round waits for, losses)
//   joined round <r> group <g>/<w> members <m> addr <address> why <why>
//   failure: <sentence>               the round's first failure
//   join error: <sentence>            then it exits 2
//
// Once joined it reports its ranks as done (--probe-fail: failed, with exit code 3), waits until
// every node has, and exits 0; a round that failed ends it at once with 1.
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "launch/options.h"
#include "launch/rendezvous.h"

int main(int argc, char** argv) {
  bool fail = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--probe-fail") == 0)
      fail = true;
    else
      args.push_back(argv[i]);
  }
  fsdp_run::Options o;
  if (int code = fsdp_run::parse_options(static_cast<int>(args.size()), args.data(), o); code >= 0)
    return code;
  if (int code = fsdp_run::complete_options(o); code >= 0) return code;
  fsdp_run::JobAgent agent(fsdp_run::agent_config(o));
  size_t news = 0;
  bool said_node = false, said_joined = false, reported = false, said_failure = false;
  for (;;) {
    pollfd p{agent.fd(), POLLIN, 0};
    ::poll(&p, 1, 200);
    const fsdp_run::AgentState st = agent.state();
    if (st.node_rank >= 0 && !said_node) {
      std::printf("node %d\n", st.node_rank);
      said_node = true;
    }
    for (; news < st.news.size(); ++news) std::printf("news: %s\n", st.news[news].c_str());
    if (st.join_error) {
      std::printf("join error: %s\n", st.join_error->c_str());
      std::fflush(stdout);
      std::_Exit(2);
    }
    if (st.joined && !said_joined) {
      std::printf("joined round %d group %d/%d members %s addr %s why %s\n", st.round,
                  st.group_rank, st.group_world, st.members.c_str(),
                  st.address ? st.address->address.c_str() : "-",
                  st.address ? st.address->why.c_str() : "-");
      said_joined = true;
    }
    if (st.failure && !said_failure) {
      std::printf("failure: %s\n", st.failure->what.c_str());
      said_failure = true;
    }
    if (said_joined && !reported) {
      if (fail) agent.report_failure(3, "rank of node " + std::to_string(st.node_rank) + " failed");
      agent.report_left();
      reported = true;
    }
    std::fflush(stdout);
    if (reported && st.left && st.failure) std::_Exit(1);  // a failed round: no need to wait
    if (reported && st.all_left && (!st.hosts_store || st.all_done)) std::_Exit(0);
  }
}
