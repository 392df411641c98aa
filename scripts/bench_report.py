#!/usr/bin/python3
"""Turns the measurements of scripts/bench.sh into the suite's records, summary table and plots.

    /usr/bin/python3 scripts/bench_report.py RESULTS_DIR

Reads RESULTS_DIR/measurements.jsonl (one JSON line per measurement, with every sample, written
by the bench programs and bench/py_training.py) and writes:
  records.json  a list of {name, value, unit, baseline_name, baseline_value, ratio, target,
                meets_target}: ratio = value / baseline_value, target a condition on the ratio
                (">= 0.9", "<= 1.05") or null where the issue sets none, meets_target true/false
                (null without a target)
  summary.md    the table (also printed)
  *.png         plots, if matplotlib is installed
Every figure is the median of interleaved rounds taken in the same run as its baseline.
"""
import json
import math
import os
import statistics
import sys
from collections import defaultdict


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


class Measurements:
    def __init__(self, rows):
        self.rows = rows

    def find(self, **kw):
        return [r for r in self.rows if all(r.get(k) == v for k, v in kw.items())]

    def median(self, **kw):
        """Median over every sample of every matching measurement (rounds of several runs)."""
        samples = [s for r in self.find(**kw) for s in r.get("samples", [])]
        return statistics.median(samples) if samples else None

    def first(self, **kw):
        rows = self.find(**kw)
        return rows[0] if rows else None

    def values(self, key, **kw):
        return sorted({r[key] for r in self.find(**kw) if key in r})


records = []


def record(name, value, unit, baseline_name, baseline_value, target=None, note=None):
    if value is None or baseline_value is None or baseline_value == 0:
        return
    ratio = value / baseline_value
    meets = None
    if target:
        op, bound = target.split()
        meets = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    r = {"name": name, "value": round(value, 6), "unit": unit, "baseline_name": baseline_name,
         "baseline_value": round(baseline_value, 6), "ratio": round(ratio, 4), "target": target,
         "meets_target": meets}
    if note:
        r["note"] = note
    records.append(r)


def mb_label(nbytes):
    # Units split W ways round down by a few bytes (1 MB at W=3 is 999996 bytes).
    return f"{nbytes / 1e6:.3g}MB"


def params_label(p):
    return f"{p / 1e6:.0f}M" if p >= 1e6 else f"{p / 1e3:.0f}K"


def fit_exponent(xs, ys):
    """Least-squares slope of log(y) against log(x)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def suffix(m, run):
    if run == "host":
        return ""
    if run == "host-heap":
        return " [glibc heap reuse]"
    row = m.first(run=run)
    return f" [LibTorch {row['libtorch']}]" if row and "libtorch" in row else f" [{run}]"


def fresh_memory(m):
    """What writing fresh memory costs here (bench_fresh_memory): no targets, the context of the
    figures that allocate what they return."""
    labels = {"4k_hot": "fresh, 4 KiB pages, just after a free",
              "huge_hot": "fresh, MADV_HUGEPAGE, just after a free",
              "4k_cold": "fresh, 4 KiB pages, after a pause",
              "huge_cold": "fresh, MADV_HUGEPAGE, after a pause"}
    for nbytes in m.values("bytes", bench="fresh_memory", run="host"):
        key = dict(bench="fresh_memory", run="host", bytes=nbytes)
        base = m.median(case="faulted", **key)
        for case, label in labels.items():
            t = m.median(case=case, **key)
            row = m.first(case=case, **key)
            record(f"machine/fresh_memory/{case}/{mb_label(nbytes)}", t * 1e3 if t else None, "ms",
                   "writing the same bytes already faulted in", base * 1e3 if base else None,
                   note=f"{label} ({row['pause_s']:g} s)" if "cold" in case and row else label)


def collectives(m):
    for run in ("host", "host-heap", "torch2"):
        sfx = suffix(m, run)
        for w in m.values("world", bench="collectives", run=run):
            for nbytes in m.values("bytes", bench="collectives", run=run, world=w):
                key = dict(bench="collectives", run=run, world=w, bytes=nbytes)
                row = m.first(**key)
                native = row.get("raw_kind") == "native"
                # Gloo's native reduce-scatter is not used (an all-reduce of a clone); older
                # records without raw_rs_kind had both collectives of one kind.
                native_rs = row.get("raw_rs_kind", row.get("raw_kind")) == "native"
                for op, fsdp_case, raw_case, raw_name in (
                        ("all_gather", "unshard", "raw_allgather",
                         "c10d _allgather_base" if native else "c10d allgather into one buffer"),
                        ("reduce_scatter", "reduce_grad", "raw_reduce_scatter",
                         "c10d _reduce_scatter_base" if native_rs
                         else "c10d alltoall_base of the same bytes")):
                    t, raw = m.median(case=fsdp_case, **key), m.median(case=raw_case, **key)
                    if not t or not raw:
                        continue
                    record(f"collectives/{op}/W{w}/{mb_label(nbytes)}{sfx}", nbytes / t / 1e9,
                           "GB/s", raw_name, nbytes / raw / 1e9, ">= 0.9")


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def training(m):
    for run in ("host", "torch2"):
        sfx = suffix(m, run)
        for w in m.values("world", bench="training", run=run, model="transformer4x128"):
            key = dict(bench="training", run=run, world=w, model="transformer4x128")
            one = m.median(case="single_process", **key)
            compute = m.median(case="compute_only", **key)
            row = m.first(**key)
            tokens = row.get("tokens", 0)
            for s in STRATEGIES:
                t = m.median(case=s, **key)
                if t is None:
                    continue
                record(f"training/{s}/step_vs_one_process/W{w}{sfx}", t * 1e3, "ms/step",
                       "one process, whole batch", one * 1e3 if one else None,
                       "<= 0.55" if w == 2 else None)
                if tokens and one:
                    record(f"training/{s}/tokens_per_s/W{w}{sfx}", tokens / t, "tokens/s",
                           "one process, whole batch", tokens / one)
                if compute:
                    record(f"training/{s}/exposed_communication/W{w}{sfx}", (t - compute) * 1e3,
                           "ms/step", "step without communication (compute_only)", compute * 1e3,
                           note="step time minus the same ranks' step with no communication")
                # What overlapping each unit's gradient reduction with the next unit's backward
                # (max_inflight_grad_reductions=1, NO_SHARD's default) changes against reducing
                # inside the post-backward hook (0, the sharded strategies' default).
                # One of the two is the strategy's default case itself.
                over_case = m.median(case=f"{s} overlapped", **key)
                hook_case = m.median(case=f"{s} reduce_in_hook", **key)
                if over_case or hook_case:
                    over, hook = over_case or t, hook_case or t
                    record(f"training/{s}/overlapped_vs_reduce_in_hook/W{w}{sfx}", over * 1e3,
                           "ms/step", "the same step reducing inside the post-backward hook",
                           hook * 1e3,
                           note="below 1: overlapping gradient reduction with backward pays")
            fs, ns = m.median(case="FULL_SHARD", **key), m.median(case="NO_SHARD", **key)
            if fs and ns:
                record(f"training/FULL_SHARD/step_vs_NO_SHARD/W{w}{sfx}", fs * 1e3, "ms/step",
                       "fsdp-cpp NO_SHARD", ns * 1e3, "<= 1.05")
            # forward_prefetch(true), off by default as in PyTorch: the headline records above
            # keep the defaults; these say what the option buys on this CPU-bound step.
            fp = m.median(case="FULL_SHARD forward_prefetch", **key)
            if fp and fs:
                record(f"training/FULL_SHARD/forward_prefetch_vs_default/W{w}{sfx}", fp * 1e3,
                       "ms/step", "fsdp-cpp FULL_SHARD, defaults", fs * 1e3,
                       note="below 1: gathering the next unit during this one's forward pays")
            if fp and ns:
                record(f"training/FULL_SHARD/forward_prefetch_vs_NO_SHARD/W{w}{sfx}", fp * 1e3,
                       "ms/step", "fsdp-cpp NO_SHARD", ns * 1e3,
                       note="FULL_SHARD with forward_prefetch(true)")
            # The peers: Python FSDP and DDP in the same run, against the same LibTorch.
            pkey = dict(bench="training_python", run=run, world=w, model="transformer4x128")
            if not m.find(**pkey):
                continue
            for s in STRATEGIES:
                t, py = m.median(case=s, **key), m.median(case=s, **pkey)
                if t and py:
                    record(f"training/{s}/step_vs_python_fsdp/W{w}{sfx}", t * 1e3, "ms/step",
                           f"PyTorch FSDP {s}", py * 1e3, "<= 0.85")
            t, ddp = m.median(case="NO_SHARD", **key), m.median(case="DDP", **pkey)
            if t and ddp:
                record(f"training/NO_SHARD/step_vs_python_ddp/W{w}{sfx}", t * 1e3, "ms/step",
                       "PyTorch DistributedDataParallel", ddp * 1e3, "<= 1.0")


def buckets(m):
    """NO_SHARD's gradient buckets (issue 42) on the models where per-unit collectives cost: many
    small units (blocks48x64) and many small parameters under one unit (params96x64), and the
    transformer: the default (25 MB buckets) against one all-reduce per unit and against DDP, the
    bucket size swept on both sides, and each strategy against Python FSDP."""
    for run in ("host", "torch2"):
        sfx = suffix(m, run)
        for model in m.values("model", bench="training", run=run):
            for w in m.values("world", bench="training", run=run, model=model):
                key = dict(bench="training", run=run, world=w, model=model)
                pkey = dict(bench="training_python", run=run, world=w, model=model)
                ns = m.median(case="NO_SHARD", **key)
                per_unit = m.median(case="NO_SHARD per_unit", **key)
                if ns and per_unit:
                    record(f"training/{model}/NO_SHARD/buckets_vs_per_unit/W{w}{sfx}", ns * 1e3,
                           "ms/step", "fsdp-cpp NO_SHARD, one all-reduce per unit",
                           per_unit * 1e3, note="bucket_cap_mb 25 (default) against 0")
                if model == "transformer4x128":
                    continue  # its headline records are training()'s
                ddp = m.median(case="DDP", **pkey)
                if ns and ddp:
                    record(f"training/{model}/NO_SHARD/step_vs_python_ddp/W{w}{sfx}", ns * 1e3,
                           "ms/step", "PyTorch DistributedDataParallel", ddp * 1e3, "<= 1.0")
                for s in STRATEGIES:
                    t, py = m.median(case=s, **key), m.median(case=s, **pkey)
                    if t and py:
                        record(f"training/{model}/{s}/step_vs_python_fsdp/W{w}{sfx}", t * 1e3,
                               "ms/step", f"PyTorch FSDP {s}", py * 1e3)
                for c in m.values("case", **key):
                    if not c.startswith("NO_SHARD bucket="):
                        continue
                    size = c.split("=")[1]
                    t, d = m.median(case=c, **key), m.median(case=f"DDP bucket={size}", **pkey)
                    if t and d:
                        record(f"training/{model}/NO_SHARD/bucket={size}_vs_ddp/W{w}{sfx}",
                               t * 1e3, "ms/step", f"DDP, bucket_cap_mb {size}", d * 1e3)


def memory(m):
    for s in STRATEGIES:
        for row in m.find(bench="scaling", run="host", case=f"step_{s}"):
            if "peak_tensor_bytes" not in row:
                continue
            record(f"memory/{s}/W{row['world']}/{params_label(row['params'])}",
                   row["peak_tensor_bytes"] / 1e6, "MB per rank",
                   "analytic bound (state/W + largest unit unsharded + activations)"
                   if s == "FULL_SHARD" else "analytic bound (whole state + activations)",
                   row["bound_bytes"] / 1e6, "<= 1.1")


def checkpoints(m):
    for run, w in [(run, w) for run in ("host", "torch2")
                   for w in m.values("world", bench="checkpoint", run=run)]:
        sfx = suffix(m, run)
        key = dict(bench="checkpoint", run=run, world=w)
        row = m.first(**key)
        nbytes = row["bytes"]
        med = lambda c: m.median(case=c, **key)  # noqa: E731
        bw = lambda t: nbytes / t / 1e6 if t else None  # noqa: E731
        record(f"checkpoint/save_bandwidth/W{w}{sfx}", bw(med("save")), "MB/s",
               "raw write+fsync of the same bytes, every rank", bw(med("raw_write_fsync")), ">= 0.8")
        record(f"checkpoint/load_bandwidth/W{w}{sfx}", bw(med("load")), "MB/s",
               "raw pread of the same bytes, every rank", bw(med("raw_read")), ">= 0.8")
        for ours, peer, label in (("save", "torch_save", "LibTorch torch::save"),
                                  ("load", "torch_load", "LibTorch torch::load"),
                                  ("save", "python_torch_save", "Python torch.save"),
                                  ("load", "python_torch_load", "Python torch.load")):
            t, p = med(ours), med(peer)
            if t and p:
                record(f"checkpoint/{ours}_vs_{peer}/W{w}{sfx}", t * 1e3, "ms",
                       f"{label} of the same state, one process", p * 1e3, "<= 0.333",
                       note="target: 3x faster than the peer")
        t, sync = med("async_save_blocked"), med("save")
        if t and sync:
            record(f"checkpoint/async_save_blocking/W{w}{sfx}", t * 1e3, "ms",
                   "synchronous checkpoint::save", sync * 1e3, "<= 0.1")
        record(f"checkpoint/export_safetensors/W{w}{sfx}", bw(med("export_safetensors")), "MB/s",
               "raw write+fsync of the same bytes, one process", bw(med("raw_write_full")))
    for row in m.find(bench="scaling", run="host", case="consolidate_full"):
        key = dict(bench="scaling", run="host", world=row["world"], params=row["params"])
        t, raw = m.median(case="consolidate_full", **key), m.median(case="raw_allgather", **key)
        if t and raw:
            record(f"checkpoint/full_consolidation/W{row['world']}/{params_label(row['params'])}",
                   t * 1e3, "ms", "c10d all-gather of the same bytes", raw * 1e3, "<= 1.3",
                   note="model + Adam state, full_state_dict on every rank")
        t, raw = m.median(case="save_sharded", **key), m.median(case="raw_write_fsync", **key)
        if t and raw:
            b = row["state_bytes"]
            record(f"checkpoint/save_model_optim_bandwidth/W{row['world']}/"
                   f"{params_label(row['params'])}", b / t / 1e6, "MB/s",
                   "raw write+fsync of the same bytes, every rank", b / raw / 1e6, ">= 0.8",
                   note="get_state_dict + checkpoint::save of a wrapped model and Adam")


def scaling(m):
    """Fitted exponents: cost ~ params^k at W=2 and per-rank cost ~ W^k at a fixed size."""
    fits = {}
    rows = m.find(bench="scaling", run="host", world=2)
    sizes = sorted({r["params"] for r in rows})
    costs = {
        "step_time": lambda p: m.median(bench="scaling", run="host", world=2, params=p,
                                        case="step_FULL_SHARD"),
        "peak_tensor_bytes": lambda p: (m.first(bench="scaling", run="host", world=2, params=p,
                                                case="step_FULL_SHARD") or {}).get(
                                                    "peak_tensor_bytes"),
        "full_consolidation_time": lambda p: m.median(bench="scaling", run="host", world=2,
                                                      params=p, case="consolidate_full"),
        "sharded_save_time": lambda p: m.median(bench="scaling", run="host", world=2, params=p,
                                                case="save_sharded"),
    }
    for name, f in costs.items():
        ys = [f(p) for p in sizes]
        k = fit_exponent(sizes, ys)
        fits[("params", name)] = (sizes, ys, k)
        if k is not None:
            record(f"scaling/{name}/exponent_vs_params/W2", k, "exponent",
                   "proportional to the parameters", 1.0,
                   note=f"log-log fit over {len(sizes)} sizes, "
                        f"{params_label(sizes[0])} to {params_label(sizes[-1])}")
    for case, ideal in (("step_FULL_SHARD", -1.0), ("step_NO_SHARD", 0.0)):
        by_w = {}
        for r in m.find(bench="scaling", run="host", case=case):
            by_w.setdefault(r["params"], {})[r["world"]] = r.get("peak_tensor_bytes")
        # The size measured at the most world sizes.
        if not by_w:
            continue
        p, ws = max(by_w.items(), key=lambda kv: len(kv[1]))
        worlds = sorted(ws)
        k = fit_exponent(worlds, [ws[w] for w in worlds])
        fits[("world", case)] = (worlds, [ws[w] for w in worlds], k, p)
        if k is not None and len(worlds) > 2:
            record(f"scaling/{case[5:]}_peak_tensor_bytes/exponent_vs_world/{params_label(p)}", k,
                   "exponent", "1/W" if ideal < 0 else "constant", ideal,
                   note=f"per-rank bytes over W={worlds[0]}..{worlds[-1]}; ratio is k / ideal")
    for case in ("unshard", "reduce_grad"):
        rows = m.find(bench="collectives", run="host", world=2, case=case)
        xs = [r["bytes"] for r in rows]
        ys = [r["median"] for r in rows]
        k = fit_exponent(xs, ys)
        if k is not None:
            record(f"scaling/{case}_time/exponent_vs_bytes/W2", k, "exponent",
                   "proportional to the bytes", 1.0)
    return fits


def host_traffic(m):
    """Bytes a host sends across the host boundary per step, per strategy, against the analytic
    minimum of scripts/host_traffic.py (issue 40: at most 1.1x)."""
    for r in m.find(bench="host_traffic"):
        name = "host traffic %s (%d hosts x %d ranks), bytes/step a host sends" % (
            r["case"].upper(), r["hosts"], r["nproc_per_node"])
        record(name, max(r["samples"]), "bytes", "analytic minimum", r["minimum"],
               target="<= 1.1")


def table():
    lines = ["| record | value | baseline | ratio | target | met |", "|---|---|---|---|---|---|"]
    for r in records:
        met = {True: "yes", False: "**no**", None: ""}[r["meets_target"]]
        lines.append(f"| {r['name']} | {r['value']:.4g} {r['unit']} | {r['baseline_value']:.4g} "
                     f"({r['baseline_name']}) | {r['ratio']:.3f} | {r['target'] or ''} | {met} |")
    with_target = [r for r in records if r["target"]]
    met = sum(1 for r in with_target if r["meets_target"])
    lines.append("")
    lines.append(f"{len(records)} records; {met} of {len(with_target)} with a target meet it.")
    return "\n".join(lines)


def plots(m, out, fits):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_report: no matplotlib, no plots")
        return []
    made = []

    # Collectives: bandwidth against unit size, fsdp solid, raw dashed, one colour per W.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (fsdp_case, raw_case, title) in zip(axes, (
            ("unshard", "raw_allgather", "unshard all-gather"),
            ("reduce_grad", "raw_reduce_scatter", "gradient reduce-scatter"))):
        for i, w in enumerate(m.values("world", bench="collectives", run="host")):
            sizes = m.values("bytes", bench="collectives", run="host", world=w)
            for case, style, label in ((fsdp_case, "-", "fsdp-cpp"), (raw_case, "--", "raw c10d")):
                ys = [s / m.median(bench="collectives", run="host", world=w, bytes=s, case=case) / 1e9
                      for s in sizes]
                ax.plot([s / 1e6 for s in sizes], ys, style, marker="o", color=f"C{i}",
                        label=f"{label} W={w}")
        ax.set_xscale("log")
        ax.set_xlabel("unit size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "collectives.png"), dpi=110)
    plt.close(fig)
    made.append("collectives.png")

    # Training: ms per step for every case, per LibTorch.
    bars = []
    for run in ("host", "torch2"):
        key = dict(bench="training", run=run, world=2)
        if not m.find(**key):
            continue
        v = m.first(**key)["libtorch"]
        for c in ("single_process", "compute_only") + STRATEGIES:
            t = m.median(case=c, **key)
            if t:
                bars.append((f"{c}\nfsdp-cpp {v}", t * 1e3, "C0" if c in STRATEGIES else "C7"))
        for c in STRATEGIES + ("DDP",):
            t = m.median(bench="training_python", run=run, world=2, case=c)
            if t:
                bars.append((f"{c}\nPython {v}", t * 1e3, "C1"))
    if bars:
        fig, ax = plt.subplots(figsize=(max(8, len(bars) * 0.8), 4))
        ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([b[0] for b in bars], fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("ms per step (W=2 unless one process)")
        ax.set_title("training step, 4-layer transformer d=128, global batch 8x32")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "training.png"), dpi=110)
        plt.close(fig)
        made.append("training.png")

    # Memory per rank against W.
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, case in enumerate(("step_FULL_SHARD", "step_NO_SHARD")):
        f = fits.get(("world", case))
        if not f:
            continue
        worlds, ys, _, p = f
        bounds = [(m.first(bench="scaling", run="host", case=case, world=w, params=p) or {}).get(
            "bound_bytes") for w in worlds]
        ax.plot(worlds, [y / 1e6 for y in ys], "-o", color=f"C{i}", label=f"{case[5:]} measured")
        ax.plot(worlds, [b / 1e6 for b in bounds], "--", color=f"C{i}", label=f"{case[5:]} bound")
        ax.set_title(f"peak tensor memory per rank, {params_label(p)} parameters + Adam")
    ax.set_xlabel("world size W")
    ax.set_ylabel("MB per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)
    plt.close(fig)
    made.append("memory.png")

    # Checkpoint bandwidth per case, one bar per run (LibTorch of the host, 2.6 in the chroot,
    # where the Python peer runs when the host's python3 has no torch).
    runs = [r for r in ("host", "torch2") if m.find(bench="checkpoint", run=r, world=2)]
    if runs:
        nbytes = m.first(bench="checkpoint", run=runs[0], world=2)["bytes"]
        cases = [("raw_write_fsync", "raw write+fsync"), ("save", "checkpoint::save"),
                 ("torch_save", "torch::save"), ("python_torch_save", "Python torch.save"),
                 ("raw_read", "raw pread"), ("load", "checkpoint::load"),
                 ("torch_load", "torch::load"), ("python_torch_load", "Python torch.load")]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(runs)
        for k, run in enumerate(runs):
            key = dict(bench="checkpoint", run=run, world=2)
            xs, ys = [], []
            for i, (c, _) in enumerate(cases):
                t = m.median(case=c, **key)
                if t:
                    xs.append(i + (k - (len(runs) - 1) / 2) * width)
                    ys.append(nbytes / t / 1e6)
            ax.bar(xs, ys, width, label="LibTorch " + m.first(**key).get("libtorch", run))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([l for _, l in cases], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MB/s")
        ax.legend(fontsize=8)
        ax.set_title(f"checkpoint of {nbytes / 1e6:.0f} MB at W=2 (peers: one process)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "checkpoint.png"), dpi=110)
        plt.close(fig)
        made.append("checkpoint.png")

    # Scaling with parameters, log-log, with the fitted exponents.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(("step_time", "full_consolidation_time", "sharded_save_time")):
        f = fits.get(("params", name))
        if not f or f[2] is None:
            continue
        xs, ys, k = f
        ax.plot(xs, [y * 1e3 if y else None for y in ys], "-o", color=f"C{i}",
                label=f"{name} (k={k:.2f})")
    f = fits.get(("params", "peak_tensor_bytes"))
    if f and f[2] is not None:
        ax2 = ax.twinx()
        ax2.plot(f[0], [y / 1e6 for y in f[1]], ":s", color="C3", label=f"peak MB/rank (k={f[2]:.2f})")
        ax2.set_yscale("log")
        ax2.set_ylabel("peak tensor MB per rank")
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("ms")
    ax.set_title("cost against model size at W=2 (cost ~ params^k)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=110)
    plt.close(fig)
    made.append("scaling.png")
    return made


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    out = sys.argv[1]
    m = Measurements(load(os.path.join(out, "measurements.jsonl")))
    fresh_memory(m)
    collectives(m)
    training(m)
    buckets(m)
    memory(m)
    checkpoints(m)
    host_traffic(m)
    fits = scaling(m)
    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump(records, f, indent=1)
    t = table()
    machine = {}
    if os.path.exists(os.path.join(out, "machine.json")):
        machine = json.load(open(os.path.join(out, "machine.json")))
    made = plots(m, out, fits)
    head = (f"# fsdp-cpp benchmark summary\n\n`{machine.get('command', 'scripts/bench.sh')}` at "
            f"{machine.get('commit', '?')} on {machine.get('cores', '?')} cores "
            f"({machine.get('cpu', '?')}), {machine.get('memory', '?')}, {machine.get('os', '?')}"
            f", {machine.get('seconds', '?')} s.\n")
    if machine.get("free_page_reporting"):
        head += ("\nThis machine reports freed memory to its hypervisor (virtio-balloon free page "
                 "reporting): memory freed and touched again seconds later costs a fault on the "
                 "host, which makes the figures that allocate fresh memory (consolidation, large "
                 "unshards and reductions) slower and more variable than on bare metal "
                 "(docs/performance.md, \"Fresh memory\").\n")
    if machine.get("note"):
        head += f"\nNote: {machine['note']}\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(head + "\n" + t + "\n\n" + "".join(f"![{p}]({p})\n" for p in made))
    print()
    print(t)
    print(f"\nrecords: {os.path.join(out, 'records.json')}; plots: {', '.join(made) or 'none'}")


if __name__ == "__main__":
    main()
