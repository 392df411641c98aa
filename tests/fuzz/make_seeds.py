#!/usr/bin/env python3
"""Lays out the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from real files.

The seeds are files written by fsdp-cpp and by Python's PyTorch, cut to what each target reads.
To remake them (they are committed; this is only needed when a format changes):

    # ours: the disabled test writes a DCP checkpoint, a .pt and a safetensors file
    FSDP_FUZZ_SEEDS_OUT=/tmp/seeds build/tests/test_fuzz_replay \\
        --gtest_also_run_disabled_tests --gtest_filter=FuzzSeeds.*
    # Python's: in the trixie chroot (PyTorch 2.6, safetensors)
    scripts/torch2-env.sh -- python3 tests/fuzz/python_seeds.py /src/build-trixie/py-seeds
    python3 tests/fuzz/make_seeds.py --in /tmp/seeds --in build-trixie/py-seeds \\
        --out tests/fuzz/corpus

Only the standard library is used here. Each seed is named after where it came from. With
--targets (e.g. --targets checkpoint_files,assemble) only those targets' seeds are remade, so that
adding a target leaves the others' committed seeds as they are.
"""
import argparse
import json
import os
import shutil
import struct
import zipfile

SEPARATOR = b"\n#FSDP-FUZZ-FILE#\n"  # tests/fuzz/targets.h, kFileSeparator
MANIFEST = ".fsdp_manifest.json"
MAX_SEED = 64 << 10
TARGETS = ("pickle", "dcp_metadata", "torch_archive", "manifest", "safetensors", "load_pt",
           "checkpoint", "checkpoint_files", "safetensors_files", "assemble", "fsdp_ckpt")


def zip_items(data):
    """Splits a file of concatenated zip archives (a .distcp) at each end-of-directory record."""
    items, start, at = [], 0, 0
    while True:
        at = data.find(b"PK\x05\x06", at)
        if at < 0 or at + 22 > len(data):
            return items
        (comment,) = struct.unpack_from("<H", data, at + 20)
        end = at + 22 + comment
        items.append(data[start:end])
        start = at = end


def data_pkl(archive_bytes, path):
    import io
    with zipfile.ZipFile(io.BytesIO(archive_bytes)) as z:
        for name in z.namelist():
            if name.endswith("/data.pkl"):
                return z.read(name)
    raise ValueError(f"{path}: no data.pkl")


def named(files):
    """The named-files framing of the directory targets (tests/fuzz/targets.h): {path: bytes}
    as parts "<path>\n<bytes>" joined by the separator, in path order."""
    return SEPARATOR.join(p.encode() + b"\n" + files[p] for p in sorted(files))


def files_under(d, prefix):
    """Every file under directory d, as {prefix + relative path: bytes}."""
    out = {}
    for dirpath, _, names in os.walk(d):
        for n in names:
            full = os.path.join(dirpath, n)
            out[prefix + os.path.relpath(full, d)] = read(full)
    return out


class Corpus:
    def __init__(self, out, only=None):
        self.out = out
        self.only = only  # the targets to write (None: all)

    def add(self, target, name, data):
        if len(data) > MAX_SEED or (self.only is not None and target not in self.only):
            return
        d = os.path.join(self.out, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def node_local(manifest):
    """The manifest as the first host's directory of a node-local save would hold it: 'files' lists
    the whole checkpoint, 'local_files' what this directory holds. Here the last item moves to a
    second host's file; an annotation is added (none of our saved seeds has one)."""
    m = json.loads(manifest)
    last = m["items"][-1]
    m["files"]["__1_0.distcp"] = last["length"]
    last["file"], last["offset"] = "__1_0.distcp", 0
    m["local_files"] = sorted(f for f in m["files"] if f != "__1_0.distcp")
    m["world_size"] = 2
    m["annotations"] = {"sharding_strategy": "FULL_SHARD"}
    return (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()


def add_dcp(corpus, tag, d):
    meta = read(os.path.join(d, ".metadata"))
    corpus.add("dcp_metadata", f"{tag}_metadata", meta)
    corpus.add("pickle", f"{tag}_metadata", meta)
    manifest = os.path.join(d, MANIFEST)
    if os.path.exists(manifest):
        corpus.add("manifest", f"{tag}_manifest.json", read(manifest))
        corpus.add("manifest", f"{tag}_node_local_manifest.json", node_local(read(manifest)))
    data_files = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))
    for f in data_files:
        for i, item in enumerate(zip_items(read(os.path.join(d, f)))):
            corpus.add("torch_archive", f"{tag}_{f}_item{i}", item)
            corpus.add("pickle", f"{tag}_{f}_item{i}_data.pkl", data_pkl(item, f))
    if len(data_files) == 1:  # the checkpoint target's framing holds one data file
        parts = [meta, read(os.path.join(d, data_files[0]))]
        if os.path.exists(manifest):
            parts.append(read(manifest))
        corpus.add("checkpoint", tag, SEPARATOR.join(parts))
    corpus.add("checkpoint_files", tag, named(files_under(d, "ckpt/")))
    corpus.add("fsdp_ckpt", tag, named(files_under(d, "a/")))


def add_safetensors_dir(corpus, tag, d):
    corpus.add("safetensors_files", tag, named(files_under(d, "st/")))
    corpus.add("fsdp_ckpt", tag, named(files_under(d, "a/")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in", dest="inputs", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", default=None,
                    help="comma-separated targets to remake (default: all); the others' seeds "
                    "stay as they are")
    args = ap.parse_args()
    only = set(args.targets.split(",")) if args.targets else None
    for t in TARGETS:
        if only is None or t in only:
            shutil.rmtree(os.path.join(args.out, t), ignore_errors=True)
    corpus = Corpus(args.out, only)
    for root in args.inputs:
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            tag = os.path.splitext(name)[0]
            if os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata")):
                add_dcp(corpus, tag, path)
            elif os.path.isdir(path) and name.endswith("_nl"):
                # A node-local save: one directory per host, each holding its part of step_N.
                corpus.add("assemble", tag, named(files_under(path, "")))
            elif name.endswith(".pt"):
                data = read(path)
                corpus.add("fsdp_ckpt", name, named({name: data}))
                corpus.add("load_pt", name, data)
                corpus.add("torch_archive", name, data)
                corpus.add("pickle", f"{tag}_data.pkl", data_pkl(data, path))
            elif name.endswith(".safetensors"):
                corpus.add("safetensors", name, read(path))
            elif os.path.isdir(path) and name == "pickles":
                for p in sorted(os.listdir(path)):
                    corpus.add("pickle", p, read(os.path.join(path, p)))
            elif os.path.isdir(path):
                for f in sorted(os.listdir(path)):
                    if f.endswith(".safetensors"):
                        corpus.add("safetensors", f"{tag}_{f}", read(os.path.join(path, f)))
                add_safetensors_dir(corpus, tag, path)
    for t in sorted(os.listdir(args.out)):
        n = len(os.listdir(os.path.join(args.out, t)))
        print(f"{t}: {n} seeds")


if __name__ == "__main__":
    main()
