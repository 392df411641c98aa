// fsdp/state_dict.h: deprecated name of fsdp/state_value.h (the value model: StateDict,
// StateValue, ShardedTensor), kept for one release. The state-dict functions are in
// fsdp/checkpoint/state_dict.h (get_state_dict / set_state_dict: use these) and, for code ported
// from FSDP.state_dict_type, fsdp/model_state_dict.h and fsdp/optim_state_dict.h; see
// docs/migration.md.
#pragma once

#include "fsdp/state_value.h"
