"""Python side of the Python-FSDP oracle test (issue 8).

Holds the Python twin of tests/helpers/tiny_lm.h (same module names, FQNs and forward math), the
deterministic inputs (initial weights and global batches, written as safetensors), the two
references computed in one process (plain single-process training on the whole global batch, and
hand-written data parallelism at W simulated ranks), and the Python FSDP worker that one process
per rank runs (torch.distributed.fsdp.FullyShardedDataParallel, CPU, Gloo).

Files written by the FSDP worker (and, in the same format, by tests/oracle/oracle_fsdp.cpp) into
<out>/<case>/:
  full.safetensors        rank 0's FULL state dict; __metadata__["order"] = JSON list of keys
  sharded_r<r>.json       rank r's SHARDED state dict described (keys, kinds, dtypes, shapes,
                          pieces)
  sharded_r<r>.safetensors  its values: plain tensors under their key, piece i under "<key>#<i>"
  local_r<r>.json / local_r<r>.safetensors   the same for the LOCAL state dict
  layout_r<r>.json        every unit's flat-parameter layout as rank r holds it
  optim_full.safetensors  rank 0's FULL optimizer state dict, "state" flattened to
                          "<fqn>/<state>" keys; __metadata__["order"] = those keys in order,
                          __metadata__["param_groups"] = the param groups as JSON
  optim_sharded_r<r>.json / .safetensors   rank r's SHARDED optimizer state dict, flattened
                          the same way, described like sharded_r<r>
A state dict that raised is described as {"error": "<message>"}.

Nothing here is executed from the files: tensors cross as safetensors, descriptions as JSON.
"""

import functools
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB, DIM, HIDDEN, BLOCKS = 11, 8, 13, 3

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


# --------------------------------------------------------------------------------------------
# The model: the twin of fsdp::testing::TinyLM (tests/helpers/tiny_lm.h)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TiedHead(nn.Module):
    """Output projection whose weight *is* the embedding's (one Parameter on two modules)."""

    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, x):
        return torch.matmul(x, self.weight.t())


class TinyLM(nn.Module):
    # Registration order as in C++: tok, frozen, blocks, head, then the buffer.
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(DIM, HIDDEN) for _ in range(BLOCKS)])
        self.head = TiedHead(self.tok.weight)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx):
        x = self.tok(idx) * self.scale
        x = self.frozen(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def unique_state(model):
    """The model's parameters (each tensor once: the tied head weight is left out) and buffers."""
    out, seen = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = v.detach().clone().contiguous()
    return out


def load_init(model, init):
    names = set()
    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            if k in init:
                v.copy_(init[k])
                names.add(k)
    if names != set(init):
        raise RuntimeError(f"init weights do not match the model: {sorted(set(init) ^ names)}")
    if not torch.equal(model.tok.weight, model.head.weight):
        raise RuntimeError("tied weight broken after loading")


def loss_fn(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


# --------------------------------------------------------------------------------------------
# Inputs


def generate(data_dir, steps, batch, seq, lr, eps, seed=1234):
    """init.safetensors (unique parameters + buffer) and batches.safetensors (global batches and
    the hyperparameters in __metadata__). W-independent: rank r of W takes rows
    [r*batch/W, (r+1)*batch/W) of every global batch."""
    os.makedirs(data_dir, exist_ok=True)
    torch.manual_seed(seed)
    model = TinyLM()
    # Make the buffer and frozen unit non-trivial; keep everything float32.
    init = unique_state(model)
    save_file(init, os.path.join(data_dir, "init.safetensors"),
              metadata={"order": json.dumps(list(model.state_dict().keys())),
                        "tied": json.dumps({"head.weight": "tok.weight"})})
    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for k in range(steps):
        tensors[f"idx_{k}"] = torch.randint(VOCAB, (batch, seq), generator=g)
        tensors[f"tgt_{k}"] = torch.randint(VOCAB, (batch, seq), generator=g)
    meta = {"steps": str(steps), "batch": str(batch), "seq": str(seq), "lr": repr(lr),
            "beta1": "0.9", "beta2": "0.999", "eps": repr(eps), "vocab": str(VOCAB)}
    save_file(tensors, os.path.join(data_dir, "batches.safetensors"), metadata=meta)


def read_st(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def load_data(data_dir):
    init, _ = read_st(os.path.join(data_dir, "init.safetensors"))
    batches, meta = read_st(os.path.join(data_dir, "batches.safetensors"))
    cfg = {"steps": int(meta["steps"]), "batch": int(meta["batch"]), "seq": int(meta["seq"]),
           "lr": float(meta["lr"]), "betas": (float(meta["beta1"]), float(meta["beta2"])),
           "eps": float(meta["eps"])}
    return cfg, init, batches


def local_rows(t, rank, world):
    n = t.shape[0]
    if n % world:
        raise ValueError(f"global batch {n} does not split evenly over {world} ranks")
    b = n // world
    return t[rank * b:(rank + 1) * b]


def make_adam(params, cfg):
    return torch.optim.Adam(params, lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"])


# --------------------------------------------------------------------------------------------
# References computed in one process


def optim_state_by_fqn(model, opt):
    """The optimizer's state of an unwrapped model as {"<fqn>/<state>": tensor}, FQNs as
    named_parameters() gives them (the tied weight once, as tok.weight)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                out[f"{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def train_single(data_dir):
    """Plain training of the unwrapped model on each whole global batch. Returns its state dict
    (tied weight under both names, as nn.Module.state_dict gives it) and its optimizer state
    (optim_state_by_fqn)."""
    cfg, init, batches = load_data(data_dir)
    model = TinyLM()
    load_init(model, init)
    opt = make_adam(model.parameters(), cfg)
    for k in range(cfg["steps"]):
        opt.zero_grad()
        loss_fn(model(batches[f"idx_{k}"]), batches[f"tgt_{k}"]).backward()
        opt.step()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            optim_state_by_fqn(model, opt))


def train_data_parallel(data_dir, world):
    """Data parallelism written by hand: each simulated rank's gradient on its rows, summed in rank
    order and divided by W (what an all-reduce average does), then one Adam step. Returns what
    train_single returns."""
    cfg, init, batches = load_data(data_dir)
    model = TinyLM()
    load_init(model, init)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_adam(params, cfg)
    for k in range(cfg["steps"]):
        grads = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            loss_fn(model(local_rows(batches[f"idx_{k}"], r, world)),
                    local_rows(batches[f"tgt_{k}"], r, world)).backward()
            grads.append([p.grad.detach().clone() for p in params])
        for i, p in enumerate(params):
            total = grads[0][i].clone()
            for r in range(1, world):
                total += grads[r][i]
            p.grad = total / world
        opt.step()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            optim_state_by_fqn(model, opt))


# --------------------------------------------------------------------------------------------
# Writing results (shared format with tests/oracle/oracle_fsdp.cpp)

ST_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


def write_full(sd, path):
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, path,
              metadata={"order": json.dumps(list(sd.keys()))})


def describe_state_dict(sd):
    """JSON description plus the tensors to save, for a SHARDED or LOCAL state dict."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    keys, tensors = [], {}
    for k, v in sd.items():
        if isinstance(v, ShardedTensor):
            md = v.metadata()
            local = []
            for i, s in enumerate(v.local_shards()):
                local.append({"offsets": list(s.metadata.shard_offsets),
                              "sizes": list(s.metadata.shard_sizes),
                              "rank": s.metadata.placement.rank()})
                tensors[f"{k}#{i}"] = s.tensor.detach().clone().contiguous()
            glob = [{"offsets": list(m.shard_offsets), "sizes": list(m.shard_sizes),
                     "rank": m.placement.rank()} for m in md.shards_metadata]
            keys.append({"key": k, "type": "sharded",
                         "dtype": ST_DTYPES[md.tensor_properties.dtype],
                         "shape": list(md.size), "local": local, "global": glob})
        elif isinstance(v, torch.Tensor):
            keys.append({"key": k, "type": "tensor", "dtype": ST_DTYPES[v.dtype],
                         "shape": list(v.shape)})
            tensors[k] = v.detach().clone().contiguous()
        else:
            keys.append({"key": k, "type": type(v).__name__})
    return {"keys": keys}, tensors


def write_described(sd_or_error, out_dir, stem, rank):
    if isinstance(sd_or_error, Exception):
        desc, tensors = {"error": f"{type(sd_or_error).__name__}: {sd_or_error}"}, {}
    else:
        desc, tensors = describe_state_dict(sd_or_error)
    with open(os.path.join(out_dir, f"{stem}_r{rank}.json"), "w") as f:
        json.dump(desc, f, indent=1)
    save_file(tensors, os.path.join(out_dir, f"{stem}_r{rank}.safetensors"))


def flatten_osd(osd):
    """An optimizer state dict's "state" as {"<fqn>/<state>": value} (the form compared)."""
    return {f"{fqn}/{k}": v for fqn, st in osd["state"].items() for k, v in st.items()}


def groups_json(osd):
    """Param groups as JSON (tuples become lists)."""
    return json.dumps([{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
                       for g in osd["param_groups"]])


def write_optim_full(osd, path):
    flat = flatten_osd(osd)
    save_file({k: v.detach().clone().contiguous() for k, v in flat.items()}, path,
              metadata={"order": json.dumps(list(flat)), "param_groups": groups_json(osd)})


def describe_layouts(fsdp_model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    units = {}
    for name, m in fsdp_model.named_modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        fp = m._handle.flat_param
        unit = clean_tensor_name(name)
        units[unit] = {
            # FQNs in the whole model (Python keeps them relative to the unit, fsdp-cpp to the
            # wrapped model; the unit name is what differs).
            "fqns": [f"{unit}.{f}" if unit else f for f in fp._fqns],
            "numels_with_padding": [int(n) for n in fp._numels_with_padding],
            "is_padding_mask": [bool(b) for b in fp._is_padding_mask],
            "unpadded_unsharded_numel": int(fp._unpadded_unsharded_size.numel()),
            "local_numel": int(fp.numel()),
            "shard_numel_padded": int(fp._shard_numel_padded),
        }
    return {"units": units}


# --------------------------------------------------------------------------------------------
# The Python FSDP worker: one process per rank, torchrun-style environment


def fsdp_worker(data_dir, out_root, cases):
    import torch.distributed as dist
    from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                        FullyShardedDataParallel as FSDP, ShardedOptimStateDictConfig,
                                        ShardedStateDictConfig, ShardingStrategy, StateDictType)
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    import warnings

    warnings.filterwarnings("ignore")  # NO_SHARD's deprecation and state-dict notices
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, init, batches = load_data(data_dir)
    for case in cases:
        strategy, orig, *ac = case.split(":")
        orig = orig == "1"
        ac = ac == ["ac"]
        out_dir = os.path.join(out_root, f"W{world}_{strategy}_{'orig' if orig else 'flat'}"
                               + ("_ac" if ac else ""))
        os.makedirs(out_dir, exist_ok=True)
        model = TinyLM()
        load_init(model, init)
        frozen = model.frozen
        policy = functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: m is frozen or isinstance(m, Block))
        fsdp = FSDP(model, auto_wrap_policy=policy,
                    sharding_strategy=getattr(ShardingStrategy, strategy),
                    use_orig_params=orig, device_id=torch.device("cpu"))
        if ac:
            # What a Python FSDP user writes: every Block recomputed in backward (issue 64).
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
            apply_activation_checkpointing(
                fsdp, checkpoint_wrapper_fn=functools.partial(
                    checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: isinstance(m, Block))
        opt = make_adam(fsdp.parameters(), cfg)
        for k in range(cfg["steps"]):
            opt.zero_grad()
            loss = loss_fn(fsdp(local_rows(batches[f"idx_{k}"], rank, world)),
                           local_rows(batches[f"tgt_{k}"], rank, world))
            loss.backward()
            opt.step()
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            full = fsdp.state_dict()
        if rank == 0:
            write_full(full, os.path.join(out_dir, "full.safetensors"))
        for stem, sd_type in (("sharded", StateDictType.SHARDED_STATE_DICT),
                              ("local", StateDictType.LOCAL_STATE_DICT)):
            try:
                with FSDP.state_dict_type(fsdp, sd_type):
                    sd = fsdp.state_dict()
            except Exception as e:  # recorded and compared, as the C++ side does
                sd = e
            write_described(sd, out_dir, stem, rank)
        # Optimizer state dicts (issue 9): FULL from rank 0, SHARDED from every rank.
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False,
                                                           rank0_only=False)):
            osd = FSDP.optim_state_dict(fsdp, opt)
        if rank == 0:
            write_optim_full(osd, os.path.join(out_dir, "optim_full.safetensors"))
        try:
            with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT,
                                      ShardedStateDictConfig(offload_to_cpu=False),
                                      ShardedOptimStateDictConfig(offload_to_cpu=False)):
                sosd = flatten_osd(FSDP.optim_state_dict(fsdp, opt))
        except Exception as e:
            sosd = e
        write_described(sosd, out_dir, "optim_sharded", rank)
        with open(os.path.join(out_dir, f"layout_r{rank}.json"), "w") as f:
            json.dump(describe_layouts(fsdp), f, indent=1)
        dist.barrier()
    # Every result is written and every rank is past the last barrier: from here on a failure is
    # the peer's teardown, which the driver reports without failing the comparison.
    with open(finished_marker(out_root, world, rank), "w") as f:
        f.write("finished\n")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: PyTorch 2.6's Gloo group has aborted there
    # ("terminate called without an active exception"), once in many runs.
    os._exit(0)


def finished_marker(out_root, world, rank):
    """The file a Python FSDP rank writes once all its results are written (see fsdp_worker)."""
    return os.path.join(out_root, "logs", f"finished.W{world}.r{rank}")


if __name__ == "__main__":
    # python3 fsdp_oracle.py worker DATA_DIR OUT_ROOT STRATEGY:ORIG[:ac] ...   (env RANK, WORLD_SIZE,
    # MASTER_ADDR, MASTER_PORT)
    if len(sys.argv) >= 4 and sys.argv[1] == "worker":
        fsdp_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit("usage: fsdp_oracle.py worker DATA_DIR OUT_ROOT STRATEGY:ORIG ...")
