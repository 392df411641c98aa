"""Compares fsdp-cpp's results with Python FSDP's for one case (see fsdp_oracle.py for the files).

Tolerance for values (documented in tests/oracle/README.md): both implementations are compared
with two references computed in one process from the same inputs, plain training on the whole
global batch (`single`) and hand-written data parallelism at the same world size (`dp`):

    drift = max(max|dp - single|, max|python_fsdp - single|)      (measured, never from C++)
    tol   = 2 * drift
    bound(element) = max(tol, 4 float32 ulps of the reference element's magnitude)

|cpp - python_fsdp| <= bound and |cpp - single| <= bound must hold for every element (the
reference element is `single`'s for FULL values and Python's for SHARDED/LOCAL pieces). Both
measured drifts must themselves stay below SANITY (else the oracle is not trustworthy). Values
that no step may change (the frozen unit, the buffer) must be bit-identical, and the tied
weight must be identical under both names.

Layouts (keys, order, dtypes, shapes, pieces, padding) are compared exactly.

Optimizer state dicts (FULL and SHARDED, "state" flattened to "<fqn>/<state>") are compared the
same way, with the tolerance computed from the optimizer states' own drifts; "step" and the param
groups must be identical.
"""

import json
import os

import torch
from safetensors import safe_open

SANITY = 1e-4


def read_st(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def read_full(path):
    tensors, meta = read_st(path)
    order = json.loads(meta["order"])
    if sorted(order) != sorted(tensors):
        raise ValueError(f"{path}: metadata order does not list the tensors in the file")
    return order, tensors


def max_diff(a, b, keys):
    worst, where = 0.0, None
    for k in keys:
        if a[k].shape != b[k].shape:
            return float("inf"), f"{k} (shape {tuple(a[k].shape)} vs {tuple(b[k].shape)})"
        if a[k].numel() == 0:
            continue
        d = (a[k].double() - b[k].double()).abs().max().item()
        if where is None or d > worst:
            worst, where = d, k
    return worst, where


def ulps(ref, n=4):
    """n float32 ulps at each element's magnitude."""
    r = ref.float().abs()
    return (torch.nextafter(r, torch.full_like(r, float("inf"))) - r).double() * n


def excess(a, b, ref, tol):
    """(max |a - b|, max of |a - b| / bound) with bound = max(tol, 4 ulps of ref), elementwise."""
    if a.numel() == 0:
        return 0.0, 0.0
    d = (a.double() - b.double()).abs()
    bound = torch.clamp(ulps(ref), min=tol)
    return d.max().item(), (d / bound).max().item()


def tolerance(single, dp, py_full):
    keys = list(single)
    drift_dp, _ = max_diff(dp, single, keys)
    drift_py, _ = max_diff(py_full, single, keys)
    return {"drift_dp": drift_dp, "drift_py": drift_py, "tol": 2 * max(drift_dp, drift_py)}


class Result:
    def __init__(self):
        self.fails = {"FULL": [], "SHARDED": [], "LOCAL": [], "OPTIM": [], "OPTIM_SHARDED": []}
        self.notes = []
        self.numbers = {}

    def fail(self, aspect, msg):
        self.fails[aspect].append(msg)

    def verdict(self, aspect):
        return "FAIL" if self.fails[aspect] else "ok"

    @property
    def ok(self):
        return not any(self.fails.values())


def _load_json(path):
    with open(path) as f:
        return json.load(f)


def compare_full(res, py_dir, cpp_dir, single, single_order, dp, init):
    py_order, py = read_full(os.path.join(py_dir, "full.safetensors"))
    cpp_order, cpp = read_full(os.path.join(cpp_dir, "full.safetensors"))
    if py_order != single_order:
        res.fail("FULL", f"Python FSDP key order {py_order} differs from the unwrapped model's "
                         f"{single_order} (oracle problem)")
    if cpp_order != py_order:
        res.fail("FULL", f"key order differs: cpp {cpp_order} vs python {py_order}")
        return None
    for k in py_order:
        if cpp[k].dtype != py[k].dtype:
            res.fail("FULL", f"{k}: dtype cpp {cpp[k].dtype} vs python {py[k].dtype}")
        if cpp[k].shape != py[k].shape:
            res.fail("FULL", f"{k}: shape cpp {tuple(cpp[k].shape)} vs python {tuple(py[k].shape)}")
    if res.fails["FULL"]:
        return None
    tol = tolerance(single, dp, py)
    res.numbers.update(tol)
    for name, v in (("drift_dp", tol["drift_dp"]), ("drift_py", tol["drift_py"])):
        if v > SANITY:
            res.fail("FULL", f"reference drift {name}={v:.3g} exceeds {SANITY} (oracle unreliable)")
    worst = {"cpp_vs_py": 0.0, "cpp_vs_single": 0.0, "ratio": 0.0}
    for k in py_order:
        for name, other in (("cpp_vs_py", py), ("cpp_vs_single", single)):
            d, ratio = excess(cpp[k], other[k], single[k], tol["tol"])
            worst[name] = max(worst[name], d)
            worst["ratio"] = max(worst["ratio"], ratio)
            if ratio > 1:
                res.fail("FULL", f"{k}: |{name.replace('_vs_', ' - ')}| = {d:.3g} exceeds the "
                                 f"bound (tol {tol['tol']:.3g}, or 4 ulps) by {ratio:.3g}x")
    res.numbers.update(worst)
    # Exact invariants on both sides.
    for side, sd in (("cpp", cpp), ("python", py)):
        if not torch.equal(sd["tok.weight"], sd["head.weight"]):
            res.fail("FULL", f"{side}: tied tok.weight != head.weight")
        for k in ("frozen.weight", "frozen.bias", "scale"):
            if not torch.equal(sd[k], init[k]):
                res.fail("FULL", f"{side}: {k} changed although nothing may change it")
    return tol["tol"]


def _describe_error(d):
    return d.get("error") if isinstance(d, dict) else None


def compare_optim_full(res, py_dir, cpp_dir, single_osd, dp_osd):
    """FULL optimizer state dicts: the same "<fqn>/<state>" keys in the same order, dtypes,
    shapes, steps (exactly) and param groups (keys and values exactly); state values within the
    bound computed as for FULL model values, from the optimizer states' own drifts."""
    aspect = "OPTIM"
    py_order, py = read_full(os.path.join(py_dir, "optim_full.safetensors"))
    cpp_order, cpp = read_full(os.path.join(cpp_dir, "optim_full.safetensors"))
    py_groups = json.loads(read_st(os.path.join(py_dir, "optim_full.safetensors"))[1]["param_groups"])
    cpp_groups = json.loads(read_st(os.path.join(cpp_dir, "optim_full.safetensors"))[1]["param_groups"])
    if sorted(py_order) != sorted(single_osd):
        res.fail(aspect, f"Python FSDP's keys {py_order} differ from the single process's "
                         f"{sorted(single_osd)} (oracle problem)")
    # Dict order carries no meaning here and differs within PyTorch itself (flat parameters:
    # optimizer order, "step" last; original parameters: FQNs sorted, "step" first): compared as
    # sets, the difference noted.
    if sorted(cpp_order) != sorted(py_order):
        res.fail(aspect, f"keys differ: cpp has {sorted(set(cpp_order) - set(py_order))} more, "
                         f"python {sorted(set(py_order) - set(cpp_order))}")
        return None
    if cpp_order != py_order:
        res.notes.append("FULL optimizer state key order differs (not checked)")
    for k in py_order:
        if cpp[k].dtype != py[k].dtype or cpp[k].shape != py[k].shape:
            res.fail(aspect, f"{k}: cpp {cpp[k].dtype} {tuple(cpp[k].shape)} vs python "
                             f"{py[k].dtype} {tuple(py[k].shape)}")
    # "params" lists FQNs in the optimizer's order, which follows each wrapper's parameters():
    # compared as sets; every other group key exactly.
    def canon(groups):
        return [dict(g, params=sorted(g.get("params", []))) for g in groups]
    if canon(py_groups) != canon(cpp_groups):
        res.fail(aspect, f"param groups differ: cpp {canon(cpp_groups)} vs python {canon(py_groups)}")
    elif py_groups != cpp_groups:
        res.notes.append("param-group params order differs (not checked)")
    if res.fails[aspect]:
        return None
    values = [k for k in py_order if not k.endswith("/step")]
    for k in py_order:
        if k.endswith("/step") and not (torch.equal(cpp[k], py[k]) and torch.equal(py[k], single_osd[k])):
            res.fail(aspect, f"{k}: cpp {cpp[k].item()} python {py[k].item()} single "
                             f"{single_osd[k].item()}")
    drift_dp, _ = max_diff(dp_osd, single_osd, values)
    drift_py, _ = max_diff(py, single_osd, values)
    tol = 2 * max(drift_dp, drift_py)
    res.numbers.update({"optim_drift": max(drift_dp, drift_py), "optim_tol": tol})
    if max(drift_dp, drift_py) > SANITY:
        res.fail(aspect, f"optimizer reference drift {max(drift_dp, drift_py):.3g} exceeds "
                         f"{SANITY} (oracle unreliable)")
    worst = 0.0
    for k in values:
        for name, other in (("cpp - python", py), ("cpp - single", single_osd)):
            d, ratio = excess(cpp[k], other[k], single_osd[k], tol)
            worst = max(worst, d)
            if ratio > 1:
                res.fail(aspect, f"{k}: |{name}| = {d:.3g} exceeds the bound (tol {tol:.3g}, or "
                                 f"4 ulps) by {ratio:.3g}x")
    res.numbers["optim_max"] = worst
    return tol


def compare_described(res, aspect, py_dir, cpp_dir, world, tol, exact_keys):
    """SHARDED ("SHARDED"), LOCAL ("LOCAL") or SHARDED optimizer ("OPTIM_SHARDED") state dicts of
    every rank."""
    stem = aspect.lower()
    worst = 0.0
    for r in range(world):
        pj = _load_json(os.path.join(py_dir, f"{stem}_r{r}.json"))
        cj = _load_json(os.path.join(cpp_dir, f"{stem}_r{r}.json"))
        pe, ce = _describe_error(pj), _describe_error(cj)
        if pe or ce:
            if not (pe and ce):
                what = ("Python FSDP returns a state dict (keys: "
                        f"{[k['key'] for k in pj['keys']][:4]}..., types "
                        f"{sorted({k['type'] for k in pj['keys']})}) but fsdp-cpp raised: {ce}"
                        if ce else f"Python FSDP raised ({pe}) but fsdp-cpp returned a dict")
                res.fail(aspect, f"rank {r}: {what}")
            continue
        pv, _ = read_st(os.path.join(py_dir, f"{stem}_r{r}.safetensors"))
        cv, _ = read_st(os.path.join(cpp_dir, f"{stem}_r{r}.safetensors"))
        pk = {e["key"]: e for e in pj["keys"]}
        ck = {e["key"]: e for e in cj["keys"]}
        p_order = [e["key"] for e in pj["keys"]]
        c_order = [e["key"] for e in cj["keys"]]
        flat_p = [k for k in p_order if k.endswith("_flat_param")]
        if aspect == "LOCAL" and flat_p:
            # Strict on the flat parameters and on every key both hold; the complete key list
            # and its order are notes (see README.md).
            flat_c = [k for k in c_order if k.endswith("_flat_param")]
            if sorted(flat_p) != sorted(flat_c):
                res.fail(aspect, f"rank {r}: flat-parameter keys cpp {flat_c} vs python {flat_p}")
                continue
            if p_order != c_order and r == 0:
                res.notes.append(f"LOCAL key lists differ (not checked): python {p_order} vs "
                                 f"cpp {c_order}")
            keys = [k for k in p_order if k in ck]
        elif aspect == "OPTIM_SHARDED":  # order carries no meaning (see compare_optim_full)
            if sorted(p_order) != sorted(c_order):
                res.fail(aspect, f"rank {r}: keys cpp has {sorted(set(c_order) - set(p_order))} "
                                 f"more, python {sorted(set(p_order) - set(c_order))}")
                continue
            keys = p_order
        else:  # SHARDED, or a LOCAL request answered with the FULL dict (NO_SHARD)
            if p_order != c_order:
                res.fail(aspect, f"rank {r}: keys cpp {c_order} vs python {p_order}")
                continue
            keys = p_order
        for k in keys:
            a, b = pk[k], ck[k]
            for field in ("type", "dtype", "shape", "local", "global"):
                if a.get(field) != b.get(field):
                    res.fail(aspect, f"rank {r} {k}: {field} cpp {b.get(field)} vs python "
                                     f"{a.get(field)}")
            if res.fails[aspect]:
                continue
            names = [k] if a["type"] == "tensor" else [f"{k}#{i}" for i in range(len(a["local"]))]
            for n in names:
                if n not in pv or n not in cv:
                    res.fail(aspect, f"rank {r}: values of {n} missing")
                    continue
                if pv[n].shape != cv[n].shape:
                    res.fail(aspect, f"rank {r} {n}: value shape {tuple(cv[n].shape)} vs "
                                     f"{tuple(pv[n].shape)}")
                    continue
                if k in exact_keys or k.endswith("/step"):
                    if not torch.equal(pv[n], cv[n]):
                        res.fail(aspect, f"rank {r} {n}: differs (must be bit-identical)")
                    continue
                if tol is None:
                    res.fail(aspect, f"rank {r} {n}: no tolerance (FULL comparison failed)")
                    continue
                d, ratio = excess(cv[n], pv[n], pv[n], tol)
                worst = max(worst, d)
                if ratio > 1:
                    res.fail(aspect, f"rank {r} {n}: |cpp - python| = {d:.3g} exceeds the bound "
                                     f"(tol {tol:.3g}, or 4 ulps) by {ratio:.3g}x")
    res.numbers[f"{stem}_max"] = worst


def compare_layouts(res, py_dir, cpp_dir, world):
    """Every unit's flat-parameter layout (all strategies; reported under LOCAL)."""
    for r in range(world):
        pl = _load_json(os.path.join(py_dir, f"layout_r{r}.json"))["units"]
        cl = _load_json(os.path.join(cpp_dir, f"layout_r{r}.json"))["units"]
        if sorted(pl) != sorted(cl):
            res.fail("LOCAL", f"rank {r}: units cpp {sorted(cl)} vs python {sorted(pl)}")
            continue
        for u in pl:
            for field, pv in pl[u].items():
                cv = cl[u].get(field)
                if cv != pv:
                    res.fail("LOCAL", f"rank {r} unit '{u}' flat-parameter layout: {field} cpp "
                                      f"{cv} vs python {pv}")


def compare_case(py_dir, cpp_dir, world, single, single_order, dp, init, single_osd, dp_osd):
    res = Result()
    for d in (py_dir, cpp_dir):
        if not os.path.exists(os.path.join(d, "full.safetensors")):
            res.fail("FULL", f"no results in {d}")
            return res
    tol = compare_full(res, py_dir, cpp_dir, single, single_order, dp, init)
    exact = {"scale", "frozen.weight", "frozen.bias", "frozen._flat_param"}
    compare_described(res, "SHARDED", py_dir, cpp_dir, world, tol, exact)
    compare_described(res, "LOCAL", py_dir, cpp_dir, world, tol, exact)
    compare_layouts(res, py_dir, cpp_dir, world)
    otol = compare_optim_full(res, py_dir, cpp_dir, single_osd, dp_osd)
    compare_described(res, "OPTIM_SHARDED", py_dir, cpp_dir, world, otol, set())
    return res
