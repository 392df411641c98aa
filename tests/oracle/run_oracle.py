#!/usr/bin/env python3
"""Python FSDP as the oracle for fsdp-cpp (issue 8). Driver: generates the inputs, computes the
one-process references, runs Python FSDP and fsdp-cpp (tests/oracle/oracle_fsdp.cpp) at each world size
for every strategy and use_orig_params setting, compares them (compare.py), then runs the negative
controls, which must make the comparison fail.

    python3 tests/oracle/run_oracle.py --binary build-trixie/tests/oracle_fsdp --work DIR

Exit status 0 only if every case passes and every negative control is caught. Needs torch >= 2
with torch.distributed.fsdp and safetensors (the trixie chroot: scripts/torch2-env.sh) and
USE_LIBUV=0 where PyTorch was built without libuv (Debian).
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import torch  # noqa: E402

import compare  # noqa: E402
import fsdp_oracle  # noqa: E402

# Every strategy with flat and original parameters; and two with every Block's activations
# checkpointed (":ac": Python's apply_activation_checkpointing against fsdp-cpp's, issue 64),
# compared with the same references and bounds: checkpointing changes no arithmetic.
CASES = ([f"{s}:{o}" for s in fsdp_oracle.STRATEGIES for o in (0, 1)] +
         ["FULL_SHARD:0:ac", "SHARD_GRAD_OP:1:ac"])


def case_dir(world, spec):
    s, o, *ac = spec.split(":")
    return f"W{world}_{s}_{'orig' if o == '1' else 'flat'}" + ("_ac" if ac else "")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(what, cmd, world, timeout, log_dir, finished=None):
    """Runs `cmd` as `world` ranks with torchrun's environment, each rank's output in
    log_dir/<what>.rank<r>.log. Raises with every rank's output if a rank fails (the others get
    a few seconds, then are killed: they would wait on the dead peer until the collective
    timeout) or the run exceeds `timeout` seconds.

    `finished(rank)`, where given, names the file a rank writes once all its results are written
    and every rank has passed the last barrier. A rank that exits with an error after writing it
    failed in its own teardown, not in what is compared: that is reported and returned (a list
    of lines), not raised. Only the Python peer gets this leniency (PyTorch 2.6's Gloo group
    has been seen to abort in `std::terminate` at exit, or to hang there, one run in many; a rank
    still running 20 s after every rank finished is killed); fsdp-cpp's own ranks
    must exit cleanly."""
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   USE_LIBUV="0", OMP_NUM_THREADS="1")
        logs.append(os.path.join(log_dir, f"{what.replace(' ', '_')}.rank{r}.log"))
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    first_failure, all_finished, why = None, None, ""
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = now
        # Every rank has written all its results: one still running after 20 s hangs in its
        # teardown (PyTorch 2.6's Gloo group, seen once in a fresh-machine run: 4 minutes in a
        # futex after its last write). It is killed and counts as torn down, as a crash there does.
        if (all_finished is None and finished is not None
                and all(os.path.exists(finished(r)) for r in range(world))):
            all_finished = now
        hung = all_finished is not None and now > all_finished + 20
        if now > deadline or hung or (first_failure is not None and now > first_failure + 10):
            cause = "timeout" if now > deadline else "hung in teardown" if hung else "a peer failed"
            why = f" (killed: {cause})"
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    # A rank killed because a peer crashed in teardown counts as torn down too, if it finished.
    torn = [r for r, p in enumerate(procs)
            if p.returncode != 0 and finished is not None and os.path.exists(finished(r))]
    timed_out = why and "timeout" in why
    if timed_out or any(p.returncode != 0 and r not in torn for r, p in enumerate(procs)):
        text = "\n".join(f"--- {what} rank {r} (exit {p.returncode}):\n{open(log).read()[-4000:]}"
                         for r, (p, log) in enumerate(zip(procs, logs)))
        raise RuntimeError(f"{what} failed{why}:\n{text}")
    notes = []
    for r in torn:
        last = (open(logs[r]).read().strip().splitlines() or ["(no output)"])[-1]
        notes.append(f"{what} rank {r} exited {procs[r].returncode} after finishing its work, "
                     f"a crash or hang in the peer's teardown, not a difference ({logs[r]}: {last})")
    return notes


def run_python(data, out, world, cases, timeout):
    """Python FSDP at `world` ranks; returns the lines about ranks that crashed in teardown."""
    logs = os.path.join(out, "logs")
    return launch(f"python W{world}",
                  [sys.executable, "-B", os.path.join(HERE, "fsdp_oracle.py"), "worker", data,
                   out] + cases,
                  world, timeout, logs,
                  finished=lambda r: fsdp_oracle.finished_marker(out, world, r))


def run_cpp(binary, data, out, world, cases, timeout, fault=None):
    cmd = [binary, "--data", data, "--out", out] + (["--fault", fault] if fault else []) + cases
    launch(f"fsdp-cpp W{world}" + (f" fault {fault}" if fault else ""), cmd, world, timeout,
           os.path.join(out, "logs"))


def fmt(x):
    return "-" if x is None else f"{x:.2e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", required=True, help="the oracle_fsdp program")
    ap.add_argument("--work", required=True, help="scratch directory (emptied first)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=12, help="global batch (divisible by each W)")
    ap.add_argument("--seq", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-2)
    # Adam is invariant to the gradient's scale where eps << |grad|: with eps 1e-8 a reduction
    # that sums instead of averaging goes unseen (the grad-sum control). At 1e-3 it does not.
    ap.add_argument("--eps", type=float, default=1e-3, help="Adam's eps")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per launch")
    ap.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    args = ap.parse_args()
    t0 = time.monotonic()
    torch.set_num_threads(1)
    binary = os.path.abspath(args.binary)
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    data = os.path.join(work, "data")
    fsdp_oracle.generate(data, args.steps, args.batch, args.seq, args.lr, args.eps)
    single, single_osd = fsdp_oracle.train_single(data)
    single_order = list(single)
    init, _ = compare.read_st(os.path.join(data, "init.safetensors"))
    dp_both = {w: fsdp_oracle.train_data_parallel(data, w) for w in args.worlds}
    dp = {w: v[0] for w, v in dp_both.items()}
    dp_osd = {w: v[1] for w, v in dp_both.items()}
    print(f"oracle: torch {torch.__version__}, {args.steps} Adam steps (lr {args.lr}, eps "
          f"{args.eps}), global batch "
          f"{args.batch}x{args.seq}, worlds {args.worlds}; inputs in {data}", flush=True)

    py_root, cpp_root = os.path.join(work, "python"), os.path.join(work, "cpp")
    timings, peer_notes = {}, []
    for w in args.worlds:
        t = time.monotonic()
        peer_notes += run_python(data, py_root, w, CASES, args.timeout)
        timings[f"python W={w}"] = time.monotonic() - t
        t = time.monotonic()
        run_cpp(binary, data, cpp_root, w, CASES, args.timeout)
        timings[f"fsdp-cpp W={w}"] = time.monotonic() - t

    print("columns: max |difference| of FULL values (cpp-py, cpp-single; the measured drifts "
          "py-single, dp-single),\n  tol = 2 * max(drifts), worst = max |diff| / max(tol, 4 ulps) "
          "over FULL elements (<= 1 passes),\n  max |cpp - py| over SHARDED and LOCAL pieces; "
          "optimizer state: max |cpp - py or single| of FULL values and its tol (2 x drift);\n"
          "  verdicts per state-dict type (OPTIM = FULL, OSH = SHARDED optimizer state dicts)")
    header = (f"{'case':<24} {'cpp-py':>9} {'cpp-single':>10} {'py-single':>9} {'dp-single':>9} "
              f"{'tol':>9} {'worst':>6} {'sharded':>9} {'local':>9} {'optim':>9} {'otol':>9}  "
              f"FULL SHARDED LOCAL OPTIM OSH")
    print(header)
    print("-" * len(header))
    all_ok, notes = True, []
    for w in args.worlds:
        for spec in CASES:
            name = case_dir(w, spec)
            res = compare.compare_case(os.path.join(py_root, name), os.path.join(cpp_root, name),
                                       w, single, single_order, dp[w], init, single_osd,
                                       dp_osd[w])
            n = res.numbers
            print(f"{name:<24} {fmt(n.get('cpp_vs_py')):>9} {fmt(n.get('cpp_vs_single')):>10} "
                  f"{fmt(n.get('drift_py')):>9} {fmt(n.get('drift_dp')):>9} {fmt(n.get('tol')):>9} "
                  f"{n.get('ratio', float('nan')):>6.2f} "
                  f"{fmt(n.get('sharded_max')):>9} {fmt(n.get('local_max')):>9} "
                  f"{fmt(n.get('optim_max')):>9} {fmt(n.get('optim_tol')):>9}  "
                  f"{res.verdict('FULL'):<4} {res.verdict('SHARDED'):<7} "
                  f"{res.verdict('LOCAL'):<5} {res.verdict('OPTIM'):<5} "
                  f"{res.verdict('OPTIM_SHARDED')}")
            for aspect, msgs in res.fails.items():
                for m in msgs[:6]:
                    print(f"    {aspect} FAIL: {m}")
                if len(msgs) > 6:
                    print(f"    {aspect}: {len(msgs) - 6} more failures")
            for m in res.notes:
                notes.append(f"{name}: {m}")
            all_ok = all_ok and res.ok
    for m in peer_notes:
        print(f"note: {m}")
    if notes:
        print("\nnotes (differences outside what is checked):")
        for m in notes:
            print(f"  {m}")

    controls_ok = True
    if not args.no_controls:
        print("\nnegative controls (each must be caught):")
        controls = [("drop-grad-rank1", 2, "FULL_SHARD:0", "FULL"),
                    ("drop-grad-rank1", 3, "NO_SHARD:1", "FULL"),
                    ("drop-grad-rank1", 2, "FULL_SHARD:0:ac", "FULL"),
                    ("grad-sum", 2, "FULL_SHARD:0", "FULL"),
                    ("grad-sum", 3, "SHARD_GRAD_OP:1", "FULL"),
                    ("padding", 3, "FULL_SHARD:1", "LOCAL"),
                    ("optim-state", 2, "FULL_SHARD:1", "OPTIM"),
                    ("optim-state", 3, "FULL_SHARD:0", "OPTIM_SHARDED")]
        for fault, w, spec, aspect in controls:
            if w not in args.worlds:
                continue
            out = os.path.join(work, f"control_{fault}")
            t = time.monotonic()
            run_cpp(binary, data, out, w, [spec], args.timeout, fault=fault)
            timings[f"control {fault} W={w}"] = time.monotonic() - t
            name = case_dir(w, spec)
            res = compare.compare_case(os.path.join(py_root, name), os.path.join(out, name), w,
                                       single, single_order, dp[w], init, single_osd, dp_osd[w])
            caught = bool(res.fails[aspect])
            controls_ok = controls_ok and caught
            first = res.fails[aspect][0] if caught else "nothing"
            print(f"  --fault {fault:<16} {name:<22} {aspect} "
                  f"{'caught' if caught else 'NOT CAUGHT'}: {first}")

    total = time.monotonic() - t0
    print("\ntimings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) +
          f"; total {total:.1f}s")
    ok = all_ok and controls_ok
    print("oracle: " + ("PASS" if ok else "FAIL") +
          ("" if all_ok else " (some cases differ)") +
          ("" if controls_ok else " (a negative control was not caught)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
