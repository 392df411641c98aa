#!/usr/bin/env python3
"""Emulated hosts (issue 40): N Linux network namespaces on a bridge, a command run on each.

  scripts/emulated_hosts.py [--hosts 2] [--subnet 10.77.7] [--node-dir /tmp/fsdp-node] [--node-root D]
                            [--names] [--rate 1gbit] [--delay 1ms] [--timeout 600]
                            [--lose-host I --lose-on REGEX [--lose-dir]] -- COMMAND

Host i is a network namespace with one link, addressed SUBNET.(i+1)/24, plugged into a bridge
that lives in a namespace of its own: nothing is added to, and no address is used in, this
machine's own network. Each host sees its own empty directory at --node-dir (a bind mount in the
host's private mount namespace), so no filesystem path under it is shared between hosts, as on
separate machines. With --rate/--delay, each host's link is shaped (tc tbf/netem) where the
kernel allows it. The namespaces are removed whatever happens (an error, Ctrl-C, a timeout).

With --names, host i is also called node<i>, as on real machines: its own host name (a UTS
namespace of its own) and a stock Debian /etc/hosts (its own name on 127.0.1.1, the other hosts'
names on their addresses; `ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts).

COMMAND runs through `sh -c` on every host at once, with FSDP_HOST_INDEX, FSDP_HOST_COUNT,
FSDP_HOST_ADDR (this host's address), FSDP_MASTER_HOST (host 0's), FSDP_HOST_IFNAME (the
link's name) and, with --names, FSDP_HOST_NAME and FSDP_MASTER_NAME (node<i>, node0) set; its output is prefixed with [hI]. Exit status: 0 when every host's command
exited 0, else the first failing host's status (124 on --timeout). Once a host's command fails,
the others get --linger seconds to end on their own, then are killed (and named). With --counters, the bytes
each host's link sent and received are printed at the end (one JSON line per host).

With --lose-host I, host I is lost when a line of output (with its [hJ] prefix) first matches
--lose-on: its link goes down, then every process of its command is SIGKILLed (so no connection
is closed or reset: the others hear nothing, as from a machine that lost power), and with
--lose-dir its directory is emptied (its disk or tmpfs gone with it). "emulated_hosts: host I
lost" is printed then, and its exit does not count.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; exits 77 (skipped) without them.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), (r.stderr or r.stdout).strip()))
    return r


class Hosts:
    def __init__(self, count, subnet, tag, names=False):
        self.count, self.subnet, self.names = count, subnet, names
        self.switch = "%s-sw" % tag
        self.ns = ["%s-h%d" % (tag, i) for i in range(count)]
        self.ifname = "eth0"

    def addr(self, i):
        return "%s.%d" % (self.subnet, i + 1)

    def create(self):
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            sh("ip", "netns", "add", ns)
            port = "p%d" % i
            # Both ends are created inside the namespaces, so no link ever appears in ours.
            sh("ip", "-n", ns, "link", "add", self.ifname, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", self.addr(i) + "/24", "dev", self.ifname)
            sh("ip", "-n", ns, "link", "set", self.ifname, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.names:
                self.write_hosts(i)

    def name(self, i):
        return "node%d" % i

    def write_hosts(self, i):
        """Host i's /etc/hosts as Debian's installer writes it, plus the other hosts' names."""
        d = os.path.join("/etc/netns", self.ns[i])
        os.makedirs(d, exist_ok=True)
        others = "".join("%s\t%s\n" % (self.addr(j), self.name(j))
                         for j in range(self.count) if j != i)
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1\tlocalhost\n127.0.1.1\t%s\n\n"
                    "# The following lines are desirable for IPv6 capable hosts\n"
                    "::1     localhost ip6-localhost ip6-loopback\n"
                    "ff02::1 ip6-allnodes\nff02::2 ip6-allrouters\n%s" % (self.name(i), others))

    def shape(self, rate, delay):
        """Shapes each host's outgoing traffic; returns what could not be done (or None)."""
        for ns in self.ns:
            args = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ifname, "root"]
            if delay:
                args += ["netem", "delay", delay] + (["rate", rate] if rate else [])
            else:
                args += ["tbf", "rate", rate, "burst", "64kb", "latency", "50ms"]
            r = sh(*args, check=False)
            if r.returncode != 0:
                return "tc: " + (r.stderr or r.stdout).strip()
        return None

    def counters(self, i):
        out = {}
        for what in ("tx_bytes", "rx_bytes"):
            r = sh("ip", "netns", "exec", self.ns[i], "cat",
                   "/sys/class/net/%s/statistics/%s" % (self.ifname, what), check=False)
            out[what] = int(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
        return out

    def destroy(self):
        for ns in self.ns + [self.switch]:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)


def descendants(pid):
    """`pid` and every process below it."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    stat = f.read()
            except OSError:
                continue
            parent.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parent.get(p, []))
    return out


class Loss:
    """--lose-host: host `index` is lost at the first line matching `pattern`."""

    def __init__(self, hosts, index, pattern, own_dir):
        self.hosts, self.index, self.own_dir = hosts, index, own_dir
        self.pattern = re.compile(pattern.encode())
        self.proc, self.done, self.lock = None, False, threading.Lock()

    def see(self, line):
        if self.done or not self.pattern.search(line):
            return
        with self.lock:
            if self.done:
                return
            self.done = True
            sh("ip", "-n", self.hosts.ns[self.index], "link", "set", self.hosts.ifname, "down",
               check=False)
            # Its session first (nothing in it forks after that), then whatever left it (ranks
            # a launcher started in sessions of their own), twice for any forked in between.
            for pids in ([self.proc.pid], descendants(self.proc.pid), descendants(self.proc.pid)):
                for pid in pids:
                    try:
                        if pid == self.proc.pid:
                            os.killpg(pid, signal.SIGKILL)
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            if self.own_dir:
                for name in os.listdir(self.own_dir):
                    path = os.path.join(self.own_dir, name)
                    try:
                        if os.path.isdir(path) and not os.path.islink(path):
                            shutil.rmtree(path)
                        else:
                            os.remove(path)
                    except OSError as e:
                        print("emulated_hosts: cannot empty %s: %s" % (path, e), file=sys.stderr)
            sys.stdout.buffer.write(b"emulated_hosts: host %d lost (link down, processes killed%s)\n"
                                    % (self.index, b", directory emptied" if self.own_dir else b""))
            sys.stdout.flush()


def pump(stream, prefix, loss=None):
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.flush()
        if loss:
            loss.see(prefix + line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--subnet", default="10.77.7", help="first three octets of the addresses")
    ap.add_argument("--node-dir", default="/tmp/fsdp-node", help="each host's own directory")
    ap.add_argument("--node-root", default=None,
                    help="keep host i's directory at NODE_ROOT/h<i> (created if missing, kept "
                         "afterwards), so that a later run finds what an earlier one left on "
                         "each host's disk; default: a fresh one per run, removed at the end")
    ap.add_argument("--names", action="store_true",
                    help="name the hosts node<i>, each with a stock Debian /etc/hosts")
    ap.add_argument("--rate", default=None, help="shape each link to this rate (tc), e.g. 1gbit")
    ap.add_argument("--delay", default=None, help="and this one-way delay (tc netem), e.g. 1ms")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--linger", type=float, default=30,
                    help="seconds the other hosts may go on after one host's command failed")
    ap.add_argument("--counters", action="store_true", help="print each link's byte counters")
    ap.add_argument("--lose-host", type=int, default=None, help="the host to lose (see above)")
    ap.add_argument("--lose-on", default=None, help="when a line of output matches this regex")
    ap.add_argument("--lose-dir", action="store_true", help="and empty its directory")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd or not 1 <= a.hosts <= 250:
        ap.error("give a COMMAND after --, and 1 to 250 hosts")
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        print("emulated_hosts: needs root, iproute2 and unshare: skipped", file=sys.stderr)
        return 77
    if ((a.lose_host is None) != (a.lose_on is None) or not 0 <= (a.lose_host or 0) < a.hosts
            or (a.lose_dir and a.lose_host is None)):
        ap.error("--lose-host I (0 <= I < --hosts) and --lose-on go together (--lose-dir with them)")
    hosts = Hosts(a.hosts, a.subnet, "fsdpemu%d" % os.getpid(), a.names)
    work = tempfile.mkdtemp(prefix="fsdp-hosts-")
    procs, rc, loss = [], 0, None
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        try:
            hosts.create()
        except RuntimeError as e:
            print("emulated_hosts: cannot create the namespaces (%s): skipped" % e, file=sys.stderr)
            return 77
        if a.rate or a.delay:
            why = hosts.shape(a.rate, a.delay)
            if why:
                print("emulated_hosts: links not shaped (%s)" % why, file=sys.stderr)
        before = [hosts.counters(i) for i in range(a.hosts)]
        for i, ns in enumerate(hosts.ns):
            own = os.path.join(a.node_root or work, "h%d" % i)
            os.makedirs(own, exist_ok=bool(a.node_root))
            if i == a.lose_host:
                loss = Loss(hosts, i, a.lose_on, own if a.lose_dir else None)
            env = dict(os.environ, FSDP_HOST_INDEX=str(i), FSDP_HOST_COUNT=str(a.hosts),
                       FSDP_HOST_ADDR=hosts.addr(i), FSDP_MASTER_HOST=hosts.addr(0),
                       FSDP_HOST_IFNAME=hosts.ifname, FSDP_NODE_DIR=a.node_dir)
            if a.names:
                env.update(FSDP_HOST_NAME=hosts.name(i), FSDP_MASTER_NAME=hosts.name(0))
            # A private mount namespace per host: its own directory at --node-dir (and with
            # --names a UTS namespace: its own host name).
            inner = 'mkdir -p "$FSDP_NODE_DIR" && mount --bind "%s" "$FSDP_NODE_DIR" && %sexec sh -c "$0"' % (
                own, 'hostname "$FSDP_HOST_NAME" && ' if a.names else "")
            p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount"] +
                                 (["--uts"] if a.names else []) +
                                 ["--propagation", "private", "sh", "-c", inner, " ".join(cmd)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            if i == a.lose_host:
                loss.proc = p
            procs.append((p, None))
        # The pumps start once every host's process is known, so that a loss can always act.
        for i, (p, _) in enumerate(procs):
            t = threading.Thread(target=pump, args=(p.stdout, b"[h%d] " % i, loss), daemon=True)
            t.start()
            procs[i] = (p, t)
        deadline = time.monotonic() + a.timeout
        first = None
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                left = [i for i, (p, _) in enumerate(procs) if p.poll() is None]
                why = ("timed out after %.0f s" % a.timeout if first is None else
                       "host %d failed (exit %d), %.0f s ago" % (first[0], first[1], a.linger))
                print("emulated_hosts: %s; hosts %s still running: killed" % (why, left),
                      file=sys.stderr)
                first = first or (left[0], 124)
                break
            for i, (p, _) in enumerate(procs):
                if i == a.lose_host and loss.done:
                    continue  # lost on purpose
                if p.poll() not in (None, 0) and first is None:
                    first = (i, p.returncode)
                    deadline = min(deadline, time.monotonic() + a.linger)
            time.sleep(0.05)
        for i, (p, _) in enumerate(procs):  # those that ended between two looks
            if i == a.lose_host and loss.done:
                continue
            if first is None and p.poll() not in (None, 0):
                first = (i, p.returncode)
        rc = first[1] if first else 0
        if a.counters:
            for i in range(a.hosts):
                now = hosts.counters(i)
                print(json.dumps({"host": i, "addr": hosts.addr(i), **{
                    k: (now[k] - before[i][k]) if now[k] is not None else None for k in now}}))
        return rc
    finally:
        for p, t in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if t:
                t.join(timeout=5)
        hosts.destroy()
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
