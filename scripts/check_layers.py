#!/usr/bin/env python3
"""Checks the include layering of fsdp-cpp (docs/layers.md): every #include "..." of the library,
its public headers, tools and examples against the layer order

    util -> dist -> flat_param -> runtime -> state_dict -> checkpoint

A file may include its own folder's headers, the public headers (include/fsdp/) of its own and
lower layers, and, of another folder's internal headers, only those the folder exports to it.
Tools and examples use the public API only. Tests and benchmarks may include anything.

checkpoint/ is split into rooms, lowest first formats -> storage -> dcp -> save -> load -> exchange:
every file of checkpoint/ lives in a room, and includes its own room's headers and those of lower
rooms only.

Beside the library sits launch/, fsdp-run's own layer (not part of libfsdp): it uses util/ and the
base public headers only, nothing of the library includes it, and of tools/ only fsdp-run's main
(tools/fsdp_run.cpp) does.

    scripts/check_layers.py [ROOT]     exit 1 and one line per violation if any
    scripts/check_layers.py --self-test  the checker against trees with known violations
"""
import os
import re
import sys
import tempfile

ORDER = ["util", "dist", "flat_param", "runtime", "state_dict", "checkpoint"]

# Layers split into rooms, lowest first: a room's files include their own room's headers and those of
# lower rooms; every file of the layer lives in a room.
ROOMS = {"checkpoint": ["formats", "storage", "dcp", "save", "load", "exchange"]}

# Layers beside the library's order: folder -> (the folders it may use, the tools that may use it).
SIDE = {"launch": ({"launch", "util"}, {"tools/fsdp_run.cpp"})}

# Internal headers a folder offers to the folders above it: folder -> {header: importers}.
# Everything else in a folder is its own business. util/ is the shared toolbox: open to all.
EXPORTS = {
    "dist": {"agreement.h": {"runtime", "state_dict", "checkpoint"}},
    "flat_param": {"grad_bucket.h": {"runtime"}},
    "runtime": {"view.h": {"state_dict"}},
}

# The layer of each public header (include/fsdp/<name>); "base" headers are open to every layer.
PUBLIC = {
    "errors.h": "base",
    "compat.h": "base",
    "compat_backends.h": "base",  # building c10d backends: for dist/, not in fsdp.h
    "compat_cuda.h": "base",  # CUDA allocator statistics and sync debug: not in fsdp.h
    "compat_optim.h": "base",  # the fused AdamW kernel: for the runtime optimizers
    "dist.h": "dist",
    "flat_param.h": "flat_param",
    # the wrapper's options: ShardingStrategy is the first of them, and the handle needs it
    "options.h": "flat_param",
    "fully_sharded.h": "runtime",
    "deferred_init.h": "runtime",  # wrap_deferred: a model no rank holds whole
    "detail/forward.h": "runtime",  # fsdp::forward's machinery (templates), not an API
    "activation_checkpointing.h": "runtime",  # checkpointed calls, aware of FSDP units
    "detail/activation_checkpointing.h": "runtime",  # its templates, not an API
    "detail/deferred_init.h": "runtime",
    "foreach_adamw.h": "runtime",  # the optimizer step as multi-tensor operations  # what wrap_deferred hands the library, not an API
    "state_value.h": "state_dict",  # the value model: StateDict, StateValue, ShardedTensor
    "state_dict.h": "state_dict",  # its deprecated name
    "model_state_dict.h": "state_dict",
    "optim_state_dict.h": "state_dict",
    "state_dict_utils.h": "state_dict",
    # get_/set_state_dict: PyTorch's torch.distributed.checkpoint.state_dict, hence the path; it
    # touches no file and lives in state_dict/
    "checkpoint/state_dict.h": "state_dict",
    "fsdp.h": "top",  # the umbrella: includes everything, included by nothing of ours
}

# Both forms: a project header written <fsdp/dist.h> is checked as "fsdp/dist.h" is.
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def public_layer(name):
    """The layer of public header `name` (relative to include/fsdp/), or None if unknown."""
    if name in PUBLIC:
        return PUBLIC[name]
    if name.startswith("checkpoint/"):
        return "checkpoint"
    return None


def rank(layer):
    if layer == "base":
        return -1
    if layer == "top":
        return len(ORDER)
    return ORDER.index(layer)


def check_side_include(kind, layer, inc, rel):
    """check_include's rules for launch/ and its users: the problem, None if allowed, or False when
    the rules of the library's order decide."""
    folder = inc.split("/", 1)[0] if "/" in inc else None
    if layer in SIDE:
        if inc.startswith("fsdp/"):
            target = public_layer(inc[len("fsdp/"):])
            if target is not None and target != "base":
                return f"{inc} is the library's; {layer}/ uses only util/ and the base headers"
            return None
        if folder in ORDER + list(SIDE) and folder not in SIDE[layer][0]:
            return f"{inc}: {layer}/ uses only {', '.join(sorted(SIDE[layer][0]))}"
        return None
    if folder in SIDE:
        if kind == "client" and rel in SIDE[folder][1]:
            return None
        return f"{inc} belongs to {folder}/, which only {', '.join(sorted(SIDE[folder][1]))} uses"
    return False


def check_include(kind, layer, inc, root, rel=""):
    """The problem with `inc` included by a file of `kind` ('src', 'public', 'client', 'pch') in
    `layer`, or None."""
    if kind == "pch":  # precompiled into every layer's files, util/'s included: base headers only
        folder = inc.split("/", 1)[0] if "/" in inc else None
        if inc.startswith("fsdp/") and public_layer(inc[len("fsdp/"):]) != "base":
            return f"{inc}: the precompiled header reaches every layer; only base headers may be in it"
        if folder in ORDER or folder in SIDE:
            return f"internal header {inc} in the precompiled header of every layer"
        return None
    side = check_side_include(kind, layer, inc, rel)
    if side is not False:
        return side
    if inc.startswith("fsdp/"):
        target = public_layer(inc[len("fsdp/"):])
        if target is None:
            if os.path.exists(os.path.join(root, "include", inc)):
                return f"public header {inc} has no layer in scripts/check_layers.py (add it)"
            return None  # not ours
        if kind == "client":
            return None
        if target == "top":
            return "fsdp/fsdp.h is for users; the library includes the headers it needs"
        if rank(target) > rank(layer):
            return f"{inc} belongs to the higher layer '{target}'"
        return None
    folder = inc.split("/", 1)[0] if "/" in inc else None
    if folder not in ORDER:
        return None  # a file next to the includer (tests' helpers) or not ours
    if kind in ("public", "client"):
        return f"internal header {inc} in a {'public header' if kind == 'public' else 'user of the library'}"
    if folder == layer:
        return check_room(layer, inc, rel)
    if rank(folder) > rank(layer):
        return f"{inc} belongs to the higher layer '{folder}'"
    if folder == "util":
        return None
    header = inc.split("/", 1)[1]
    if layer in EXPORTS.get(folder, {}).get(header, set()):
        return None
    offered = [h for h, to in EXPORTS.get(folder, {}).items() if layer in to]
    return (f"{inc} is internal to {folder}/ (it offers {layer}/ "
            f"{', '.join(folder + '/' + h for h in offered) if offered else 'only its public headers'})")


def room_of(layer, rel):
    """The room of file `rel` (src/<layer>/<room>/...) of a layer with rooms, or None."""
    parts = rel.split("/")
    if len(parts) >= 4 and parts[0] == "src" and parts[1] == layer and parts[2] in ROOMS[layer]:
        return parts[2]
    return None


def check_room(layer, inc, rel):
    """The problem with `inc`, a header of the includer's own layer `layer`, or None."""
    if layer not in ROOMS:
        return None
    parts = inc.split("/")
    if len(parts) < 3 or parts[1] not in ROOMS[layer]:
        return f"{inc} is in no room of {layer}/ ({', '.join(ROOMS[layer])})"
    mine = room_of(layer, rel)
    if mine is None:
        return None  # the file itself is reported once, by check()
    if ROOMS[layer].index(parts[1]) > ROOMS[layer].index(mine):
        return f"{inc} belongs to the higher room '{parts[1]}' of {layer}/"
    return None


def files_to_check(root):
    """(path, kind, layer) of every file the rules cover."""
    for layer in ORDER + list(SIDE):
        d = os.path.join(root, "src", layer)
        for dirpath, _, names in os.walk(d):
            for n in sorted(names):
                if n.endswith((".h", ".cpp")):
                    yield os.path.join(dirpath, n), "src", layer
    pub = os.path.join(root, "include", "fsdp")
    for dirpath, _, names in os.walk(pub):
        for n in sorted(names):
            if n.endswith(".h"):
                rel = os.path.relpath(os.path.join(dirpath, n), pub).replace(os.sep, "/")
                yield os.path.join(dirpath, n), "public", public_layer(rel) or "unknown:" + rel
    pch = os.path.join(root, "src", "pch.h")
    if os.path.exists(pch):
        yield pch, "pch", "base"
    for top in ("tools", "examples"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for n in sorted(names):
                if n.endswith((".h", ".cpp")):
                    yield os.path.join(dirpath, n), "client", "top"
    for d in sorted(os.listdir(os.path.join(root, "src"))):
        if os.path.isdir(os.path.join(root, "src", d)) and d not in ORDER and d not in SIDE:
            yield os.path.join(root, "src", d), "folder", d


def check(root):
    problems = []
    for path, kind, layer in files_to_check(root):
        rel = os.path.relpath(path, root)
        if kind == "folder":
            problems.append(f"{rel}/: a folder of src/ in no layer (add it to ORDER and docs/layers.md)")
            continue
        if layer.startswith("unknown:"):
            problems.append(f"{rel}: public header with no layer in scripts/check_layers.py")
            continue
        if kind == "src" and layer in ROOMS and room_of(layer, rel.replace(os.sep, "/")) is None:
            problems.append(f"{rel}: a file of {layer}/ in no room ({', '.join(ROOMS[layer])}; "
                            "docs/layers.md)")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for m in INCLUDE.finditer(text):
            why = check_include(kind, layer, m.group(1), root, rel.replace(os.sep, "/"))
            if why:
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: #include \"{m.group(1)}\": {why}")
    return problems


def self_test():
    """Each planted violation must be reported, and a clean tree must pass: the check can fail."""
    clean = {
        "src/util/u.h": "",
        "src/dist/d.cpp": '#include "util/u.h"\n#include "fsdp/dist.h"\n#include "dist/x.h"\n',
        "src/dist/x.h": "",
        "src/runtime/view.h": '#include "fsdp/fully_sharded.h"\n',
        "src/runtime/state.h": "",
        "src/state_dict/s.cpp": '#include "runtime/view.h"\n#include "fsdp/model_state_dict.h"\n',
        "src/dist/agreement.h": "",
        "src/state_dict/interface.h": "",
        "src/checkpoint/save/c.cpp": ('#include "dist/agreement.h"\n#include "fsdp/errors.h"\n'
                                      '#include "checkpoint/formats/f.h"\n'
                                      '#include "checkpoint/save/c.h"\n'),
        "src/checkpoint/save/c.h": "",
        "src/checkpoint/formats/f.h": "",
        "src/state_dict/api.cpp": '#include "fsdp/checkpoint/state_dict.h"\n',
        "include/fsdp/checkpoint/state_dict.h": '#include "fsdp/state_value.h"\n',
        "include/fsdp/dist.h": '#include "fsdp/compat.h"\n',
        "include/fsdp/fsdp.h": '#include "fsdp/checkpoint/checkpoint.h"\n',
        "include/fsdp/checkpoint/checkpoint.h": '#include "fsdp/state_value.h"\n',
        "tools/t.cpp": '#include "fsdp/fsdp.h"\n',
        "src/launch/l.cpp": '#include "util/u.h"\n#include "fsdp/compat_backends.h"\n',
        "tools/fsdp_run.cpp": '#include "launch/l.h"\n',
        "src/pch.h": '#include <torch/torch.h>\n#include "fsdp/compat.h"\n',
    }
    violations = {
        "src/state_dict/bad.cpp": '#include "runtime/state.h"\n',        # past the runtime's view
        "src/checkpoint/save/bad.cpp": '#include "state_dict/interface.h"\n',  # not exported
        "src/checkpoint/formats/bad.cpp": '#include "checkpoint/save/c.h"\n',  # a higher room
        "src/checkpoint/save/bad2.cpp": '#include "checkpoint/c.h"\n',         # a header in no room
        "src/checkpoint/loose.cpp": "",                                        # a file in no room
        "src/state_dict/bad2.cpp": '#include "fsdp/checkpoint/checkpoint.h"\n',  # checkpoint's
        "src/dist/bad.cpp": '#include "flat_param/flattened.h"\n',       # upwards
        "src/flat_param/bad.cpp": '#include "fsdp/fully_sharded.h"\n',   # a higher public header
        "include/fsdp/bad_public.h": '#include "fsdp/dist.h"\n',         # a public header with no layer
        "include/fsdp/dist2.h": "",
        "tools/bad.cpp": '#include "runtime/view.h"\n',                  # a tool past the public API
        "src/memory/x.h": "",                                            # a folder in no layer
        "src/launch/bad.cpp": '#include "dist/x.h"\n',                   # the launcher into the library
        "src/launch/bad2.cpp": '#include "fsdp/dist.h"\n',               # ... or its public API
        "src/dist/bad2.cpp": '#include "launch/l.h"\n',                  # the library into the launcher
        "tools/bad2.cpp": '#include "launch/l.h"\n',                     # another tool into the launcher
        "include/fsdp/dist.h": '#include "fsdp/fully_sharded.h"\n',      # a public header upwards
        "include/fsdp/checkpoint/checkpoint.h": '#include "dist/x.h"\n', # internals in a public one
        "src/dist/bad3.cpp": '#include <fsdp/fully_sharded.h>\n',        # upwards, in angle brackets
        "src/pch.h": '#include "util/u.h"\n',                            # internals in every TU
    }

    scratch = tempfile.TemporaryDirectory(prefix="check_layers.")  # removed when the test ends
    trees = iter(range(1 << 30))

    def build(tree):
        root = os.path.join(scratch.name, str(next(trees)))
        for rel, text in tree.items():
            p = os.path.join(root, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(text)
        return root

    ok = True
    got = check(build(clean))
    if got:
        print("self-test: a clean tree was reported:", *got, sep="\n  ")
        ok = False
    for rel, text in violations.items():
        tree = dict(clean)
        tree[rel] = text
        got = check(build(tree))
        if not any(g.startswith(rel) or g.startswith(os.path.dirname(rel) + "/") for g in got):
            print(f"self-test: the planted violation in {rel} was not reported (got {got})")
            ok = False
    print("self-test:", "passed" if ok else "FAILED",
          f"({len(violations)} planted violations, one clean tree)")
    scratch.cleanup()
    return ok


def main():
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(0 if self_test() else 1)
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    problems = check(os.path.abspath(root))
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layering (docs/layers.md)")
        sys.exit(1)
    print("check_layers: every include respects the layering (docs/layers.md)")


if __name__ == "__main__":
    main()
