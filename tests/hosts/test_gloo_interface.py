#!/usr/bin/env python3
"""Two emulated hosts (scripts/emulated_hosts.py), one fsdp-train rank each (issue 40, item 1).

On a stock Debian /etc/hosts the host's name resolves to loopback, so Gloo's default device
cannot be reached from another host. Checked:
  1. with no variable set, the job runs: each host logs the address it chose (the route to the
     master) and the W=2 losses equal a W=1 run's within the data-parallel tolerance; so do
     2 hosts x 2 ranks under every strategy (the bytes host 0 sent are printed);
  2. GLOO_SOCKET_IFNAME=eth0 (what PyTorch users set) runs too, and says so;
  3. negative control: FSDP_GLOO_HOSTNAME=127.0.0.1 (Gloo's old default here) fails within the
     timeout, with an error naming that address and the variables that choose another.

  test_gloo_interface.py FSDP_RUN FSDP_TRAIN       (exit 77: no namespaces here, skipped)
"""
import json
import os
import subprocess
import sys
import tempfile

from checks import Checks

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "emulated_hosts.py")


def job(run, train, env_line, work, tag, timeout=120, nproc=1, args=""):
    cmd = ("%s cd %s && %s --nnodes 2 --node-rank $FSDP_HOST_INDEX --nproc-per-node %d "
           "--master-addr $FSDP_MASTER_HOST --master-port 29631 %s --steps 3 --log-every 1 "
           "--timeout 8 --metrics %s/%s.jsonl %s" % (env_line, work, run, nproc, train, work, tag,
                                                     args))
    # Stock Debian /etc/hosts on each host (--names); the master given by address here
    # (test_host_names.py gives it by name).
    r = subprocess.run([sys.executable, HOSTS, "--hosts", "2", "--names", "--linger", "15",
                        "--counters",
                        "--timeout", str(timeout), "--", cmd],
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def sent_by_host0(out):
    """Bytes host 0's link sent during the job (emulated_hosts.py --counters)."""
    for line in out.splitlines():
        if line.startswith('{"host": 0'):
            return json.loads(line)["tx_bytes"]
    return None


def losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def main():
    run, train = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    check = Checks(3000)

    # The work directory is shared by the two hosts' rank 0 (only host 0's rank 0 writes metrics);
    # --node-dir keeps /tmp/fsdp-node per host, which this test does not need.
    work = tempfile.mkdtemp(prefix="fsdp-gloo-if-")
    rc, out = job(run, train, "unset GLOO_SOCKET_IFNAME FSDP_GLOO_HOSTNAME;", work, "auto")
    if rc == 77:
        print(out)
        return 77
    check(rc == 0, "no variable set: the 2-host job runs", out)
    check("Gloo transport on 10.77.7.2 (eth0; fsdp-run: the route to the job's store at "
          "10.77.7.1 (10.77.7.1))" in out,
          "host 1 says it chose 10.77.7.2 by the route to the master", out)
    ref = subprocess.run([run, "--nproc-per-node", "1", train, "--steps", "3", "--log-every", "1",
                          "--metrics", os.path.join(work, "w1.jsonl")],
                         capture_output=True, text=True, cwd=work)
    check(ref.returncode == 0, "the W=1 reference runs", ref.stdout + ref.stderr)
    if rc == 0 and ref.returncode == 0:
        a, b = losses(os.path.join(work, "auto.jsonl")), losses(os.path.join(work, "w1.jsonl"))
        check(sorted(a) == [1, 2, 3] and all(abs(a[s] - b[s]) <= 1e-4 * abs(b[s]) for s in b),
              "W=2 across hosts logs W=1's losses (%s vs %s)" % (a, b))

    # Every strategy on 2 hosts x 2 ranks (HYBRID_SHARD: one shard group per host) logs W=1's
    # losses; the bytes host 0 sent across the boundary are printed (docs/dist.md).
    for strategy in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard"):
        rc, out = job(run, train, "unset GLOO_SOCKET_IFNAME FSDP_GLOO_HOSTNAME;", work, strategy,
                      240, 2, "--sharding " + strategy)
        check(rc == 0, "%s on 2 hosts x 2 ranks runs" % strategy, out)
        # With no variable set, the default group's collectives go by host (docs/dist.md).
        check("collectives routed by host: 2 hosts x 2 ranks" in out,
              "%s: the collectives are routed by host" % strategy, out)
        if rc == 0:
            a = losses(os.path.join(work, strategy + ".jsonl"))
            b = losses(os.path.join(work, "w1.jsonl"))
            check(sorted(a) == [1, 2, 3] and all(abs(a[s] - b[s]) <= 1e-4 * abs(b[s]) for s in b),
                  "%s: W=4 across hosts logs W=1's losses" % strategy, out)
            print("      %s: host 0 sent %s bytes in 3 steps" % (strategy, sent_by_host0(out)))

    rc, out = job(run, train, "export GLOO_SOCKET_IFNAME=eth0;", work, "ifname")
    check(rc == 0, "GLOO_SOCKET_IFNAME=eth0: the job runs", out)
    check("Gloo transport on interface eth0 (GLOO_SOCKET_IFNAME)" in out,
          "and each host says it used the interface", out)

    rc, out = job(run, train, "export FSDP_GLOO_HOSTNAME=127.0.0.1;", work, "loopback", 60)
    check(rc != 0 and rc != 124, "FSDP_GLOO_HOSTNAME=127.0.0.1 fails, within the timeout", out)
    check("127.0.0.1 (lo; FSDP_GLOO_HOSTNAME)" in out and "GLOO_SOCKET_IFNAME=<interface>" in out,
          "with an error naming the address, what chose it and how to choose another", out)
    subprocess.run(["rm", "-rf", work])
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
