#!/usr/bin/env python3
"""PyTorch's own get_state_dict / set_state_dict (torch.distributed.checkpoint.state_dict on
Python FSDP) as the reference for fsdp-cpp's (issue 37).

For each world size, strategy, use_orig_params and combination of StateDictOptions (the indexing of
tests/state_dict/test_sd_matrix.cpp), Python FSDP and fsdp-cpp (tests/oracle/oracle_sd_matrix.cpp) train the twin
models of tests/helpers/sd_matrix_model.h from the same initial weights on the same batches for 2 steps;
then on every rank:
  get  what get_state_dict returns is compared: keys and their order (the optimizers' "state" as
       sets: PyTorch orders it differently, see tests/oracle/README.md), empty dicts on ranks > 0,
       plain tensor or ShardedTensor, shapes, dtypes, pieces and their metadata, group values,
       and tensor values within the oracle's bound;
  set  fsdp-cpp's set_state_dict takes the dicts *Python's* get returned on that rank (as a
       Python user would hand them over), PyTorch's set_state_dict takes the same; both must
       accept or both refuse, and the resulting models and optimizers must agree.
Where PyTorch itself fails (it raises, or would wait forever), the case is a documented
difference (docs/state_dict_api.md) when the reason is one of KNOWN below, else a failure.

    python3 tests/oracle/sd_matrix.py --binary build-trixie/tests/oracle_sd_matrix --work DIR \\
        [--worlds 1 2 3 4] [--strategies FULL_SHARD ...] [--combos all|N,N,...] [--sample N]

Needs torch >= 2 with torch.distributed.fsdp and safetensors (the trixie chroot) and USE_LIBUV=0.
"""

import argparse
import functools
import json
import os
import random
import shutil
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import sd_exchange  # noqa: E402

VOCAB, DIM, HIDDEN, BLOCKS, ROWS, SEQ = 11, 7, 11, 4, 12, 5
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
UNITS = ("", "frozen", "blocks.0", "blocks.1", "blocks.2", "blocks.3")
N_COMBOS = 192


# --------------------------------------------------------------------------------------------
# The twin of fsdp::testing::matrix::MatrixNet (tests/helpers/sd_matrix_model.h)


class MBlock(nn.Module):
    # The twin PyTorch's FSDP can take (sd_matrix_model.h's Variant): no empty parameter, and under
    # use_orig_params `unused` gets a (zero) gradient.
    def __init__(self, index, orig):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        if index == 1:
            self.unused = nn.Parameter(torch.randn(7))
        self.index, self.orig = index, orig

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(x)))
        if self.index == 1 and self.orig:
            h = h + 0 * self.unused.sum()
        return x + h


class MHead(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, x):
        return torch.matmul(x, self.weight.t())


class MatrixNet(nn.Module):
    def __init__(self, orig=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        # 7 elements whose mean scales (Variant): FSDP refuses 0-d parameters, and SHARDED dicts
        # fail where a rank holds no row of one.
        self.gain = nn.Parameter(torch.ones(7))
        self.frozen = nn.Linear(DIM, DIM)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.blocks = nn.ModuleList([MBlock(i, orig) for i in range(BLOCKS)])
        self.head = MHead(self.tok.weight)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, idx):
        x = self.tok(idx) * self.scale
        x = self.frozen(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.gain.mean()


def make_optimizers(params):
    """`params[unit]`: the parameters of each unit in UNITS, as the optimizers hold them."""
    return [
        torch.optim.Adam([{"params": params[""], "lr": 0.02},
                          {"params": params["frozen"], "lr": 0.005}], lr=0.02, eps=1e-3),
        torch.optim.AdamW(params["blocks.0"], lr=0.01, eps=1e-3, amsgrad=True, weight_decay=0.1),
        torch.optim.SGD(params["blocks.1"], lr=0.05, momentum=0.9, nesterov=True),
        torch.optim.Adagrad(params["blocks.2"], lr=0.05),
        torch.optim.RMSprop(params["blocks.3"], lr=0.01, eps=1e-3, momentum=0.5, centered=True),
    ]


def unit_of(fqn):
    for u in reversed(UNITS[1:]):
        if fqn.startswith(u + "."):
            return u
    return ""


def loss_fn(logits, idx):
    return F.cross_entropy(logits.reshape(-1, VOCAB), idx.reshape(-1))


def rows(t, rank, world):
    n = ROWS // world
    return t[rank * n:(rank + 1) * n]


def combo(i):
    """The options of combination i (tests/state_dict/test_sd_matrix.cpp's combo_at) and `sub`."""
    return dict(full=bool(i & 1), offload=bool(i & 2), bcast=bool(i & 4), flatten=bool(i & 8),
                frozen=bool(i & 16), strict=bool(i & 32), sub=i // 64)


def combo_text(i):
    c = combo(i)
    names = [n for n in ("full", "offload", "bcast", "flatten", "frozen", "strict") if c[n]]
    names += ["submodules", "submodules_no_prefix"][c["sub"] - 1:c["sub"]] if c["sub"] else []
    return "+".join(names) or "defaults_off"


# --------------------------------------------------------------------------------------------
# Inputs and the one-process reference


def generate(data):
    os.makedirs(data, exist_ok=True)
    for seed in (1, 9):
        torch.manual_seed(1000 + seed)
        m = MatrixNet()
        with torch.no_grad():
            m.gain.fill_(1.0 + 0.01 * seed)
        # Every key of both twins (the use_orig_params one lacks blocks.0.empty).
        save_file({k: v.detach().clone().contiguous() for k, v in m.state_dict().items()},
                  os.path.join(data, f"init{seed}.safetensors"))
    g = torch.Generator().manual_seed(500)
    save_file({f"step{s}": torch.randint(VOCAB, (ROWS, SEQ), generator=g) for s in range(2)},
              os.path.join(data, "tokens.safetensors"))


def load_init(model, data, seed):
    init = load_file(os.path.join(data, f"init{seed}.safetensors"))
    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            v.copy_(init[k])


def train_single(data, orig):
    """Plain training on each whole global batch: what every world size approximates."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(0)
    m = MatrixNet(orig)
    load_init(m, data, 1)
    params = {u: [] for u in UNITS}
    seen = set()
    for name, p in m.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params[unit_of(name)].append(p)
    optims = make_optimizers(params)
    tokens = load_file(os.path.join(data, "tokens.safetensors"))
    for s in range(2):
        for o in optims:
            o.zero_grad()
        loss_fn(m(tokens[f"step{s}"]), tokens[f"step{s}"]).backward()
        for o in optims:
            o.step()
    msd, osd = get_state_dict(m, optims, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


# --------------------------------------------------------------------------------------------
# The Python FSDP worker: one process per rank


def worker(data, out, strategy, orig, combos):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    # One replica group per shard group of W ranks, 2 x 2 at W=4 (PyTorch's FSDP runs a shard
    # group of one rank as NO_SHARD over it, never reducing across the replicas).
    shard = 2 if world == 4 else world
    groups = None
    if strategy == "HYBRID_SHARD":
        shard_groups = [dist.new_group(list(range(s, s + shard))) for s in range(0, world, shard)]
        rep_groups = [dist.new_group(list(range(r, world, shard))) for r in range(shard)]
        groups = (shard_groups[rank // shard], rep_groups[rank % shard])
    tokens = load_file(os.path.join(data, "tokens.safetensors"))

    def build(seed):
        m = MatrixNet(orig)
        load_init(m, data, seed)
        frozen, blocks = m.frozen, set(m.blocks)
        policy = functools.partial(lambda_auto_wrap_policy,
                                   lambda_fn=lambda x: x is frozen or x in blocks)
        kw = dict(process_group=groups) if groups else {}
        f = FSDP(m, auto_wrap_policy=policy, sharding_strategy=getattr(ShardingStrategy, strategy),
                 use_orig_params=orig, device_id=torch.device("cpu"), **kw)
        params = {u: [] for u in UNITS}
        for name, p in f.named_parameters():
            name = clean_tensor_name(name)
            unit = name[:-len("._flat_param")] if name.endswith("._flat_param") else (
                "" if name == "_flat_param" else unit_of(name))
            params[unit].append(p)
        return m, f, make_optimizers(params)

    def truth(f, optims):
        msd, osd = get_state_dict(f, optims, options=StateDictOptions(full_state_dict=True))
        return {"model": msd, "optim": osd}

    def done(k):
        # Every rank is past combination k (a rank that raised alone leaves the others in a
        # collective, and the driver then records the error and starts over after k).
        dist.barrier()
        if rank == 0:
            open(os.path.join(out, f"done_c{k}"), "w").close()

    def train(model, optims):
        for s in range(2):
            for o in optims:
                o.zero_grad()
            idx = rows(tokens[f"step{s}"], rank, world)
            loss_fn(model(idx), idx).backward()
            for o in optims:
                o.step()

    inner, model, optims = build(1)
    train(model, optims)
    t = truth(model, optims)
    if rank == 0:
        sd_exchange.write(t, os.path.join(out, "truth"))
    for k in combos:
        c = combo(k)
        opts = StateDictOptions(full_state_dict=c["full"], cpu_offload=c["offload"],
                                broadcast_from_rank0=c["bcast"],
                                flatten_optimizer_state_dict=c["flatten"],
                                ignore_frozen_params=c["frozen"], strict=c["strict"],
                                keep_submodule_prefixes=c["sub"] != 2)
        subs = {inner.blocks[1]} if c["sub"] else None
        offload_broken = c["full"] and c["offload"]
        try:
            if offload_broken:
                # PyTorch's FSDP cannot take full_state_dict + cpu_offload on the CPU: flat
                # parameters fail ("setStorage ... storage of size 0": offload_to_cpu frees the
                # unsharded flat parameter, which its no-op copy to the CPU shares), original
                # ones wait in an all-gather that rank 0 skipped. The same get without cpu_offload
                # is the reference for rank 0's values, and what set takes (as every rank).
                msd, osd = get_state_dict(
                    model, optims, submodules=subs,
                    options=StateDictOptions(**{**opts.__dict__, "cpu_offload": False}))
            else:
                msd, osd = get_state_dict(model, optims, submodules=subs, options=opts)
            got = {"model": msd, "optim": osd}
        except Exception as e:  # compared with fsdp-cpp's outcome
            got = e
        if offload_broken:
            sd_exchange.write(got, os.path.join(out, f"getref_c{k}_r{rank}"))
            sd_exchange.write(RuntimeError("PYTORCH_CPU_OFFLOAD: not run, see getref"),
                              os.path.join(out, f"get_c{k}_r{rank}"))
        else:
            sd_exchange.write(got, os.path.join(out, f"get_c{k}_r{rank}"))
        if isinstance(got, BaseException):
            # A failed call leaves FSDP's state-dict machinery mid-way ("Entering the
            # _unshard_fsdp_state_params context but ..."): start again from a new model.
            inner, model, optims = build(1)
            train(model, optims)
        # set: the same dicts into a fresh model, unless PyTorch cannot take them here.
        oks = [None] * world
        dist.all_gather_object(oks, not isinstance(got, BaseException) and bool(got["model"]))
        stem = os.path.join(out, f"set_c{k}")
        raised = [None] * world
        dist.all_gather_object(raised, isinstance(got, BaseException))
        if any(raised):
            if rank == 0:
                sd_exchange.write(RuntimeError("get raised"), stem)
            done(k)
            continue
        if not c["bcast"] and len(set(oks)) > 1:
            # Ranks with an empty model dict return from _load_model_state_dict while the others
            # enter FSDP's load, which waits for them forever.
            if rank == 0:
                sd_exchange.write(RuntimeError("PYTORCH_WOULD_HANG: ranks > 0 skip the model load "
                                               "that rank 0 enters"), stem)
            done(k)
            continue
        if orig and c["flatten"] and c["bcast"]:
            # PyTorch's unflatten raises KeyError 'state.head.weight.step' (a tied parameter's
            # second FQN) on rank 0 alone here, which leaves the other ranks in the broadcast
            # until the timeout and the group unusable (seen in every such case run): recorded,
            # not run. Without broadcast_from_rank0 every rank raises it, and it runs.
            if rank == 0:
                sd_exchange.write(RuntimeError("PYTORCH_TIED_FLATTEN: KeyError: 'state.head.weight"
                                               ".step' on rank 0 alone (not run)"), stem)
            done(k)
            continue
        _, fresh, fresh_optims = build(9)
        try:
            set_state_dict(fresh, fresh_optims, model_state_dict=got["model"],
                           optim_state_dict=got["optim"], options=opts)
            err = None
        except Exception as e:
            err = e
            print(f"[rank{rank}] set c{k} raised {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        errs = [None] * world
        dist.all_gather_object(errs, None if err is None else f"{type(err).__name__}: {err}")
        first = next((e for e in errs if e), None)
        if first:
            if rank == 0:
                sd_exchange.write(RuntimeError(first), stem)
            done(k)
            continue
        after = truth(fresh, fresh_optims)
        if rank == 0:
            sd_exchange.write(after, stem)
        done(k)
    dist.barrier()
    with open(os.path.join(out, f"finished_r{rank}"), "w") as f:
        f.write("finished\n")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # PyTorch 2.6's Gloo group has aborted in the interpreter's teardown


# --------------------------------------------------------------------------------------------
# Comparison


def ulps(x):
    x = x.abs().float()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def assemble(st):
    """A Sharded whose local pieces cover it, as one tensor (None if they do not)."""
    dtype = {v: k for k, v in sd_exchange.DTYPES.items()}[st.dtype]
    out = torch.zeros(st.size, dtype=dtype)
    covered = 0
    for offsets, sizes, _, t in st.pieces:
        view = out
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            view = view.narrow(d, o, n)
        view.copy_(t.reshape(sizes))
        covered += t.numel()
    return out if covered == out.numel() else None


class Cmp:
    # `whole`: a ShardedTensor whose local pieces cover it may stand for a plain tensor (at world
    # size 1 PyTorch's FSDP switches every strategy to NO_SHARD, whose SHARDED dicts are FULL).
    def __init__(self, tol, whole=False):
        self.tol, self.worst, self.whole, self.wholes = tol, 0.0, whole, 0

    def tensor(self, a, b, where):
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if a.numel() == 0:
            return None
        if not a.is_floating_point():
            return None if torch.equal(a, b) else f"{where}: values differ"
        d = (a.double() - b.double()).abs()
        self.worst = max(self.worst, d.max().item())
        bound = 4 * ulps(b).double() + self.tol
        if (d > bound).any():
            return f"{where}: differs by up to {d.max().item():.3g} (tol {self.tol:.3g})"
        return None

    def value(self, a, b, where, sets=()):
        """First difference between two read-back values, or None. Dicts whose path is in
        `sets` compare their keys as sets (PyTorch orders the optimizers' state differently)."""
        if isinstance(a, dict) != isinstance(b, dict) or isinstance(a, list) != isinstance(b, list):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, dict):
            ka, kb = list(a), list(b)
            as_set = any(where.endswith(s) for s in sets)
            if (set(ka) != set(kb)) if as_set else (ka != kb):
                only_a = [k for k in ka if k not in b][:4]
                only_b = [k for k in kb if k not in a][:4]
                return (f"{where}: keys differ (only fsdp-cpp: {only_a}, only PyTorch: {only_b})"
                        if set(ka) != set(kb) else f"{where}: key order differs")
            for k in ka:
                d = self.value(a[k], b[k], f"{where}/{k}", sets)
                if d:
                    return d
            return None
        if isinstance(a, list):
            if where.endswith("/params"):
                return None if sorted(a) == sorted(b) else f"{where}: {a} vs {b}"
            if len(a) != len(b):
                return f"{where}: lengths {len(a)} vs {len(b)}"
            for i, (x, y) in enumerate(zip(a, b)):
                d = self.value(x, y, f"{where}[{i}]", sets)
                if d:
                    return d
            return None
        if self.whole and isinstance(a, sd_exchange.Sharded) and torch.is_tensor(b):
            t = assemble(a)
            if t is not None:
                self.wholes += 1
                return self.tensor(t, b, where)
        if isinstance(a, sd_exchange.Sharded) or isinstance(b, sd_exchange.Sharded):
            if not (isinstance(a, sd_exchange.Sharded) and isinstance(b, sd_exchange.Sharded)):
                return f"{where}: {type(a).__name__} vs {type(b).__name__}"
            if (a.size, a.dtype) != (b.size, b.dtype):
                return f"{where}: sharded {a.size} {a.dtype} vs {b.size} {b.dtype}"
            if sorted(map(repr, a.global_md)) != sorted(map(repr, b.global_md)):
                return f"{where}: global shard metadata differs: {a.global_md} vs {b.global_md}"
            pa = {repr(p[:3]): p[3] for p in a.pieces}
            pb = {repr(p[:3]): p[3] for p in b.pieces}
            if set(pa) != set(pb):
                return f"{where}: local pieces differ: {list(pa)} vs {list(pb)}"
            for key in pa:
                d = self.tensor(pa[key], pb[key], f"{where} piece {key}")
                if d:
                    return d
            return None
        if torch.is_tensor(a) or torch.is_tensor(b):
            if not (torch.is_tensor(a) and torch.is_tensor(b)):
                return f"{where}: {type(a).__name__} vs {type(b).__name__}"
            return self.tensor(a, b, where)
        if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
            return None if a == b and type(a) is type(b) else f"{where}: {a!r} vs {b!r}"
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return None if float(a) == float(b) else f"{where}: {a!r} vs {b!r}"
        return None if a == b else f"{where}: {a!r} vs {b!r}"


def optim_sets(d):
    """Paths whose dicts compare as sets in a {"model", "optim"} dict `d`."""
    paths = ["/optim/state"]
    if isinstance(d, dict) and isinstance(d.get("optim"), dict) and isinstance(
            d["optim"].get("state"), dict):
        paths += [f"/optim/state/{k}" for k in d["optim"]["state"]]
    if isinstance(d, dict) and isinstance(d.get("optim"), dict) and "state" not in d["optim"]:
        paths.append("/optim")  # the flat form: "state.<fqn>.<name>" keys
    return tuple(paths)


# Where PyTorch 2.6's own get_/set_state_dict on its FSDP cannot be the reference, and why
# (docs/state_dict_api.md, "Where PyTorch differs"). Each is a predicate on the combination, the
# world size, PyTorch's error (or None) and fsdp-cpp's (or None), for get or set.
def known_difference(c, world, py_err, cpp_err, what):
    py_err = py_err or ""
    if what == "set" and "PYTORCH_WOULD_HANG" in py_err and not cpp_err:
        return ("full_state_dict + cpu_offload set with the dicts get left (values on rank 0): "
                "PyTorch's ranks > 0 skip the model load rank 0 waits in")
    if what == "get" and "KeyError" in py_err and c["frozen"] and c["sub"] and not cpp_err:
        return ("ignore_frozen_params with submodules: PyTorch pops frozen keys the submodule "
                "filter already removed (KeyError)")
    if what == "set" and c["flatten"] and not cpp_err and (
            "head.weight" in py_err or (c["bcast"] and "imeout" in py_err)):
        return ("flatten_optimizer_state_dict with a tied parameter: PyTorch's unflatten looks for "
                "state under each of its FQNs (KeyError 'state.head.weight.step'; under "
                "broadcast_from_rank0 on rank 0 alone, which leaves the others waiting)")
    # Deliberate (issue 62): a dict taken with ignore_frozen_params, loaded with the same options
    # and the default strict, fails in fsdp-cpp with a message naming strict(false).
    names_option = not (c["frozen"] and not c["sub"]) or "strict(false)" in (cpp_err or "")
    if what == "set" and c["full"] and (c["frozen"] or c["sub"]) and (
            (("size mismatch" in py_err or "Error(s) in loading state_dict" in py_err)
             and not cpp_err) or
            (not py_err and cpp_err and "Missing key(s)" in cpp_err and c["strict"]
             and names_option)):
        return ("deliberate: full_state_dict set of a dict lacking keys: PyTorch 2.6 fills them "
                "with the model's own tensors (flat parameters then fail on their shapes, "
                "original ones pass a strict load); fsdp-cpp keeps PyTorch's strict key check "
                "and names strict(false)")
    return None


def tensors_by_path(d, path="", out=None):
    """Every tensor of a read-back dict by its path (dict keys, list indices)."""
    out = {} if out is None else out
    if isinstance(d, dict):
        for k, v in d.items():
            tensors_by_path(v, f"{path}/{k}", out)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            tensors_by_path(v, f"{path}[{i}]", out)
    elif torch.is_tensor(d):
        out[path] = d
    return out


def max_difference(a, b):
    """The largest elementwise difference between the tensors two dicts hold at the same paths,
    whatever their order."""
    ta, tb = tensors_by_path(a), tensors_by_path(b)
    worst = 0.0
    for p in ta.keys() & tb.keys():
        x, y = ta[p], tb[p]
        if x.shape == y.shape and x.numel() and x.is_floating_point():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def assemble(nodes):
    """Every rank's read-back dict (the same structure on each) as one: each Sharded becomes the
    whole tensor its pieces on all ranks make up (NaN where no piece lies), the rest rank 0's."""
    first = nodes[0]
    if isinstance(first, dict):
        keys = list(first)
        for n in nodes[1:]:
            keys += [k for k in n if k not in keys]
        return {k: assemble([n[k] for n in nodes if k in n]) for k in keys}
    if isinstance(first, list):
        return [assemble([n[i] for n in nodes if i < len(n)]) for i in range(len(first))]
    if isinstance(first, sd_exchange.Sharded):
        pieces = [p for n in nodes for p in n.pieces]
        dtype = pieces[0][3].dtype if pieces else torch.float32
        whole = torch.full(first.size, float("nan"), dtype=torch.float64)
        for offsets, sizes, _, t in pieces:
            box = tuple(slice(o, o + z) for o, z in zip(offsets, sizes))
            whole[box] = t.to(torch.float64).reshape(sizes)
        return whole.to(dtype)
    return first


def compare_flat_layout(py, cpp, world, k, tol):
    """The default layout (FLAT_SHARDS) against PyTorch's dim-0 chunks: the pieces differ, the
    tensors all ranks' pieces make up must not. Returns (equal, failure or None)."""
    mine = [sd_exchange.read(os.path.join(cpp, f"getflat_c{k}_r{r}")) for r in range(world)]
    theirs = [sd_exchange.read(os.path.join(py, f"get_c{k}_r{r}")) for r in range(world)]
    if any(m is None for m in mine):
        return False, "the FLAT_SHARDS get wrote no result"
    mine_err = [m[1] for m in mine if isinstance(m, tuple)]
    dim0_err = [sd_exchange.read(os.path.join(cpp, f"get_c{k}_r{r}")) for r in range(world)]
    dim0_err = [m[1] for m in dim0_err if isinstance(m, tuple)]
    if mine_err or dim0_err:
        # Whether it raises does not depend on the layout.
        if bool(mine_err) != bool(dim0_err):
            return False, (f"FLAT_SHARDS {'raised: ' + mine_err[0] if mine_err else 'ok'}, "
                           f"DIM0_CHUNKS {'raised: ' + dim0_err[0] if dim0_err else 'ok'}")
        return True, None
    if any(t is None or isinstance(t, tuple) for t in theirs):
        return None, None  # PyTorch raised or wrote nothing: compared (or known) at get
    a, b = assemble(mine), assemble(theirs)
    for path, t in tensors_by_path(a).items():
        if t.is_floating_point() and t.numel() and torch.isnan(t).any():
            return False, f"FLAT_SHARDS pieces leave elements of {path} uncovered"
    diff = Cmp(tol).value(a, b, "", optim_sets(b))
    return (False, f"FLAT_SHARDS assembled: {diff}") if diff else (True, None)


def compare_group(py, cpp, world, combos, single):
    """Compares one (strategy, orig, W) group. Returns (tol, equal, failures, known)."""
    t_py, t_cpp = sd_exchange.read(os.path.join(py, "truth")), sd_exchange.read(
        os.path.join(cpp, "truth"))
    failures, known, equal = [], [], 0
    # Both trainings against plain training on the whole batches: the rounding of the reduction
    # order (RMSprop's centered momentum amplifies it most), the bound for every comparison. A
    # drift above 1e-4 is a wrong training, not rounding (fsdp-cpp's own correctness is
    # tests/state_dict/test_sd_matrix.cpp's, against the unwrapped model).
    drifts = [max_difference(t, single) for t in (t_py, t_cpp)]
    tol = 2 * max(drifts)
    if max(drifts) > 1e-4:
        failures.append(f"drift from plain training too large to trust (PyTorch {drifts[0]:.2e}, "
                        f"fsdp-cpp {drifts[1]:.2e})")
    d = Cmp(tol).value(t_cpp, t_py, "truth", optim_sets(t_py))
    if d:
        failures.append(f"trained models differ: {d}")
    for k in combos:
        c = combo(k)
        if not c["full"]:
            same, why = compare_flat_layout(py, cpp, world, k, tol)
            if same:
                equal += 1
            elif why:
                failures.append(f"c{k} {combo_text(k)} getflat: {why}")
        for what in ("get", "set"):
            stems = ([f"get_c{k}_r{r}" for r in range(world)] if what == "get" else [f"set_c{k}"])
            for stem in stems:
                a = sd_exchange.read(os.path.join(cpp, stem))
                b = sd_exchange.read(os.path.join(py, stem))
                if a is None and b is None:
                    continue
                ea = a[1] if isinstance(a, tuple) else None
                eb = b[1] if isinstance(b, tuple) else None
                label = f"c{k} {combo_text(k)} {stem.split('_')[0]}" + (
                    f" rank {stem.split('_r')[-1]}" if what == "get" else "")
                if eb and "get raised" in eb:
                    continue  # reported at get
                ref = sd_exchange.read(os.path.join(py, "getref" + stem[3:])) if (
                    what == "get" and eb and "PYTORCH_CPU_OFFLOAD" in eb) else None
                if isinstance(ref, tuple):
                    eb = ref[1]  # PyTorch's get without cpu_offload raised: that is its answer
                elif ref is not None and not ea:
                    # PyTorch's own full + cpu_offload get fails on CPU: rank 0 must hold what
                    # its get without cpu_offload holds, the other ranks empty dicts.
                    rank = int(stem.split("_r")[-1])
                    want = ref if rank == 0 else {"model": {}, "optim": {}}
                    diff = Cmp(tol).value(a, want, "", optim_sets(want))
                    if diff:
                        failures.append(f"{label}: {diff} (against PyTorch's get without "
                                        f"cpu_offload)")
                    else:
                        known.append(f"{label}: equal to PyTorch's get without cpu_offload "
                                     f"(PyTorch's own cannot offload on the CPU)")
                    continue
                if ea or eb:
                    if ea and eb:
                        equal += 1  # both refuse
                        continue
                    why = known_difference(c, world, eb, ea, what)
                    if why:
                        known.append(f"{label}: {why}")
                    else:
                        failures.append(f"{label}: fsdp-cpp {'raised: ' + ea if ea else 'ok'}; "
                                        f"PyTorch {'raised: ' + eb if eb else 'ok'}")
                    continue
                if a is None or b is None:
                    failures.append(f"{label}: only {'PyTorch' if a is None else 'fsdp-cpp'} "
                                    f"wrote a result")
                    continue
                cmp = Cmp(tol, whole=world == 1)
                diff = cmp.value(a, b, "", optim_sets(b))
                if diff:
                    failures.append(f"{label}: {diff}")
                elif cmp.wholes:
                    known.append(f"{label}: equal, with one-piece ShardedTensors where PyTorch "
                                 f"(which runs every strategy as NO_SHARD at world size 1) "
                                 f"returns plain tensors")
                else:
                    equal += 1
    return tol, equal, failures, known


# --------------------------------------------------------------------------------------------
# Driver


def main():
    import run_oracle

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--orig", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--combos", default="all", help="all, or a comma-separated list")
    ap.add_argument("--sample", type=int, default=0, help="this many combos per group, drawn")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    t0 = time.monotonic()
    torch.set_num_threads(1)
    binary, work = os.path.abspath(args.binary), os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    data = os.path.join(work, "data")
    generate(data)
    single = {o: sd_exchange_roundtrip(train_single(data, bool(o)),
                                       os.path.join(work, f"single{o}")) for o in (0, 1)}
    combos = list(range(N_COMBOS)) if args.combos == "all" else [
        int(x) for x in args.combos.split(",")]
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    rng = random.Random(seed)
    print(f"sd_matrix oracle: torch {torch.__version__}, worlds {args.worlds}, strategies "
          f"{args.strategies}, {len(combos)} combinations" +
          (f", {args.sample} drawn per group with seed {seed} (--seed {seed})" if args.sample
           else ""), flush=True)
    total_eq, total_fail, total_known = 0, [], []
    for w in args.worlds:
        for s in args.strategies:
            for o in args.orig:
                mine = sorted(rng.sample(combos, min(args.sample, len(combos)))) if args.sample \
                    else combos
                name = f"W{w}_{s}_{'orig' if o else 'flat'}"
                py, cpp = os.path.join(work, name, "py"), os.path.join(work, name, "cpp")
                os.makedirs(py), os.makedirs(cpp)
                logs = os.path.join(work, name, "logs")
                spec = ",".join(map(str, mine))
                t = time.monotonic()
                run_python(data, py, s, o, w, mine, args.timeout, logs)
                tp = time.monotonic() - t
                t = time.monotonic()
                run_oracle.launch(f"fsdp-cpp {name}",
                                  [binary, "--data", data, "--out", cpp, "--python", py,
                                   "--strategy", s, "--orig", str(o), "--combos", spec],
                                  w, args.timeout, logs)
                tc = time.monotonic() - t
                tol, eq, fails, known = compare_group(py, cpp, w, mine, single[o])
                total_eq += eq
                total_fail += [f"{name} {f}" for f in fails]
                total_known += [f"{name} {k}" for k in known]
                print(f"{name:<24} tol {tol:.2e}: {eq} equal, {len(known)} known differences, "
                      f"{len(fails)} failures (python {tp:.0f}s, fsdp-cpp {tc:.0f}s)", flush=True)
                for f in fails[:8]:
                    print(f"    FAIL {f}")
                if len(fails) > 8:
                    print(f"    ... {len(fails) - 8} more")
    reasons = {}
    for k in total_known:
        why = k.split(": ", 1)[1]
        reasons[why] = reasons.get(why, 0) + 1
    print("\nknown differences (docs/state_dict_api.md):")
    for why, n in reasons.items():
        print(f"  {n:5d}  {why}")
    print(f"\nsd_matrix oracle: {total_eq} comparisons equal, {len(total_known)} known "
          f"differences, {len(total_fail)} failures, in {time.monotonic() - t0:.0f} s")
    print(f"{total_eq + len(total_known)} passed, {len(total_fail)} failed")
    return 0 if not total_fail else 1


def last_error(logs, world, label):
    """The last exception line any rank of a failed launch printed."""
    found, raised = "", ""
    for r in range(world):
        path = os.path.join(logs, f"{label.replace(' ', '_')}.rank{r}.log")
        if not os.path.exists(path):
            continue
        for line in open(path, errors="replace"):
            line = line.strip()
            if any(x in line for x in ("Connection closed", "Connection reset", "Read error",
                                       "imed out", "imeout")):
                continue
            if " raised " in line:
                raised = raised or line.split(" raised ", 1)[1]
            elif "Error:" in line or "what():" in line:
                found = line.split("]: ", 1)[-1]
    return raised or found or "a rank failed (see the logs; peers timed out)"


def run_python(data, py, strategy, orig, world, combos, timeout, logs):
    """Runs the Python worker over `combos`. PyTorch sometimes raises on one rank only, which
    leaves the others in a collective: the launch then fails, the combination it was on gets the
    error (as its get's or its set's), and a new launch goes on after it."""
    import run_oracle

    todo = list(combos)
    attempt = 0
    while todo:
        label = f"python {os.path.basename(os.path.dirname(py))} {attempt}"
        try:
            run_oracle.launch(label, [sys.executable, "-B", os.path.abspath(__file__), "worker",
                                      data, py, strategy, str(orig), ",".join(map(str, todo))],
                              world, timeout, logs,
                              finished=lambda r: os.path.join(py, f"finished_r{r}"))
            return
        except RuntimeError:
            pass
        failed = next(k for k in todo if not os.path.exists(os.path.join(py, f"done_c{k}")))
        why = RuntimeError(f"PyTorch failed on some rank: {last_error(logs, world, label)}")
        if all(sd_exchange.read(os.path.join(py, f"get_c{failed}_r{r}")) is not None
               for r in range(world)):
            sd_exchange.write(why, os.path.join(py, f"set_c{failed}"))
        else:
            for r in range(world):
                sd_exchange.write(why, os.path.join(py, f"get_c{failed}_r{r}"))
        todo = todo[todo.index(failed) + 1:]
        attempt += 1


def sd_exchange_roundtrip(d, stem):
    """`d` as the comparison reads dicts back (through the exchange format)."""
    sd_exchange.write(d, stem)
    return sd_exchange.read(stem)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        # sd_matrix.py worker DATA OUT STRATEGY ORIG COMBOS   (env RANK, WORLD_SIZE, MASTER_*)
        worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1",
               [int(x) for x in sys.argv[6].split(",") if x])
    else:
        sys.exit(main())
