#!/usr/bin/env python3
"""Writes the files of Python's own that seed the fuzz corpora (see make_seeds.py).

Run where PyTorch >= 2 and safetensors are installed (the trixie chroot of scripts/torch2-env.sh):
    python3 tests/fuzz/python_seeds.py OUT_DIR
It writes OUT_DIR/py_dcp/ (torch.distributed.checkpoint.save of a small state dict),
OUT_DIR/py.pt and py_nested.pt (torch.save), OUT_DIR/py.safetensors (safetensors.torch),
OUT_DIR/py_st_sharded/ (two safetensors files and the index transformers writes), and
OUT_DIR/pickles/*.pkl (pickle.dumps of plain structures at protocols 2 to 5). Every file is one
fsdp-cpp reads whole (string keys, integers within 64 bits): a seed must not start on an error.
"""
import collections
import json
import os
import pickle
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(4, 3),
        "b": torch.tensor([0.5, -1.0]).to(torch.bfloat16),
        "steps": torch.tensor([7], dtype=torch.int64),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 2),
    }
    torch.save(tensors, os.path.join(out, "py.pt"))
    nested = collections.OrderedDict(
        model=tensors, optim={"state": {"fc.weight": {"step": torch.tensor(3.0)}}, "param_groups": [
            {"lr": 0.1, "params": ["fc.weight"]}]}, epoch=2, name="run")
    torch.save(nested, os.path.join(out, "py_nested.pt"))
    save_file({k: v for k, v in tensors.items()}, os.path.join(out, "py.safetensors"),
              metadata={"format": "pt"})
    # Sharded as transformers' save_pretrained(max_shard_size=...) lays it out: two files and
    # model.safetensors.index.json mapping each tensor to its file.
    sharded = os.path.join(out, "py_st_sharded")
    os.makedirs(sharded, exist_ok=True)
    names, weight_map, total = sorted(tensors), {}, 0
    for i, part in enumerate((names[:2], names[2:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(sharded, fname),
                  metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving without one"
        dcp.save({"model": dict(tensors), "step": 3}, checkpoint_id=os.path.join(out, "py_dcp"))
    pickles = os.path.join(out, "pickles")
    os.makedirs(pickles, exist_ok=True)
    values = {
        "scalars": [None, True, False, 0, 1, -1, 255, 65535, 2**31, -2**31, 2**63 - 1, -2**63,
                    0.5, -0.0, float("inf"), "text", "ünïcode", b"bytes", bytearray(b"ba")],
        "nested": {"a": [1, (2, 3), {"b": [4, [5, [6]]]}], "c": (), "d": {}, "e": []},
        "shared": [[1, 2]] * 3,
    }
    for name, v in values.items():
        for proto in (2, 3, 4, 5):
            if proto < 3 and name == "scalars":
                v = [x for x in v if not isinstance(x, (bytes, bytearray))]
            with open(os.path.join(pickles, f"{name}_p{proto}.pkl"), "wb") as f:
                f.write(pickle.dumps(v, protocol=proto))


if __name__ == "__main__":
    main(sys.argv[1])
