"""State dicts across the language boundary, for the state-dict matrix oracle (issue 37).

A nested state dict (dicts with key order, lists, tensors, ShardedTensors, numbers, strings, None)
is written as <stem>.json (its structure) and <stem>.safetensors (its tensors); a dict that raised
instead is written as <stem>.error (the message). tests/helpers/sd_exchange.h reads and writes the same
format in C++. Nothing in these files is executed: JSON and safetensors only.

JSON nodes:
  {"dict": [[key, node], ...]}          keys in order
  {"list": [node, ...]}                 (tuples too)
  {"tensor": "<safetensors name>"}
  {"sharded": {"size": [...], "dtype": "F32", "pieces": [{"offsets": [...], "sizes": [...],
               "rank": r, "tensor": name}], "global": [{"offsets", "sizes", "rank"}]}}
  {"int": "123"}  {"float": "0.1"}  {"bool": true}  {"str": "..."}  {"none": null}
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _encode(obj, tensors):
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def put(t):
        name = f"t{len(tensors)}"
        tensors[name] = t.detach().cpu().contiguous().clone()
        return name

    if isinstance(obj, ShardedTensor):
        md = obj.metadata()
        return {"sharded": {
            "size": list(md.size), "dtype": DTYPES[md.tensor_properties.dtype],
            "pieces": [{"offsets": list(s.metadata.shard_offsets),
                        "sizes": list(s.metadata.shard_sizes),
                        "rank": s.metadata.placement.rank(), "tensor": put(s.tensor)}
                       for s in obj.local_shards()],
            "global": [{"offsets": list(m.shard_offsets), "sizes": list(m.shard_sizes),
                        "rank": m.placement.rank()} for m in md.shards_metadata]}}
    if torch.is_tensor(obj):
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            raise TypeError(f"sd_exchange: {type(obj).__name__} is not supported")
        return {"tensor": put(obj)}
    if isinstance(obj, bool):
        return {"bool": obj}
    if isinstance(obj, int):
        return {"int": str(obj)}
    if isinstance(obj, float):
        return {"float": repr(obj)}
    if isinstance(obj, str):
        return {"str": obj}
    if obj is None:
        return {"none": None}
    if isinstance(obj, dict):
        return {"dict": [[str(k), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"list": [_encode(v, tensors) for v in obj]}
    raise TypeError(f"sd_exchange: cannot write a {type(obj).__name__}")


def write(obj_or_error, stem):
    """Writes a dict, or the exception it raised, as <stem>.json + .safetensors / <stem>.error."""
    for ext in (".json", ".safetensors", ".error"):
        if os.path.exists(stem + ext):
            os.remove(stem + ext)
    if isinstance(obj_or_error, BaseException):
        with open(stem + ".error", "w") as f:
            f.write(f"{type(obj_or_error).__name__}: {obj_or_error}")
        return
    tensors = {}
    node = _encode(obj_or_error, tensors)
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w") as f:
        json.dump(node, f)


class Sharded:
    """A ShardedTensor as read back: its global size and dtype, local pieces, global metadata."""

    def __init__(self, size, dtype, pieces, global_md):
        self.size, self.dtype, self.pieces, self.global_md = size, dtype, pieces, global_md

    def __repr__(self):
        return f"Sharded({self.size}, {self.dtype}, {len(self.pieces)} pieces)"


def _decode(node, tensors):
    (kind, v), = node.items()
    if kind == "dict":
        return {k: _decode(x, tensors) for k, x in v}
    if kind == "list":
        return [_decode(x, tensors) for x in v]
    if kind == "tensor":
        return tensors[v]
    if kind == "sharded":
        return Sharded(v["size"], v["dtype"],
                       [(p["offsets"], p["sizes"], p["rank"], tensors[p["tensor"]])
                        for p in v["pieces"]],
                       [(m["offsets"], m["sizes"], m["rank"]) for m in v["global"]])
    if kind == "int":
        return int(v)
    if kind == "float":
        return float(v)
    if kind in ("bool", "str"):
        return v
    if kind == "none":
        return None
    raise ValueError(f"sd_exchange: unknown node {kind}")


def read(stem):
    """The dict at <stem> (ShardedTensors as Sharded), or the error string it recorded, or None
    if nothing was written."""
    if os.path.exists(stem + ".error"):
        with open(stem + ".error") as f:
            return ("error", f.read())
    if not os.path.exists(stem + ".json"):
        return None
    with open(stem + ".json") as f:
        node = json.load(f)
    return _decode(node, load_file(stem + ".safetensors"))
