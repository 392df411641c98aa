#!/usr/bin/env python3
"""A lost host on emulated hosts, recovered from disk or from the in-memory copies (issue 41).

Three hosts of scripts/emulated_hosts.py, one rank each, run `fsdp-run --nnodes 2:3
--max-restarts 1` and fsdp-train with a disk checkpoint every 10 steps in a directory every host
sees (shared storage) and, in the second run, in-memory checkpoints every step in each host's own
directory (--mem-dir $FSDP_NODE_DIR/mem: its tmpfs, with a copy on the next host). When host 0
logs step 17, host 2 is lost: its link goes down, its processes are killed (the others hear
nothing until its launcher's heartbeat times out) and its directory is emptied. Checked, each run:
  1. hosts 0 and 1 go on at world size 2 and finish all 24 steps (from disk, the exported weights
     equal those of an uninterrupted W=2 run resumed from the same step_10, byte for byte);
  2. from disk: the resume is from step 10; from memory: from a step after 10, so fewer steps are
     redone than the disk checkpoint's interval;
  3. from memory too, the final weights equal, byte for byte, those of a run without a failure
     that does what the recovered job did: W=3 to the step it resumed from, a disk checkpoint
     there, then W=2 to the end (issue 62, item 5: the resume from the copies restored the exact
     state, not just a plausible one).
Printed, each run: the time from the loss to the first step after it, and the steps redone.

  test_lost_host_recovery.py FSDP_RUN FSDP_TRAIN     (exit 77: no namespaces here, skipped)
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from checks import Checks

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "emulated_hosts.py")
STEPS = 24
TRAIN = "--steps %d --log-every 1 --save-every 10 --resume --timeout 30 --seed 3" % STEPS


def run_job(run, train, work, tag, mem):
    """The job with host 2 lost at step 17; its output lines, each with the time it arrived."""
    extra = " --mem-dir $FSDP_NODE_DIR/mem" if mem else ""
    cmd = ("cd %s && %s --nnodes 2:3 --node-rank $FSDP_HOST_INDEX --master-addr $FSDP_MASTER_NAME "
           "--master-port 29661 --max-restarts 1 --heartbeat-timeout 3 --last-call-timeout 1 "
           "--grace-period 2 %s %s --save-dir %s/ck_%s --export %s/%s.pt%s"
           % (work, run, train, TRAIN, work, tag, work, tag, extra))
    p = subprocess.Popen([sys.executable, HOSTS, "--hosts", "3", "--names", "--linger", "30",
                          "--timeout",
                          "240", "--lose-host", "2", "--lose-on", r"^\[h0\] \[r0\] step 17/",
                          "--lose-dir", "--", cmd],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(
        target=lambda: [lines.append((time.monotonic(), l.rstrip("\n"))) for l in p.stdout],
        daemon=True)
    reader.start()
    rc = p.wait(timeout=300)
    reader.join(timeout=10)
    return rc, lines


def figures(lines):
    """Steps redone and the seconds from the loss to host 0's first step after the resume."""
    lost = next((t for t, l in lines if l.startswith("emulated_hosts: host 2 lost")), None)
    before = [int(m.group(1)) for t, l in lines if lost and t <= lost
              for m in [re.match(r"\[h0\] \[r0\] step (\d+)/", l)] if m]
    resumed = next((re.search(r"resumed from (\S+) at step (\d+) \(world size (\d+)\)", l)
                    for t, l in lines if lost and t > lost and l.startswith("[h0] [r0] resumed")),
                   None)
    if not lost or not resumed:
        return None
    at = int(resumed.group(2))
    first = next((t for t, l in lines
                  if t > lost and l.startswith("[h0] [r0] step %d/" % (at + 1))), None)
    return {"from": resumed.group(1), "resumed_at_step": at, "world_size": int(resumed.group(3)),
            "steps_redone": max(before) - at if before else None,
            "recovery_s": round(first - lost, 2) if first else None}


def same_as_replayed(run, train, work, at, check):
    """3. The memory run's weights against W=3 to step `at`, saved there, then W=2 to the end."""
    ref = os.path.join(work, "ref_mem")
    first = TRAIN.replace("--steps %d" % STEPS, "--steps %d" % at).replace(
        "--save-every 10", "--save-every %d" % at).replace("--resume", "")
    r1 = subprocess.run([run, "--nproc-per-node", "3", train] + first.split() + ["--save-dir", ref],
                        capture_output=True, text=True, timeout=240)
    r2 = subprocess.run([run, "--nproc-per-node", "2", train] + TRAIN.split() +
                        ["--save-dir", ref, "--export", os.path.join(work, "ref_mem.pt")],
                        capture_output=True, text=True, timeout=240)
    same = subprocess.run(["cmp", os.path.join(work, "ref_mem.pt"),
                           os.path.join(work, "memory.pt")], capture_output=True)
    check(r1.returncode == 0 and r2.returncode == 0 and same.returncode == 0,
          "memory: the final weights equal those of W=3 to step %d then W=2 to the end, byte for "
          "byte" % at, r1.stdout + r1.stderr + r2.stdout + r2.stderr)


def main():
    run, train = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    check = Checks(5000)
    work = tempfile.mkdtemp(prefix="fsdp-lost-host-")
    results = {}
    try:
        for tag, mem in (("disk", False), ("memory", True)):
            rc, lines = run_job(run, train, work, tag, mem)
            out = "\n".join(l for _, l in lines)
            if rc == 77:
                print(out)
                return 77
            f = figures(lines)
            results[tag] = f
            check(rc == 0 and f is not None and f["world_size"] == 2 and
                  ("[h0] [r0] step %d/%d" % (STEPS, STEPS)) in out,
                  "%s: host 2 lost at step 17; hosts 0 and 1 resume at W=2 and finish (%s)"
                  % (tag, json.dumps(f)), out)
            if f is None:
                continue
            if mem:
                check("/mem/step_" in f["from"] and f["resumed_at_step"] > 10 and
                      f["steps_redone"] is not None and f["steps_redone"] < 10,
                      "memory: resumed from the in-memory copies, redoing fewer steps than the "
                      "disk interval (10)", out)
                same_as_replayed(run, train, work, f["resumed_at_step"], check)
            else:
                check(f["from"].endswith("ck_disk/step_10"), "disk: resumed from step 10", out)
            # The reference for the disk run: W=2 from the same step_10, uninterrupted.
            if not mem:
                os.makedirs(os.path.join(work, "ref"))
                shutil.copytree(os.path.join(work, "ck_disk", "step_10"),
                                os.path.join(work, "ref", "step_10"))
                ref = subprocess.run(
                    [run, "--nproc-per-node", "2", train] + TRAIN.split() +
                    ["--save-dir", os.path.join(work, "ref"), "--export",
                     os.path.join(work, "ref.pt")],
                    capture_output=True, text=True, timeout=240)
                same = subprocess.run(["cmp", os.path.join(work, "ref.pt"),
                                       os.path.join(work, "disk.pt")], capture_output=True)
                check(ref.returncode == 0 and same.returncode == 0,
                      "disk: the final weights equal those of W=2 resumed from the same step_10, "
                      "byte for byte", ref.stdout + ref.stderr)
        print("figures: " + json.dumps(results), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
