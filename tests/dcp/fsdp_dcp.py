"""Python FSDP as the other side of the DCP checkpoint tests (tests/checkpoint/test_dcp_checkpoint.cpp).

  fsdp_dcp.py load DIR WORLD   WORLD ranks wrap the TinyLM twin (tests/oracle/fsdp_oracle.py) in
                               Python FSDP (FULL_SHARD, use_orig_params) with Adam, load the
                               checkpoint in DIR with stock dcp.load through get_state_dict /
                               set_state_dict, and rank 0 prints the full model and optimizer
                               state
  fsdp_dcp.py save DIR WORLD   the same model trains two steps at WORLD ranks and dcp.save writes
                               {"model", "optim"} to DIR; rank 0 prints the full state

Output: one line per tensor, sorted, "<flattened key> <dtype> <values>" as dcp_python.py prints.
Needs torch >= 2.4 with FSDP and DCP on CPU (the trixie chroot).
"""
import functools
import os
import socket
import subprocess
import sys
import warnings

import torch

sys.dont_write_bytecode = True  # importing the oracle must not leave __pycache__ in the tree
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "oracle"))


def lines(sd, prefix=""):
    out = []
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += lines(v, key + ".")
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], dict):
            for i, x in enumerate(v):
                out += lines(x, f"{key}.{i}.")
        elif isinstance(v, torch.Tensor):
            vals = ",".join(repr(float(x)) for x in v.flatten().to(torch.float64).tolist())
            out.append(f"{key} {str(v.dtype).replace('torch.', '')} {vals}")
    return out


def worker(cmd, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    from fsdp_oracle import Block, TinyLM, VOCAB

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = TinyLM()
    frozen = model.frozen
    policy = functools.partial(lambda_auto_wrap_policy,
                               lambda_fn=lambda m: m is frozen or isinstance(m, Block))
    fsdp = FSDP(model, auto_wrap_policy=policy, use_orig_params=True,
                device_id=torch.device("cpu"))
    opt = torch.optim.Adam([p for p in fsdp.parameters() if p.requires_grad], lr=0.01)
    if cmd == "save":
        for s in range(2):
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * s + rank)
            idx = torch.randint(0, VOCAB, (2, 5), generator=g)
            logits = fsdp(idx)
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx.reshape(-1)).backward()
            opt.step()
        msd, osd = get_state_dict(fsdp, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:
        msd, osd = get_state_dict(fsdp, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(fsdp, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = StateDictOptions(full_state_dict=True)
    fm, fo = get_state_dict(fsdp, opt, options=full)
    if rank == 0:
        print("\n".join(sorted(lines({"model": fm, "optim": fo}))))
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown, where PyTorch 2.6's Gloo group has aborted once in many
    # runs ("terminate called without an active exception") after all the work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    cmd, path, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) > 4 and sys.argv[4] == "--rank":
        return worker(cmd, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-W", "ignore", __file__, cmd, path,
                                       str(world), "--rank"], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        sys.exit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
