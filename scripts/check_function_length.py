#!/usr/bin/env python3
"""Checks that no function of the library is longer than a reader can hold (docs/layers.md):
a function in src/, tools/ or examples/ over LIMIT lines (signature to closing brace) must say
why it must be, in the comment right above it, with the words "Long because" or "Long by nature".

    scripts/check_function_length.py [ROOT]      exit 1 and one line per unexplained long function
    scripts/check_function_length.py --list [ROOT]  every function over the limit, explained or not
    scripts/check_function_length.py --self-test    the checker against planted functions

The parser is a brace matcher over the source with comments, strings and preprocessor lines
blanked out, not a C++ front end: it finds the outermost brace blocks whose header has a
parenthesis (functions, methods, namespace-scope lambdas) at namespace or class scope. A
constructor's brace-initialised members are followed into its body.
"""
import os
import re
import sys
import tempfile

LIMIT = 80
DIRS = ["src", "tools", "examples"]
REASON = re.compile(r"\bLong (because|by nature)\b")
SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b|extern\s*$")


def blank(text):
    """`text` with comments, string and char literals and preprocessor lines replaced by spaces
    (newlines kept, so offsets map to the same lines)."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a preprocessor line, with its continuations
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            wipe(i, j)
            i = j
            continue
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            wipe(i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def functions(text):
    """(name, first line, last line) of every function body at namespace or class scope."""
    code = blank(text)
    line_of = []
    ln = 1
    for ch in code:
        line_of.append(ln)
        if ch == "\n":
            ln += 1
    stack = []  # kinds of the open blocks: "scope", "function", "other"
    header_start = 0  # where the text before the next "{" at this level began
    found = []
    open_fn = None  # (name, first line) of the function whose body is open at depth len(stack)
    fn_depth = None
    continuing = False  # a constructor's brace-initialised member closed; its body is to come
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if c in ";":
            header_start = i + 1
        elif c == "{":
            header = code[header_start:i]
            in_function = any(k != "scope" for k in stack)
            if in_function:
                stack.append("other")
            elif continuing:
                stack.append("function")  # past a brace-initialised member, into the constructor
                continuing = False
            elif SCOPE.search(_untemplated(header).split("(")[0]):
                stack.append("scope")
                open_fn = None
            elif "(" not in header or header.rstrip().endswith("="):
                stack.append("other")  # an aggregate initialiser at namespace scope
                open_fn = None
            else:
                stack.append("function")
                first = header_start + len(header) - len(header.lstrip())
                name = re.findall(r"([~\w:]+(?:\s*operator\s*\S+)?)\s*\(", _unangled(header))
                open_fn = (name[0] if name else "?", line_of[first])
                fn_depth = len(stack) - 1
            header_start = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "scope"
            header_start = i + 1
            if kind == "function" and open_fn is not None and len(stack) == fn_depth:
                # A brace-initialised member in a constructor's initialiser list ends with "}" and
                # is followed by "," or the body's "{": keep the function open across it.
                rest = code[i + 1:i + 200].lstrip()
                if rest.startswith(",") or (rest.startswith("{") and _in_init_list(code, i)):
                    continuing = True
                    i += 1
                    continue
                found.append((open_fn[0], open_fn[1], line_of[i]))
                open_fn = None
        i += 1
    return found


def _untemplated(header):
    """`header` without its `template <...>` parameter lists (whose `class` is no class)."""
    out, i = [], 0
    for m in re.finditer(r"\btemplate\s*<", header):
        if m.start() < i:
            continue
        out.append(header[i:m.start()])
        depth, j = 0, m.end() - 1
        while j < len(header):
            depth += {"<": 1, ">": -1}.get(header[j], 0)
            j += 1
            if depth == 0:
                break
        i = j
    out.append(header[i:])
    return "".join(out)


def _unangled(header):
    """`header` with the contents of its `<...>` removed (so `std::function<void(int)> f(` names f)."""
    out, depth = [], 0
    for ch in header:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def _in_init_list(code, close):
    """Whether the block closing at `close` is a brace-initialised member (`x_{...}`): its opening
    brace follows a name directly, as a function body's never does after its ')' or specifiers."""
    depth = 0
    j = close
    while j >= 0:
        if code[j] == "}":
            depth += 1
        elif code[j] == "{":
            depth -= 1
            if depth == 0:
                break
        j -= 1
    before = code[:j].rstrip()
    return bool(before) and (before[-1].isalnum() or before[-1] == "_") and \
        not re.search(r"\b(const|override|noexcept|final|mutable|try)$", before)


def reason_above(lines, first):
    """The comment block right above line `first` (1-based), joined."""
    k = first - 2
    block = []
    while k >= 0:
        s = lines[k].strip()
        if s.startswith("//") or s.startswith("*") or s.startswith("/*") or s.endswith("*/"):
            block.append(s)
            k -= 1
        elif s.startswith("template") or s.startswith("[[") or s.startswith("inline") or \
                s.startswith("static"):
            k -= 1  # a signature's own first lines
        else:
            break
    return " ".join(reversed(block))


def check(root, list_all=False):
    problems = []
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if not f.endswith((".cpp", ".h", ".cc", ".hpp")):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                lines = text.split("\n")
                for name, first, last in functions(text):
                    length = last - first + 1
                    if length <= LIMIT:
                        continue
                    explained = bool(REASON.search(reason_above(lines, first)))
                    rel = os.path.relpath(path, root)
                    if list_all or not explained:
                        tag = "explained" if explained else "no reason given above it"
                        problems.append((rel, first, name, length, tag, explained))
    return problems


PLANTED = {
    "src/a/long.cpp": "void fine() {\n" + "  x();\n" * 10 + "}\n"
                      "int too_long(int a) {\n" + "  a++;\n" * 85 + "  return a;\n}\n",
    "src/a/explained.cpp": "// Long by nature: one case per opcode.\n"
                           "void step() {\n" + "  y();\n" * 90 + "}\n",
    "src/a/ctor.cpp": "struct S { S(); int a_; int b_; };\n"
                      "S::S()\n    : a_{1},\n      b_{2} {\n" + "  z();\n" * 90 + "}\n",
    "tools/t.cpp": "namespace n {\nclass C {\n  void m() const {\n" +
                   "    if (q) { w(); }\n" * 82 + "  }\n};\n}  // namespace n\n",
    "src/a/strings.cpp": 'const char* s = "{ not a block";\n// } nor this\n'
                         "void g() {\n" + "  h();\n" * 85 + "}\n",
    "src/a/template.h": "template <class T, typename = std::enable_if_t<(1 > 0)>>\n"
                        "T tmpl(T t) {\n" + "  if (t) { t++; }\n" * 85 + "  return t;\n}\n",
}


def self_test():
    with tempfile.TemporaryDirectory() as root:
        for rel, text in PLANTED.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
        got = sorted((p[0], p[2]) for p in check(root))
    want = sorted([("src/a/long.cpp", "too_long"), ("src/a/ctor.cpp", "S::S"),
                   ("tools/t.cpp", "m"), ("src/a/strings.cpp", "g"),
                   ("src/a/template.h", "tmpl")])
    if got != want:
        print("self-test FAILED:\n  got  %s\n  want %s" % (got, want))
        return 1
    print("self-test ok: %d planted long functions reported, the explained one not" % len(want))
    return 0


def main(argv):
    if "--self-test" in argv:
        return self_test()
    list_all = "--list" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    problems = check(root, list_all)
    for rel, first, name, length, tag, _ in problems:
        print("%s:%d: %s is %d lines (limit %d): %s" % (rel, first, name, length, LIMIT, tag))
    unexplained = [p for p in problems if not p[5]]
    if unexplained:
        print("%d function(s) over %d lines without a reason; split them, or say in the comment "
              "above why they must be long (\"Long because ...\")" % (len(unexplained), LIMIT))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
