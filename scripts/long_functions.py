#!/usr/bin/env python3
"""Functions of product code longer than N lines (default 120), at a git revision.

  scripts/long_functions.py [REV] [--lines N]

Product code: .cc/.cu/.h/.cuh files outside tests/ and bench/, not *_test, *_bench, *_benchmark,
*_fuzz, nor under a testing/ folder. A function is a brace block opened at namespace or class
level by a line that ends a signature with '{' (not a control statement or an initializer); its
length counts from that line to its closing brace. A counter of braces, not a parser: issue 43
uses it to compare revisions, so what matters is that it counts the same way each time.
"""
import argparse
import re
import subprocess
import sys


def strip(line):
    line = re.sub(r'//.*', '', line)
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    return re.sub(r"'(\\.|[^'\\])*'", "''", line)


def long_functions(rev, limit):
    files = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev], text=True).split()
    product = [f for f in files if f.endswith((".cc", ".cu", ".h", ".cuh"))
               and not re.search(r"(_test|_bench|_benchmark|_fuzz)\.(cc|cu)$", f)
               and not f.startswith(("tests/", "bench/")) and "/testing/" not in f]
    out = []
    for f in product:
        src = subprocess.check_output(["git", "show", "%s:%s" % (rev, f)], text=True,
                                      errors="replace").split("\n")
        stack = []  # (kind, line) of each open brace
        for i, line in enumerate(src):
            s = strip(line)
            for ch in s:
                if ch == "{":
                    kind = "other"
                    if re.match(r'^\s*(namespace|extern "C")', line) or \
                            re.search(r"\bnamespace\b[^;]*\{\s*$", s):
                        kind = "ns"
                    elif re.match(r"^\s*(class|struct|union|enum)\b", line) or \
                            re.search(r"^(template.*)?\s*(class|struct)\s", line):
                        kind = "cls"
                    if kind == "other" and all(k in ("ns", "cls") for k, _ in stack) and \
                            s.rstrip().endswith("{") and \
                            not re.match(r"^\s*(if|for|while|switch|else|do|return|case)\b", s) and \
                            not re.search(r"=\s*\{\s*$", s):
                        kind = "fn"
                    stack.append((kind, i))
                elif ch == "}" and stack:
                    kind, start = stack.pop()
                    if kind == "fn" and i - start + 1 > limit:
                        out.append((i - start + 1, f, src[start].strip()[:80]))
    return sorted(out, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", nargs="?", default="HEAD")
    ap.add_argument("--lines", type=int, default=120)
    args = ap.parse_args()
    found = long_functions(args.rev, args.lines)
    print("%d functions over %d lines at %s" % (len(found), args.lines, args.rev))
    for n, f, first in found:
        print("%4d  %s  %s" % (n, f, first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
