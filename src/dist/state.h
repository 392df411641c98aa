// Internal: the shared state behind fsdp::dist::ProcessGroup handles.
#pragma once

#include <atomic>
#include <memory>

#include "fsdp/dist.h"

namespace fsdp {
namespace dist {

struct ProcessGroup::State {
  compat::BackendPtr backend;
  std::string name;
  std::string backend_name;
  at::Device device{at::kCPU};  // compat::collective_device(backend_name)
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  compat::StorePtr store;  // for sub-group rendezvous; may be null
  std::vector<int> global_ranks;
  int next_subgroup = 0;  // advanced identically on every member by new_group
  std::string gloo_hostname = "127.0.0.1";
  int gloo_threads = 2;
  // Set once a collective of this group failed to start or to finish (shared with its pending
  // Works). The backend is then left to its own destructor (NCCL: abort) rather than shut down
  // gracefully, which would wait for collectives a dead peer never completes.
  std::shared_ptr<std::atomic<bool>> failed = std::make_shared<std::atomic<bool>>(false);

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State();  // process_group.cpp: shuts the backend down when the last handle goes
};

struct Work::Pending {
  compat::WorkPtr work;          // null when the collective completed synchronously
  std::function<void()> finish;  // local post-processing once `work` is done
  std::string what;              // "all_gather_into_tensor on group 'default' (rank 1 of 2)"
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<std::atomic<bool>> group_failed;  // the group's State::failed
};

}  // namespace dist
}  // namespace fsdp
