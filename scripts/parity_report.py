#!/usr/bin/env python3
"""The table of scripts/ddp_parity.sh: NO_SHARD against PyTorch DDP, per LibTorch and model.

    parity_report.py MEASUREMENTS.jsonl SUMMARY.md [SECONDS]

Reads the samples the rounds wrote (tagged parity-<torch>-r<round>), pairs our NO_SHARD with
each DDP configuration measured in the same round ("DDP", its defaults; "DDP view",
gradient_as_bucket_view; "DDP view static", with static_graph besides), and prints per LibTorch,
model and configuration: the rounds paired, each side's median step, the median of the per-round
ratios (the figure issue 42's acceptance asks for), their range, and how many rounds had us
faster. A round where one side is missing is left out and counted, never guessed.
"""
import json
import re
import statistics
import sys
from collections import defaultdict

TAG = re.compile(r"^parity-(?P<torch>[^-]+)-r(?P<round>\d+)$")


def load(path):
    """{(torch, model): {round: {"ours": s, "ddp": s}}} from the measurement lines."""
    cells = defaultdict(lambda: defaultdict(dict))
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            m = json.loads(line)
            tag = TAG.match(m.get("run", ""))
            if not tag:
                continue
            bench, case = m.get("bench"), m.get("case", "")
            if (bench, case) == ("training", "NO_SHARD"):
                side = "ours"
            elif bench == "training_python" and case.startswith("DDP") and "bucket=" not in case:
                side = case
            else:
                continue
            version = m.get("libtorch") or m.get("pytorch", "?")
            key = (tag["torch"], m["model"])
            cells[key][int(tag["round"])][side] = (m["median"], version)
    return cells


def table(cells):
    rows = ["| LibTorch | model | DDP as | rounds | NO_SHARD ms | DDP ms "
            "| **NO_SHARD / DDP** (median of rounds) | range | rounds ours faster | left out |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (torch, model), rounds in sorted(cells.items()):
        configs = sorted({k for r in rounds.values() for k in r if k != "ours"}, key=len)
        for config in configs or ["DDP"]:
            paired = [r for r in rounds.values() if "ours" in r and config in r]
            if not paired:
                rows.append(f"| {torch} | {model} | {config} | 0 | | | | | | {len(rounds)} |")
                continue
            ours = [r["ours"][0] for r in paired]
            ddp = [r[config][0] for r in paired]
            ratios = [o / d for o, d in zip(ours, ddp)]
            version = f"{paired[0]['ours'][1]} / {paired[0][config][1]}"
            rows.append(
                f"| {torch} ({version}) | {model} | {config} | {len(paired)} "
                f"| {statistics.median(ours) * 1e3:.1f} | {statistics.median(ddp) * 1e3:.1f} "
                f"| **{statistics.median(ratios):.3f}** | {min(ratios):.3f}-{max(ratios):.3f} "
                f"| {sum(x < 1 for x in ratios)} of {len(ratios)} | {len(rounds) - len(paired)} |")
    return "\n".join(rows)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cells = load(sys.argv[1])
    if not cells:
        sys.exit(f"parity_report.py: no parity samples in {sys.argv[1]}")
    out = table(cells)
    if len(sys.argv) > 3:
        out += f"\n\n{sys.argv[3]} s in all; W=2, Adam, one thread per rank, Gloo over loopback.\n"
    print(out)
    with open(sys.argv[2], "w") as f:
        f.write(out + "\n")


if __name__ == "__main__":
    main()
