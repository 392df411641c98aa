// Internal: the runtime's one interface to the layers above it (state_dict/ and checkpoint/).
//
// Those layers see a wrapped model only through this view, never through runtime/state.h (the
// include check, scripts/check_layers.py, enforces it): its units and their handles, its process
// groups, and the few things a state-dict call asks of the runtime: that no forward, backward or
// summon is in progress, and the dtype a buffer had before buffer_dtype cast it. Everything the
// view hands out stays owned by the runtime; the view keeps the runtime's state alive.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fsdp/dist.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_sharded.h"

namespace fsdp {
namespace detail {

class FsdpState;

/// One FSDP unit as the layers above the runtime see it.
struct UnitView {
  int index = 0;    // position in RuntimeView::units(); 0 is the root
  std::string fqn;  // the unit module's FQN in the wrapped module; "" for the root
  FlatParamHandle* handle = nullptr;  // null for a root without parameters of its own
};

class RuntimeView {
 public:
  explicit RuntimeView(const FullyShardedDataParallelImpl& model);

  /// Root first, then in wrapping order (as FullyShardedDataParallelImpl::handles()). Fixed for
  /// the model's lifetime.
  const std::vector<UnitView>& units() const { return units_; }
  /// The handle of unit `unit`; InternalError for a root without one.
  FlatParamHandle& handle(int unit) const;
  /// The wrapped module: its names are the canonical FQNs.
  torch::nn::Module& root_module() const;
  /// All data-parallel ranks (shard x replicate groups).
  dist::ProcessGroup& world_group() const;
  /// The ranks parameters are sharded across (one replica group under hybrid sharding).
  dist::ProcessGroup& shard_group() const;
  /// The dtype `buffer` had before buffer_dtype (mixed precision) cast it; its own otherwise.
  at::ScalarType original_dtype(const at::Tensor& buffer) const;
  /// Throws StateError naming `what` during backward or summon_full_params; otherwise reshards
  /// whatever a forward without backward left unsharded, so every unit holds only its shard.
  void require_idle(const char* what) const;

 private:
  std::shared_ptr<FsdpState> state_;
  std::vector<UnitView> units_;
};

/// Whether `m` is the module of a unit of a live wrapped model (the wrapped module or a wrapped
/// submodule): its parameters are then flat-parameter views.
bool is_unit_module(const torch::nn::Module* m);

}  // namespace detail
}  // namespace fsdp
