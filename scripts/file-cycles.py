#!/usr/bin/env python3
"""Cycles between pshard's source files, from the linker's view of a build: file A depends on
file B when A's object file uses a global symbol (function or variable) that B's object file
defines. Prints each group of product files that depend on each other in a circle (a strongly
connected component of more than one file) and the count; tests, benchmarks, examples and
generated protobuf code are left out. usage: scripts/file-cycles.py [BUILD_DIR]"""
import os
import subprocess
import sys

build = sys.argv[1] if len(sys.argv) > 1 else "build"
skip = ("tests/", "proto/", "examples/", "client/python/")
objs = {}  # source path (relative to the repo) -> object file
for dirpath, _, files in os.walk(build):
    if "CMakeFiles" not in dirpath:
        continue
    for f in files:
        if not (f.endswith(".c.o") or f.endswith(".cu.o")):
            continue
        path = os.path.join(dirpath, f)
        # CMakeFiles/<target>.dir/<source path relative to the target's folder>.o
        tgt_dir = dirpath.split("CMakeFiles" + os.sep, 1)
        rel_build = os.path.relpath(tgt_dir[0], build)
        inside = tgt_dir[1].split(os.sep, 1)
        src = os.path.normpath(os.path.join(rel_build, inside[1] if len(inside) > 1 else "", f[:-2]))
        if src.startswith(skip) or not os.path.exists(src):
            continue
        objs[src] = path

defined, used = {}, {}
for src, obj in objs.items():
    out = subprocess.run(["nm", "--defined-only", "-g", obj], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            defined.setdefault(parts[2], set()).add(src)
    out = subprocess.run(["nm", "-u", obj], capture_output=True, text=True).stdout
    used[src] = {l.split()[-1] for l in out.splitlines() if l.strip()}

edges = {src: set() for src in objs}
for src, syms in used.items():
    for s in syms:
        for d in defined.get(s, ()):
            if d != src:
                edges[src].add(d)

# Tarjan's strongly connected components.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            sccs.append(sorted(comp))
for v in sorted(edges):
    if v not in index:
        visit(v)
print(f"{len(objs)} product files, {sum(len(e) for e in edges.values())} file-to-file dependencies")
for comp in sorted(sccs):
    print(f"cycle of {len(comp)}: " + " ".join(comp))
    for a in comp:
        into = sorted(b for b in edges[a] if b in comp)
        print(f"    {a} -> {', '.join(into)}")
print(f"{len(sccs)} cycles ({sum(len(c) for c in sccs)} files in them)")
