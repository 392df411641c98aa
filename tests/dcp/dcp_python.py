"""Python's side of the DCP metadata tests (tests/checkpoint/test_dcp_metadata.cpp; issue 11).

  dcp_python.py save DIR       a DCP checkpoint of a fixed state dict, written by stock
                               torch.distributed.checkpoint (single process)
  dcp_python.py describe DIR   DIR/.metadata as read by stock DCP, one canonical line per item
  dcp_python.py values DIR     loads every item of DIR with stock dcp.load into a flat template
                               built from its metadata; prints "<key> <dtype> <values>" per item

The canonical lines (the C++ test prints the same from its own parse):
  T <fqn> <dtype> <size> <chunk offsets>:<chunk sizes> ...   a tensor
  B <fqn>                                                    a non-tensor value
  S <fqn> <offset or None> <index or None> <file> <offset> <length>   where an item's bytes are
  P <flattened key> <path element> ...                       the planner's flatten mapping
Sizes and offsets are comma-separated ("-" for a 0-d tensor). Needs torch >= 2.
"""
import sys

import torch
import torch.distributed.checkpoint as dcp


def dims(v):
    return ",".join(str(int(x)) for x in v) or "-"


def describe(path):
    md = dcp.FileSystemReader(path).read_metadata()
    lines = []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, dcp.metadata.BytesStorageMetadata):
            lines.append(f"B {fqn}")
            continue
        chunks = " ".join(f"{dims(c.offsets)}:{dims(c.sizes)}" for c in item.chunks)
        dtype = str(item.properties.dtype).replace("torch.", "")
        lines.append(f"T {fqn} {dtype} {dims(item.size)} {chunks}".rstrip())
    for idx, info in md.storage_data.items():
        off = "None" if idx.offset is None else dims(idx.offset)
        index = "None" if idx.index is None else str(idx.index)
        lines.append(f"S {idx.fqn} {off} {index} {info.relative_path} {info.offset} {info.length}")
    for key, p in (md.planner_data or {}).items():
        lines.append("P " + key + " " + " ".join(str(e) for e in p))
    print("\n".join(sorted(lines)))


def values(path):
    md = dcp.FileSystemReader(path).read_metadata()
    target = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, dcp.metadata.BytesStorageMetadata):
            target[fqn] = None
        else:
            target[fqn] = torch.full(tuple(item.size), -1, dtype=item.properties.dtype)
    dcp.load(target, checkpoint_id=path)
    lines = []
    for k, v in target.items():
        if isinstance(v, torch.Tensor):
            vals = ",".join(repr(float(x)) for x in v.flatten().to(torch.float64).tolist())
            lines.append(f"{k} {str(v.dtype).replace('torch.', '')} {vals}")
        else:
            lines.append(f"{k} value {v!r}")
    print("\n".join(sorted(lines)))


def save(path):
    sd = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16),
                  "i": torch.tensor([1, 2], dtype=torch.int64), "s": torch.tensor(2.5),
                  # Large enough to be read straight into the target; "big_t" is stored in
                  # transposed element order (DCP saves a view whole when it spans its storage).
                  "big": torch.arange(300 * 400.0).reshape(300, 400),
                  "big_t": torch.arange(300 * 400.0).reshape(400, 300).t()},
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w"]}]},
        "epoch": 7,
    }
    dcp.save(sd, checkpoint_id=path)


if __name__ == "__main__":
    {"save": save, "describe": describe, "values": values}[sys.argv[1]](sys.argv[2])
