#!/usr/bin/env python3
"""Two emulated hosts named as real machines are (scripts/emulated_hosts.py --names: each its own
host name and a stock Debian /etc/hosts, its own name on 127.0.1.1), the master given by name and
no variable set (issue 60, item 1):

  1. `fsdp-run --master-addr node0`: 2 hosts x 2 ranks train FULL_SHARD and log W=1's losses within
     twice plain data parallelism's rounding (W=4 NO_SHARD on one machine against W=1, measured in
     the same run); node0's ranks bind 10.77.7.1 on eth0, which node1 reached the store by, and no
     rank binds loopback;
  2. torchrun's spelling, `--rdzv-backend c10d --rdzv-endpoint node0:PORT` with no --node-rank: the
     same;
  3. negative control: the ranks started as torchrun starts its workers but without fsdp-run's
     choice of address (MASTER_ADDR=node0, no FSDP_NODE_ADDR): node0's ranks refuse to start,
     naming the loopback address and GLOO_SOCKET_IFNAME, instead of binding it.

  test_host_names.py FSDP_RUN FSDP_TRAIN       (exit 77: no namespaces here, skipped)
"""
import json
import os
import re
import subprocess
import sys
import tempfile

from checks import Checks

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "emulated_hosts.py")
STEPS = 4
TRAIN_ARGS = "--steps %d --log-every 1 --timeout 15" % STEPS


def on_hosts(cmd, timeout=240):
    r = subprocess.run([sys.executable, HOSTS, "--hosts", "2", "--names", "--linger", "20",
                        "--timeout", str(timeout), "--", cmd], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def worst(a, b):
    """The largest difference between two loss curves, relative to the loss."""
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def main():
    run, train = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    check = Checks(4000)
    rc, out = on_hosts("true", 30)  # no namespaces here (the chroot): skipped before any work
    if rc == 77:
        print(out)
        return 77
    work = tempfile.mkdtemp(prefix="fsdp-host-names-")

    # The yardstick, on this machine: W=1, and plain data parallelism at W=4 (NO_SHARD: whole
    # gradients all-reduced), whose difference from W=1 is summation order alone.
    for tag, nproc, sharding in (("w1", 1, "full_shard"), ("dp4", 4, "no_shard")):
        r = subprocess.run("%s --nproc-per-node %d %s %s --sharding %s --metrics %s/%s.jsonl"
                           % (run, nproc, train, TRAIN_ARGS, sharding, work, tag),
                           shell=True, capture_output=True, text=True, cwd=work)
        check(r.returncode == 0, "the %s reference runs" % tag, r.stdout + r.stderr)
        if r.returncode != 0:
            return check.exit_code()
    w1 = losses(os.path.join(work, "w1.jsonl"))
    dp = worst(losses(os.path.join(work, "dp4.jsonl")), w1)
    # Floor: one float32 rounding of the loss, so that a run where data parallelism happens to
    # round exactly as W=1 does not demand bit-equality of a different summation order.
    tol = 2 * max(dp, 6e-8)
    print("      plain data parallelism (W=4 NO_SHARD) against W=1: worst relative loss "
          "difference %.3g; bound %.3g" % (dp, tol))

    spellings = (
        ("master-addr", "--master-addr node0 --master-port 29641 --node-rank $FSDP_HOST_INDEX"),
        ("c10d", "--rdzv-backend c10d --rdzv-endpoint node0:29642 --rdzv-id names"),
    )
    for tag, rdzv in spellings:
        cmd = ("unset GLOO_SOCKET_IFNAME FSDP_GLOO_HOSTNAME; cd %s && %s --nnodes 2 "
               "--nproc-per-node 2 %s %s %s --metrics %s/%s.jsonl"
               % (work, run, rdzv, train, TRAIN_ARGS, work, tag))
        rc, out = on_hosts(cmd)
        if rc == 77:
            print(out)
            return 77
        check(rc == 0, "%s: 2 hosts x 2 ranks by name train" % tag, out)
        # (c10d numbers the nodes in order of arrival: node1 may be node 0.)
        check(re.search(r"\[h0\] .*Gloo transport on 10\.77\.7\.1 \(eth0; fsdp-run: the address "
                        r"node \d \(node1\)'s launcher reached the job's store at", out) is not None,
              "%s: node0's ranks bind 10.77.7.1 on eth0, the address node1 reached it by" % tag,
              out)
        check(re.search(r"Gloo transport on 127\.", out) is None,
              "%s: no rank binds loopback" % tag, out)
        check(re.search(r"\[h1\] \[r\d\] fsdp: rank \d: Gloo transport on 10\.77\.7\.2 \(eth0;",
                        out) is not None, "%s: node1's ranks bind 10.77.7.2 on eth0" % tag, out)
        if rc == 0:
            d = worst(losses(os.path.join(work, tag + ".jsonl")), w1)
            check(d <= tol, "%s: W=4 FULL_SHARD across hosts logs W=1's losses within twice plain "
                  "data parallelism's rounding (%.3g <= %.3g)" % (tag, d, tol))

    # Negative control: torchrun-style workers with nobody choosing their address.
    ranks = " ".join(
        "RANK=$((FSDP_HOST_INDEX * 2 + %d)) LOCAL_RANK=%d WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 "
        "MASTER_ADDR=node0 MASTER_PORT=29643 %s --steps 1 --timeout 8 & p%d=$!; " % (l, l, train, l)
        for l in (0, 1))
    rc, out = on_hosts("unset GLOO_SOCKET_IFNAME FSDP_GLOO_HOSTNAME; cd %s && %s wait $p0; a=$?; "
                       "wait $p1; exit $((a | $?))" % (work, ranks), 120)
    check(rc not in (0, 124), "without fsdp-run's address the job does not run", out)
    check(re.search(r"\[h0\] .*the job spans hosts, but MASTER_ADDR node0 resolves to 127\.0\.1\.1 "
                    r"on this host, so Gloo would bind 127\.0\.0\.1, which the other hosts cannot "
                    r"reach; set GLOO_SOCKET_IFNAME=<interface>", out) is not None,
          "node0's ranks refuse loopback, naming the address and the variable", out)
    subprocess.run(["rm", "-rf", work])
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
