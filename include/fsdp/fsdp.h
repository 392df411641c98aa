// fsdp/fsdp.h: fsdp-cpp, PyTorch's Fully Sharded Data Parallel for LibTorch. Includes every
// public header.
//
// The data flow, from wrapping to a checkpoint on disk:
//
//   wrap     FullyShardedDataParallel(module, options) groups the module's parameters into
//            units (auto_wrap_policy, or units the model marks), flattens each unit's
//            parameters into one FlatParameter and keeps only this rank's shard of it
//            (fully_sharded.h; the choices, ShardingStrategy first, in options.h; the
//            handle in flat_param.h; the collectives are dist.h's, over c10d).
//   forward  each unit all-gathers its flat parameter before its forward and frees the full
//            copy after it (SHARD_GRAD_OP keeps it until backward); the original parameters
//            are views into it while it is unsharded.
//   backward each unit all-gathers again, and once its gradients are in, reduce-scatters them
//            so every rank holds the gradient of its shard (all-reduce across replicas under
//            hybrid sharding).
//   step     when backward() returns, every sharded gradient is final: build the optimizer
//            over model->parameters() (flat parameters, or the original parameters with
//            use_orig_params) and call step() as usual. NoSyncGuard (PyTorch's no_sync())
//            accumulates gradients without communication; clip_grad_norm_() clips globally.
//   state    state dicts of the model and the optimizer, FULL / SHARDED / LOCAL, keyed by the
//            unwrapped model's names (model_state_dict.h, optim_state_dict.h; the unified
//            get_state_dict / set_state_dict of checkpoint/state_dict.h; utilities in
//            state_dict_utils.h; the values are state_value.h's StateValue and ShardedTensor).
//   disk     checkpoint/checkpoint.h saves and loads them in PyTorch DCP's layout, at any world
//            size; checkpoint/async_save.h saves in the background; checkpoint/export.h writes
//            safetensors and torch.load-able .pt files.
//
// Errors: fsdp::Error and its kinds (errors.h). LibTorch version differences: compat.h. Not
// included here: compat_backends.h, which builds c10d stores and backends (Gloo's and NCCL's
// headers) for a program that brings its own backend to dist::ProcessGroup::from_backend.
// Docs: README.md, docs/concepts.md (the terms), docs/layers.md (how the sources are organised).
#pragma once

#include "fsdp/activation_checkpointing.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/checkpoint/file_io.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/compat.h"
#include "fsdp/deferred_init.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/flat_param.h"
#include "fsdp/foreach_adamw.h"
#include "fsdp/fully_sharded.h"
#include "fsdp/model_state_dict.h"
#include "fsdp/optim_state_dict.h"
#include "fsdp/options.h"
#include "fsdp/state_dict_utils.h"
#include "fsdp/state_value.h"
