#!/usr/bin/python3
"""Turns fsdp-train --metrics files into a PNG loss curve (Debian's python3-matplotlib).

    plot_metrics.py metrics.jsonl [more.jsonl ...] -o loss.png

Each file is one JSON object per logged step ({"step", "loss", "tokens_per_s", "max_rss_mb",
...}); each becomes one line labelled with its file name and world size. A resumed run appends
to its file, so a step may appear twice (logged again after a resume): the last one wins.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    points = {}
    sizes = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                m = json.loads(line)
                points[int(m["step"])] = float(m["loss"])
                sizes.add(m.get("world_size"))
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"plot_metrics: {path}:{n}: not a metrics line ({e})")
    if not points:
        raise SystemExit(f"plot_metrics: {path} holds no logged step")
    steps = sorted(points)
    return steps, [points[s] for s in steps], sorted(s for s in sizes if s is not None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", nargs="+")
    ap.add_argument("-o", "--output", default="loss.png")
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for path in args.metrics:
        steps, losses, sizes = read(path)
        label = path + (f" (W={','.join(map(str, sizes))})" if sizes else "")
        ax.plot(steps, losses, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("global-batch loss")
    ax.set_title("fsdp-train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
