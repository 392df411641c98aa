#!/usr/bin/env python3
"""Bytes each strategy sends across the host boundary per training step, against the analytic
minimum (issue 40, item 4). Part of scripts/bench.sh; needs root and iproute2 (exit 77 without).

    scripts/host_traffic.py --fsdp-run B/fsdp-run --fsdp-train B/examples/fsdp-train
                            [--out measurements.jsonl] [--steps 2,6] [--hosts 2] [--nproc 2]

fsdp-train runs on emulated hosts (scripts/emulated_hosts.py: network namespaces on a bridge)
twice per strategy, for the two step counts; the difference of the bytes each host's link sent,
divided by the difference of the steps, is the traffic of one step, with start-up, rendezvous
and teardown cancelled out. The link counters count frames, so Ethernet, IP and TCP headers
(about 4-5% on full frames) are in the figure and not in the minimum.

The minimum, for H hosts of L ranks, per host and step, from what the strategy must move (G: the
bytes of one gather of every unit, R: the root unit's, from fsdp-train's "model:" line; the root
stays gathered from forward to backward, as in PyTorch), with the bandwidth-optimal bound of
(H-1)/H of the data leaving each host for an all-gather or a reduce-scatter across hosts and
twice that for an all-reduce:
  FULL_SHARD     gathers 2G - R and reduce-scatters G across all ranks:  (H-1)/H * (3G - R)
  SHARD_GRAD_OP  gathers G once, reduce-scatters G:                       (H-1)/H * 2G
  NO_SHARD       all-reduces G:                                           (H-1)/H * 2G
  HYBRID_SHARD   gathers and reduce-scatters within each host; all-reduces each rank's G/L shard
                 with its replicas on the other hosts, L ranks per host:  (H-1)/H * 2G
Loss logging adds a few bytes per step (not in the minimum).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "emulated_hosts.py")
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def minimum(strategy, hosts, gather, root):
    share = (hosts - 1) / hosts
    if strategy == "full_shard":
        return share * (3 * gather - root)
    return share * 2 * gather  # shard_grad_op, no_shard, hybrid_shard (see the docstring)


def run_job(a, strategy, steps, work):
    """One job; returns ({host: tx_bytes}, gather bytes, root bytes)."""
    cmd = ("cd %s && %s --nnodes %d --node-rank $FSDP_HOST_INDEX --nproc-per-node %d "
           "--master-addr $FSDP_MASTER_HOST --master-port 29651 %s --steps %d --sharding %s "
           "--log-every 1000000 --timeout 60" % (work, a.fsdp_run, a.hosts, a.nproc, a.fsdp_train,
                                                  steps, strategy))
    r = subprocess.run([sys.executable, HOSTS, "--hosts", str(a.hosts), "--counters", "--linger",
                        "10", "--timeout", "300", "--", cmd], capture_output=True, text=True)
    out = r.stdout + r.stderr
    if r.returncode == 77:
        print(out)
        sys.exit(77)
    if r.returncode != 0:
        raise RuntimeError("%s, %d steps failed (exit %d):\n%s" % (strategy, steps, r.returncode,
                                                                  out[-3000:]))
    sent = {}
    for line in out.splitlines():
        if line.startswith('{"host": '):
            c = json.loads(line)
            sent[c["host"]] = c["tx_bytes"]
    m = re.search(r"(\d+) bytes per gather of every unit, the root's (\d+)", out)
    if not m or len(sent) != a.hosts:
        raise RuntimeError("no counters or no model line in the output:\n" + out[-3000:])
    return sent, int(m.group(1)), int(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fsdp-run", required=True)
    ap.add_argument("--fsdp-train", required=True)
    ap.add_argument("--out", help="append one JSON line per strategy (bench.sh's measurements)")
    ap.add_argument("--steps", default="2,6")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    a.fsdp_run, a.fsdp_train = os.path.abspath(a.fsdp_run), os.path.abspath(a.fsdp_train)
    s0, s1 = (int(x) for x in a.steps.split(","))
    work = tempfile.mkdtemp(prefix="fsdp-traffic-")
    rows = []
    try:
        for strategy in STRATEGIES:
            short, gather, root = run_job(a, strategy, s0, work)
            long_, _, _ = run_job(a, strategy, s1, work)
            per_step = [(long_[h] - short[h]) / (s1 - s0) for h in range(a.hosts)]
            least = minimum(strategy, a.hosts, gather, root)
            rows.append({"bench": "host_traffic", "case": strategy, "hosts": a.hosts,
                         "nproc_per_node": a.nproc, "unit": "bytes/step", "samples": per_step,
                         "median": sorted(per_step)[len(per_step) // 2],
                         "minimum": least, "gather_bytes": gather, "root_bytes": root,
                         "run": os.environ.get("FSDP_BENCH_TAG", "host")})
            print("%-14s sent per step: %s bytes (by host); minimum %.0f; ratio %s" % (
                strategy.upper(), ", ".join("%.0f" % b for b in per_step), least,
                ", ".join("%.2f" % (b / least) for b in per_step)), flush=True)
    finally:
        subprocess.run(["rm", "-rf", work])
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
