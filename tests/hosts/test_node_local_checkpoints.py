#!/usr/bin/env python3
"""Checkpoints with no shared filesystem, on emulated hosts (issue 40, item 5).

Each host of scripts/emulated_hosts.py sees its own directory at $FSDP_NODE_DIR (kept across
runs with --node-root, as a machine's disk is). Checked:
  1. 2 hosts x 2 ranks train 8 steps with `fsdp-train --node-local`, saving at steps 4 and 8:
     each host's step directory holds `.metadata`, the manifest and its own ranks' data files
     only, and `fsdp-ckpt verify` passes on it, naming the files the other host holds;
  2. 3 hosts x 1 rank, the third host's disk empty, resume from step 8 and train to step 12:
     every rank resumes from step 8 (the empty host reads its pieces from the others' disks);
     the losses of steps 9-12 equal those of the same two jobs on one machine with a shared
     directory (the same arithmetic: equal to the last bit printed);
  3. `fsdp-ckpt assemble` gathers the three hosts' step_12 into one directory that verifies.

  test_node_local_checkpoints.py FSDP_RUN FSDP_TRAIN FSDP_CKPT   (exit 77: no namespaces here)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from checks import Checks

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "..", "..", "scripts", "emulated_hosts.py")
TRAIN_ARGS = "--log-every 1 --save-every 4 --timeout 30 --seed 5"


def on_hosts(run, train, hosts, nproc, node_root, work, tag, args):
    # Flat collectives, as the one-machine reference has (its hosts are one): the comparison of
    # the losses is exact, and routing by host sums in another order (docs/dist.md).
    cmd = ("cd %s && FSDP_HOST_AWARE=0 %s --nnodes %d --node-rank $FSDP_HOST_INDEX --nproc-per-node %d "
           "--master-addr $FSDP_MASTER_HOST --master-port 29651 %s %s --save-dir "
           "$FSDP_NODE_DIR/ckpt --node-local --metrics %s/%s.jsonl %s"
           % (work, run, hosts, nproc, train, TRAIN_ARGS, work, tag, args))
    r = subprocess.run([sys.executable, HOSTS, "--hosts", str(hosts), "--names",
                        "--node-root", node_root,
                        "--linger", "15", "--timeout", "240", "--", cmd],
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def on_one_machine(run, train, nproc, work, tag, args):
    cmd = [run, "--nproc-per-node", str(nproc), train] + TRAIN_ARGS.split() + [
        "--save-dir", os.path.join(work, "shared"), "--metrics",
        os.path.join(work, tag + ".jsonl")] + args.split()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return r.returncode, r.stdout + r.stderr


def losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def main():
    run, train, tool = (os.path.abspath(a) for a in sys.argv[1:4])
    check = Checks(3000)
    work = tempfile.mkdtemp(prefix="fsdp-node-local-")
    node_root = os.path.join(work, "disks")
    try:
        rc, out = on_hosts(run, train, 2, 2, node_root, work, "a", "--steps 8")
        if rc == 77:
            print(out)
            return 77
        check(rc == 0, "2 hosts x 2 ranks train 8 steps, saving node-local checkpoints", out)
        for h, own in ((0, ["__0_0.distcp", "__1_0.distcp"]), (1, ["__2_0.distcp", "__3_0.distcp"])):
            step8 = os.path.join(node_root, "h%d" % h, "ckpt", "step_8")
            names = sorted(os.listdir(step8)) if os.path.isdir(step8) else []
            check(names == [".fsdp_manifest.json", ".metadata"] + own,
                  "host %d's step_8 holds its own ranks' files only: %s" % (h, names), out)
            v = subprocess.run([tool, "verify", step8], capture_output=True, text=True)
            others = [f for f in ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
                      if f not in own]
            check(v.returncode == 0 and "not checked here: " + " ".join(others) in v.stdout,
                  "fsdp-ckpt verify passes on host %d's step_8, naming the other host's files"
                  % h, v.stdout + v.stderr)

        rc, out = on_hosts(run, train, 3, 1, node_root, work, "b", "--steps 12 --resume")
        check(rc == 0, "3 hosts x 1 rank (host 2's disk empty) resume and train to step 12", out)
        check("resumed from " in out and "at step 8 (world size 3)" in out,
              "the job resumed from step 8 at W=3", out)
        # The reference: the same two jobs on one machine, one shared directory.
        rc_a, out_a = on_one_machine(run, train, 4, work, "ref_a", "--steps 8")
        rc_b, out_b = on_one_machine(run, train, 3, work, "ref_b", "--steps 12 --resume")
        check(rc_a == 0 and rc_b == 0, "the shared-directory reference runs", out_a + out_b)
        got, want = losses(os.path.join(work, "b.jsonl")), losses(os.path.join(work, "ref_b.jsonl"))
        check(sorted(got) == [9, 10, 11, 12] and all(got[s] == want.get(s) for s in got),
              "steps 9-12 after the node-local resume: losses %s, shared directory %s"
              % (got, want))

        dirs = [os.path.join(node_root, "h%d" % h, "ckpt", "step_12") for h in range(3)]
        whole = os.path.join(work, "whole")
        a = subprocess.run([tool, "assemble", whole] + dirs, capture_output=True, text=True)
        v = subprocess.run([tool, "verify", whole], capture_output=True, text=True)
        check(a.returncode == 0 and v.returncode == 0 and "a node-local save" not in v.stdout,
              "fsdp-ckpt assemble gathers the three hosts' step_12 into one that verifies",
              a.stdout + a.stderr + v.stdout + v.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
