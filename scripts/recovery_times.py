#!/usr/bin/env python3
"""How long an elastic job takes to recover, and how many steps it loses (issue 41, item 5).

Starts N fsdp-run launchers on loopback, as N hosts of one rank each (`--nnodes N-1:N`), running
fsdp-train with disk checkpoints every --save-every steps, and injects one failure on the last
node once node 0 has logged step --at-step:

  rank   SIGKILL of its rank: every node restarts, at the same world size;
  host   SIGKILL of its launcher and rank (a crashed host: the kernel resets its connections);
  hang   SIGSTOP of its launcher and rank (a hung or unplugged host: nothing is reset; the others
         notice by the launcher's heartbeat, or by a collective's timeout).

With --mem-every K, fsdp-train also keeps in-memory checkpoints every K steps (--mem-dir, one
directory per node under /dev/shm, standing for its tmpfs; each host's files are copied to the
next host); a killed host's directory is removed with it, as its memory would be.

With --emulated-hosts, each node's launcher runs in a network namespace of its own
(scripts/emulated_hosts.py: N hosts on a bridge, addresses only inside them; root and iproute2,
else exit 77), the job's traffic crossing real links; there the case "host" also takes the
host's link down before the SIGKILL (a host that lost power: nothing is reset, the others hear
nothing), and "hang" stops it with its link still up.

With --overhead K,K,..., no failure is injected: the same job runs uninterrupted with in-memory
checkpoints every K steps (0: none), --repeats times in turn, and the median step time of each
(between node 0's step lines, the first 3 steps left out) is reported against the first K's.

From node 0's output, timed as it arrives, it reports: the time from the failure to the job's
first step after it (recovery), split into detection (until node 0's launcher says it is
stopping its ranks), the restart (until the round formed) and the resume (until the first step),
the steps lost (the steps logged before the failure that had to be redone), and the time until
the job is back where it was (its first step past the last one logged before the failure). Each
case is one run; the final step must be reached.

    scripts/recovery_times.py [--build build] [--nodes 3] [--cases rank,host,hang]
                              [--mem-every K] [--overhead 0,1,10 --repeats 3] [--json F]

Needs only Python's standard library and the built fsdp-run and fsdp-train.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid):
    """The processes whose parent is `pid` (the launcher's ranks)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return out


class Node:
    """One launcher; its output lines, each with the monotonic time it arrived."""

    def __init__(self, index, cmd, cwd, env):
        self.index, self.lines = index, []
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern, after=0.0):
        for t, line in list(self.lines):
            if t >= after and re.search(pattern, line):
                return t, line
        return None


def start_nodes(a, work, memroot, mem_every, extra):
    """The job's launchers, one per node, in `work`; in-memory checkpoints in `memroot`. With
    a.hosts (emulated hosts), node i runs in host i's network namespace."""
    port = str(free_port()) if not a.hosts else "29652"
    master = a.hosts.addr(0) if a.hosts else "127.0.0.1"
    n = a.nodes
    train = [os.path.join(a.build, "examples", "fsdp-train"), "--steps", str(a.steps),
             "--save-every", str(a.save_every), "--log-every", "1", "--save-dir", "ck",
             "--resume"] + a.train.split() + extra
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = []
    for i in range(n):
        mem = (["--mem-dir", os.path.join(memroot, "mem%d" % i), "--mem-every", str(mem_every)]
               if mem_every else [])
        cmd = [os.path.join(a.build, "fsdp-run"), "--nnodes", "%d:%d" % (n - 1, n),
               "--node-rank", str(i), "--master-addr", master, "--master-port", port,
               "--max-restarts", "1", "--heartbeat-timeout", str(a.heartbeat_timeout),
               "--last-call-timeout", str(a.last_call_timeout), "--grace-period", "2"] + train + mem
        if a.hosts:
            cmd = ["ip", "netns", "exec", a.hosts.ns[i]] + cmd  # exec: the same pid
        nodes.append(Node(i, cmd, work, env))
    return nodes


def shm_dir(prefix):
    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def overhead(a, mem_every):
    """The uninterrupted job with in-memory checkpoints every `mem_every` steps: whether it ended
    well, its median step time (s; between node 0's step lines, the first 3 steps left out) and
    the state in MB that rank 0 says it keeps."""
    work, memroot = tempfile.mkdtemp(prefix="fsdp_overhead_"), shm_dir("fsdp_mem_")
    nodes = start_nodes(a, work, memroot, mem_every, [])
    try:
        for node in nodes:
            node.proc.wait(timeout=600)
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memroot, ignore_errors=True)
    node0 = list(nodes[0].lines)
    ok = all(node.proc.returncode == 0 for node in nodes)
    at, state_mb = {}, None
    for t, line in node0:
        m = re.search(r"\] step (\d+)/", line)
        if m:
            at[int(m.group(1))] = t
        m = re.search(r"([0-9.]+) MB of state on rank 0", line)
        if m:
            state_mb = float(m.group(1))
    steps = sorted(at[s] - at[s - 1] for s in at if s > 3 and s - 1 in at)
    return ok and bool(steps), steps[len(steps) // 2] if steps else float("nan"), state_mb


def run_case(a, case):
    work, memroot = tempfile.mkdtemp(prefix="fsdp_recovery_"), shm_dir("fsdp_mem_")
    n = a.nodes
    nodes = start_nodes(a, work, memroot, a.mem_every, [])
    n0, victim = nodes[0], nodes[-1]
    deadline = time.monotonic() + 300
    step_re = r"\] step (\d+)/"
    while not n0.first(r"\] step %d/" % a.at_step) and time.monotonic() < deadline:
        time.sleep(0.005)
    steps_before = [int(re.search(step_re, l).group(1)) for _, l in n0.lines
                    if re.search(step_re, l)]
    ranks = children(victim.proc.pid)
    t_fail = time.monotonic()
    if case == "rank":
        for r in ranks:
            os.kill(r, signal.SIGKILL)
    elif case == "host":
        if a.hosts:  # power lost: the link first, so that no connection is closed or reset
            subprocess.run(["ip", "-n", a.hosts.ns[-1], "link", "set", a.hosts.ifname, "down"],
                           check=True)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        for r in ranks:
            os.kill(r, signal.SIGKILL)
    else:  # hang
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        for r in ranks:
            os.kill(r, signal.SIGSTOP)
    if case != "rank":  # the host's memory goes with it
        shutil.rmtree(os.path.join(memroot, "mem%d" % (n - 1)), ignore_errors=True)
    last_before = max(steps_before) if steps_before else 0
    survivors = nodes if case == "rank" else nodes[:-1]
    for node in survivors:
        try:
            node.proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
    if a.hosts and case == "host":  # the next case's host comes back with its link
        subprocess.run(["ip", "-n", a.hosts.ns[-1], "link", "set", a.hosts.ifname, "up"],
                       check=True)
    if case != "rank":
        try:
            os.killpg(victim.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for r in ranks:
            try:
                os.kill(r, signal.SIGKILL)
            except ProcessLookupError:
                pass
    result = {"case": case, "nodes": n, "emulated_hosts": bool(a.hosts),
              "save_every": a.save_every, "mem_every": a.mem_every,
              "failed_after_step": last_before,
              "exit_codes": [node.proc.returncode for node in survivors]}
    detect = n0.first(r"^fsdp-run: .*stopping th", t_fail)
    formed = n0.first(r"^fsdp-run: round 1 formed", t_fail)
    resumed = n0.first(r"\] resumed from .* at step (\d+) \(world size (\d+)\)", t_fail)
    if resumed:
        m = re.search(r"at step (\d+) \(world size (\d+)\)", resumed[1])
        at, world = int(m.group(1)), int(m.group(2))
        first = n0.first(r"\] step %d/" % (at + 1), t_fail)
        result.update({"resumed_at_step": at, "world_size_after": world,
                       "steps_lost": last_before - at})
        if first:
            result["recovery_s"] = round(first[0] - t_fail, 2)
            result["resume_s"] = round(first[0] - (formed or resumed)[0], 2)
        # Progress regained: the first step the failure kept the job from (the redone steps
        # included).
        back = n0.first(r"\] step %d/" % (last_before + 1), t_fail)
        if back:
            result["regained_s"] = round(back[0] - t_fail, 2)
    if detect:
        result["detection_s"] = round(detect[0] - t_fail, 2)
    if detect and formed:
        result["restart_s"] = round(formed[0] - detect[0], 2)
    result["finished"] = bool(n0.first(r"\] step %d/%d" % (a.steps, a.steps)))
    if not result["finished"] or "recovery_s" not in result:
        result["log_tail"] = [l for _, l in n0.lines[-15:]]
        if os.environ.get("RECOVERY_DUMP"):
            open(os.environ["RECOVERY_DUMP"], "w").write("\n".join(l for _, l in n0.lines))
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(memroot, ignore_errors=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--cases", default="rank,host,hang")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--at-step", type=int, default=17)
    ap.add_argument("--mem-every", type=int, default=0,
                    help="in-memory checkpoints every K steps (0: none)")
    ap.add_argument("--heartbeat-timeout", type=float, default=5)
    ap.add_argument("--last-call-timeout", type=float, default=2)
    ap.add_argument("--train", default="", help="more fsdp-train arguments (the model's size)")
    ap.add_argument("--overhead", default=None, help="K,K,...: step times, no failure")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--emulated-hosts", action="store_true",
                    help="each node in a network namespace of its own (root, iproute2)")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    a.hosts = None
    if a.emulated_hosts:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import emulated_hosts
        if os.geteuid() != 0 or not shutil.which("ip"):
            print("recovery_times: --emulated-hosts needs root and iproute2")
            return 77
        a.hosts = emulated_hosts.Hosts(a.nodes, "10.77.9", "fsdprec%d" % os.getpid())
        try:
            a.hosts.create()
            return run(a)
        finally:
            a.hosts.destroy()
    return run(a)


def run(a):
    if a.overhead:
        ks = [int(k) for k in a.overhead.split(",")]
        times, state_mb, ok = {k: [] for k in ks}, None, True
        for _ in range(a.repeats):
            for k in ks:
                good, t, mb = overhead(a, k)
                ok, state_mb = ok and good, mb or state_mb
                times[k].append(t)
        base = sorted(times[ks[0]])[a.repeats // 2]
        out = {"nodes": a.nodes, "train": a.train, "state_mb_rank0": state_mb,
               "median_step_ms": {k: round(1000 * sorted(v)[a.repeats // 2], 2)
                                  for k, v in times.items()}}
        out["ratio_to_%d" % ks[0]] = {k: round(sorted(v)[a.repeats // 2] / base, 3)
                                      for k, v in times.items()}
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                f.write(json.dumps(out) + "\n")
        return 0 if ok else 1
    results = []
    for case in a.cases.split(","):
        r = run_case(a, case)
        r.update({"heartbeat_timeout_s": a.heartbeat_timeout,
                  "last_call_timeout_s": a.last_call_timeout})
        print(json.dumps(r), flush=True)
        results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0 if all(r["finished"] and "recovery_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
