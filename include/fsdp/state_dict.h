// fsdp/state_dict.h: deprecated name of fsdp/state_value.h (the value model: StateDict,
// StateValue, ShardedTensor), kept for one release. The state-dict functions are in
// fsdp/model_state_dict.h, fsdp/optim_state_dict.h and fsdp/checkpoint/state_dict.h; see
// docs/migration.md.
#pragma once

#include "fsdp/state_value.h"
