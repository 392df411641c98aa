"""Python's side of the export tests (tests/checkpoint/test_checkpoint_export.cpp; issue 11).

  export_python.py pt_read FILE      torch.load(FILE, weights_only=True); prints its tensors
  export_python.py pt_write FILE     torch.save of a module-style state dict (an OrderedDict with
                                     _metadata, two keys sharing one storage, a strided view);
                                     prints its tensors
  export_python.py st_read PATH      safetensors.torch: a .safetensors file, or an index.json and
                                     the files it names; prints its tensors
  export_python.py st_write FILE     safetensors.torch.save_file of the same tensors; prints them

One line per tensor, sorted: "<name> <dtype> <shape> <values>", shape comma-separated ("-" for
0-d), values as Python float reprs. Works with torch 1.13 (pt_*) and 2.x; st_* need safetensors.
"""
import collections
import json
import os
import sys

import torch


def lines(sd):
    out = []
    for k, v in sd.items():
        shape = ",".join(str(int(x)) for x in v.shape) or "-"
        vals = ",".join(repr(float(x)) for x in v.flatten().to(torch.float64).tolist())
        out.append(f"{k} {str(v.dtype).replace('torch.', '')} {shape} {vals}")
    print("\n".join(sorted(out)))


def sample():
    base = torch.arange(12.0).reshape(3, 4)
    sd = collections.OrderedDict()
    sd["fc.weight"] = base
    sd["tied.weight"] = base  # the same storage under two names
    sd["view"] = base[:, 1:3]  # offset 1, strides (4, 1)
    sd["fc.bias"] = torch.tensor([0.5, -1.0, 2.0]).to(torch.bfloat16)
    sd["steps"] = torch.tensor([1, 2, 3], dtype=torch.int64)
    sd["scale"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.zeros(0, 3)
    sd._metadata = collections.OrderedDict({"": {"version": 1}})
    return sd


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "pt_read":
        lines(torch.load(path, weights_only=True))
    elif cmd == "pt_write":
        sd = sample()
        torch.save(sd, path)
        lines(sd)
    elif cmd == "st_read":
        from safetensors.torch import load_file
        if path.endswith(".json"):
            with open(path) as f:
                index = json.load(f)
            sd = {}
            for name in sorted(set(index["weight_map"].values())):
                sd.update(load_file(os.path.join(os.path.dirname(path), name)))
        else:
            sd = load_file(path)
        lines(sd)
    elif cmd == "st_write":
        from safetensors.torch import save_file
        sd = {k: v.contiguous().clone() for k, v in sample().items()}
        save_file(sd, path, metadata={"format": "pt"})
        lines(sd)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
