#!/usr/bin/env python3
"""Failures across two emulated hosts (scripts/emulated_hosts.py; issue 40, item 2).

Each host runs `fsdp-run --nnodes 2 --nproc-per-node 2` and fsdp-train (W=4). Checked:
  1. a rank SIGKILLed mid-run on host 1 ends both hosts' launchers within 10 s of the kill, each
     naming that rank and node;
  2. a host whose ranks fail at start-up (a bad flag), host 0 (which hosts the job's store) or
     host 1, ends the other host's launcher within 10 s, though its ranks would wait for the
     whole collective timeout (600 s), each launcher naming a rank of the failed node;
  3. a launcher killed while the job forms (--nnodes 3, the third never comes): host 0's logs the
     loss within 15 s of the kill (torchrun's keep-alive, at its defaults) and exits non-zero
     within 20 s, naming node 1 (issue 60).
Both hosts must end by themselves: the harness's own kill (--linger) counts as a failure. The
hosts have stock Debian /etc/hosts and names (emulated_hosts.py --names); the master is given by
name.

  test_host_failures.py FSDP_RUN FSDP_TRAIN       (exit 77: no namespaces here, skipped)
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

from checks import Checks

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "emulated_hosts.py")


def start_job(run, train, work, per_host_args, port):
    """Starts the 2 x 2 job; `per_host_args` maps a host index to extra fsdp-train arguments."""
    pick = " ".join('[ "$FSDP_HOST_INDEX" = %d ] && X="%s";' % (h, a)
                    for h, a in per_host_args.items())
    cmd = ("X=; %s cd %s && %s --nnodes 2 --node-rank $FSDP_HOST_INDEX --nproc-per-node 2 "
           "--master-addr $FSDP_MASTER_NAME --master-port %d --grace-period 2 %s --log-every 1 "
           "--metrics %s/m.jsonl $X" % (pick, work, run, port, train, work))
    return on_hosts(cmd)


def on_hosts(cmd):
    return subprocess.Popen([sys.executable, HOSTS, "--hosts", "2", "--names", "--linger", "20",
                             "--timeout", "180", "--", cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def collect(p):
    """The job's output, gathered on a thread so that the pipe never fills."""
    out = []
    t = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    t.start()
    return lambda: (t.join(timeout=200), out[0] if out else "")[1]


def find_pid(program, var, value):
    """The pid of the `program` process whose environment has `var`=`value` (the namespaces
    share our pids)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if program not in f.read().split(b"\0")[0]:
                    continue
            with open("/proc/%s/environ" % pid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(var) == str(value).encode() and b"FSDP_HOST_INDEX" in env:
            return int(pid)
    return None


def rank_pid(rank):
    return find_pid(b"fsdp-train", b"RANK", rank)


def lost_while_forming(run, check):
    """3. Node 1's launcher killed while the job forms: node 0 logs it and gives up in time."""
    cmd = ("%s --nnodes 3 --node-rank $FSDP_HOST_INDEX --master-addr $FSDP_MASTER_NAME "
           "--master-port 29645 --grace-period 2 --status-interval 0.5 echo started" % run)
    p = on_hosts(cmd)
    lines = []
    reader = threading.Thread(
        target=lambda: [lines.append((time.monotonic(), l)) for l in p.stdout], daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    # Node 1 has joined once node 0's line on whom the job waits for counts it.
    while time.monotonic() < deadline and not any(
            l.startswith("[h0] ") and "joined (nodes 0,1)" in l for _, l in list(lines)):
        time.sleep(0.1)
    pid = find_pid(b"fsdp-run", b"FSDP_HOST_INDEX", 1)
    if pid is None:
        p.kill()
        check(False, "node 1's launcher starts")
        return
    t0 = time.monotonic()
    os.kill(pid, 9)
    rc = p.wait(timeout=60)
    reader.join(timeout=10)
    out = "".join(l for _, l in lines)
    logged = next((t - t0 for t, l in lines if l.startswith("[h0] ") and
                   "node 1 (node1) was lost while the job formed" in l), None)
    ended = time.monotonic() - t0
    check(logged is not None and logged <= 15.5,
          "a launcher killed while the job forms: node 0 logs its loss within 15 s (%s s)"
          % ("%.1f" % logged if logged is not None else "never"), out)
    check(rc not in (0, 124) and "still running: killed" not in out and ended <= 20,
          "and exits non-zero by itself within 20 s (exit %d, %.1f s)" % (rc, ended), out)


def main():
    run, train = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    check = Checks(4000)

    work = tempfile.mkdtemp(prefix="fsdp-host-fail-")

    # 1. A rank killed mid-run on host 1.
    p = start_job(run, train, work, {0: "--steps 1000000 --timeout 60",
                                     1: "--steps 1000000 --timeout 60"}, 29641)
    output = collect(p)
    metrics = os.path.join(work, "m.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
            break
        time.sleep(0.2)
    pid = rank_pid(3)
    if p.poll() is not None or pid is None:
        out = output()
        if p.returncode == 77:
            print(out)
            return 77
        check(False, "the 2 x 2 job runs to step 3 (rank 3's pid %s)" % pid, out)
        return 1
    t0 = time.monotonic()
    os.kill(pid, 9)
    rc = p.wait(timeout=200)
    took = time.monotonic() - t0
    out = output()
    check(rc == 128 + 9, "a rank SIGKILLed on host 1: the job exits 137 (got %d)" % rc, out)
    check(took < 10 and "still running: killed" not in out,
          "both launchers ended by themselves within 10 s of the kill (%.1f s)" % took, out)
    for h in (0, 1):
        check(any(l.startswith("[h%d] fsdp-run: " % h) and
                  "rank 3 (local rank 1) on node 1 (" in l and "SIGKILL" in l
                  for l in out.splitlines()),
              "host %d's launcher names rank 3 on node 1, killed" % h, out)

    # 2. A host whose ranks fail at start-up, each host in turn.
    for bad in (0, 1):
        t0 = time.monotonic()
        p = start_job(run, train, work, {bad: "--steps 5 --no-such-flag",
                                         1 - bad: "--steps 5 --timeout 600"}, 29642 + bad)
        out = collect(p)()
        rc = p.wait(timeout=200)
        took = time.monotonic() - t0
        check(rc != 0 and took < 10 + 3 and "still running: killed" not in out,
              "host %d failing at start-up ends both hosts within 10 s (exit %d, %.1f s, "
              "namespaces included)" % (bad, rc, took), out)
        named = ") on node %d (" % bad
        for h in (0, 1):
            check(any(l.startswith("[h%d] fsdp-run: failed: rank " % h) and named in l and
                      "exited with code 2" in l for l in out.splitlines()),
                  "host %d's launcher names a rank on node %d that exited with code 2" % (h, bad),
                  out)

    lost_while_forming(run, check)
    subprocess.run(["rm", "-rf", work])
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
