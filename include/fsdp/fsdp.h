// fsdp/fsdp.h: umbrella header for fsdp-cpp, fully sharded data parallelism for LibTorch.
#pragma once

#include "fsdp/compat.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_sharded.h"
#include "fsdp/model_state_dict.h"
#include "fsdp/optim_state_dict.h"
#include "fsdp/state_dict_utils.h"
#include "fsdp/state_dict.h"
