#!/usr/bin/env python3
"""Checks the public headers (include/fsdp/) against the header rules of docs/layers.md:

  1. every option (a TORCH_ARG field of a public struct) has a comment right above it, or at the
     end of its line, that states its default (the word "default", any case);
  2. no comment block longer than MAX_BLOCK lines explains a measurement (figures belong in
     docs/performance.md and docs/dist.md; a header says what an option does and how to choose);
  3. no `namespace detail` holding more than forward declarations in a header a user includes:
     machinery goes to include/fsdp/detail/. The compat headers are exempt: version shims are
     their whole purpose, and the project keeps version differences there and only there.

    scripts/check_public_headers.py [ROOT]     exit 1 and one line per violation
    scripts/check_public_headers.py --self-test  the checker against planted violations
"""
import os
import re
import sys
import tempfile

MAX_BLOCK = 6
FIELD = re.compile(r"^\s*TORCH_ARG\(")
COMMENT = re.compile(r"^\s*//")
DEFAULT = re.compile(r"\bdefault", re.IGNORECASE)
# What a measurement reads like: a figure with a unit of time, rate or ratio, a count of page
# faults, or the words a write-up of a run uses.
MEASUREMENT = re.compile(
    r"(\b\d[\d,.]*\s*(%|x faster|x slower|ms\b|us\b|µs|faults|MiB/s|GiB/s|GB/s|MB/s))"
    r"|\b(measured|faster|slower|benchmark)\b",
    re.IGNORECASE,
)
DETAIL_NS = re.compile(r"^\s*namespace\s+detail\s*\{")
DETAIL_END = re.compile(r"^\s*\}\s*//\s*namespace detail")
FORWARD_DECL = re.compile(r"^\s*(class|struct)\s+\w+\s*;\s*(//.*)?$")


def headers(root):
    base = os.path.join(root, "include", "fsdp")
    for d, _, files in os.walk(base):
        if os.path.relpath(d, base).split(os.sep)[0] == "detail":
            continue  # the machinery's own folder: not read by users
        for f in sorted(files):
            if f.endswith(".h"):
                yield os.path.join(d, f)


def comment_above(lines, i):
    """The comment lines directly above line i (no blank line between)."""
    j = i - 1
    block = []
    while j >= 0 and COMMENT.match(lines[j]):
        block.insert(0, lines[j])
        j -= 1
    return block


def check_file(path, rel):
    problems = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if FIELD.match(line):
            trailing = line.split("//", 1)[1] if "//" in line else ""
            above = comment_above(lines, i)
            if not above and not trailing:
                problems.append(f"{rel}:{i + 1}: option without a comment: {line.strip()}")
            elif not DEFAULT.search(" ".join(above) + trailing):
                problems.append(f"{rel}:{i + 1}: option's comment does not state its default: "
                                f"{line.strip()}")
        if DETAIL_NS.match(line) and not os.path.basename(rel).startswith("compat"):
            j = i + 1
            while j < len(lines) and not DETAIL_END.match(lines[j]):
                j += 1
            body = [b for b in lines[i + 1:j] if b.strip() and not COMMENT.match(b)]
            if not all(FORWARD_DECL.match(b) for b in body):
                problems.append(f"{rel}:{i + 1}: namespace detail in a public header "
                                "(move it to include/fsdp/detail/)")
    # Comment blocks: maximal runs of comment lines.
    i = 0
    while i < len(lines):
        if not COMMENT.match(lines[i]):
            i += 1
            continue
        j = i
        while j < len(lines) and COMMENT.match(lines[j]):
            j += 1
        text = " ".join(lines[i:j])
        if j - i > MAX_BLOCK and MEASUREMENT.search(text):
            found = MEASUREMENT.search(text).group(0)
            problems.append(f"{rel}:{i + 1}: a {j - i}-line comment explains a measurement "
                            f"('{found}'): move the figures to docs/")
        i = j
    return problems


def check(root):
    problems = []
    for path in headers(root):
        problems += check_file(path, os.path.relpath(path, root))
    return problems


PLANTED = {
    "no_comment.h": ("struct A {\n  TORCH_ARG(int, x) = 1;\n};\n", "without a comment"),
    "no_default.h": ("struct B {\n  /// The x.\n  TORCH_ARG(int, x) = 1;\n};\n",
                     "does not state its default"),
    "essay.h": ("".join(f"/// line {k}\n" for k in range(7)) +
                "/// 2,600 faults and 2% of each step.\nint f();\n", "explains a measurement"),
    "detail.h": ("namespace fsdp {\nnamespace detail {\nint f();\n}  // namespace detail\n}\n",
                 "namespace detail"),
}
CLEAN = ("namespace detail {\nclass Fwd;  // declared only\n}  // namespace detail\n"
         "struct C {\n  /// The x. Default 1.\n  TORCH_ARG(int, x) = 1;\n"
         "  TORCH_ARG(int, y) = 2;  // default 2\n};\n"
         + "".join(f"/// line {k}\n" for k in range(9)) + "int g();\n")


def self_test():
    failures = 0
    with tempfile.TemporaryDirectory() as root:
        base = os.path.join(root, "include", "fsdp")
        os.makedirs(os.path.join(base, "detail"))
        with open(os.path.join(base, "clean.h"), "w") as f:
            f.write(CLEAN)
        with open(os.path.join(base, "detail", "machinery.h"), "w") as f:
            f.write(PLANTED["detail.h"][0])  # allowed in detail/
        if check(root):
            print("self-test: a clean tree was reported:", check(root))
            failures += 1
        for name, (text, expect) in PLANTED.items():
            p = os.path.join(base, name)
            with open(p, "w") as f:
                f.write(text)
            got = check(root)
            if len(got) != 1 or expect not in got[0]:
                print(f"self-test: planted {name} gave {got}, expected one '{expect}'")
                failures += 1
            os.remove(p)
    print("self-test:", "ok" if not failures else f"{failures} failure(s)")
    return 1 if failures else 0


def main(argv):
    if argv[1:2] == ["--self-test"]:
        return self_test()
    root = argv[1] if len(argv) > 1 else "."
    problems = check(root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
