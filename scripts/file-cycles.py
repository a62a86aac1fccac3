#!/usr/bin/env python3
"""Cycles between pshard's files. C: from the linker's view of a build, file A depends on file B
when A's object file uses a global symbol that B's object file defines (tests, benchmarks,
examples and generated protobuf code are left out). Python: module A depends on module B of the
pshard package when A imports B anywhere in its file, inside a function too, since an import
moved into a function to dodge a cycle is still a cycle. Prints each group of files that depend
on each other in a circle (a strongly connected component of more than one file).

With --check (CTest file_cycles) it exits 1 on any Python cycle and on any C cycle that is not
a line of the allow list (scripts/file-cycles.allow: the C cycles known when the check began,
less the files this build did not compile), so a new or changed cycle fails while the known ones
are printed as "known".

usage: scripts/file-cycles.py [--check] [--source DIR] [--allow FILE] [BUILD_DIR]
       scripts/file-cycles.py [--check] --python-only [--package DIR]
"""
import argparse
import ast
import os
import re
import subprocess
import sys

SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
C_SKIP = ("tests/", "proto/", "examples/", "client/python/")


def c_objects(build, source):
    """Maps each C/CUDA product source file (relative to source) to its object file in build."""
    objs = {}
    for dirpath, dirs, files in os.walk(build):
        # A virtual environment in the build (build/torch-venv) holds no product objects.
        dirs[:] = [d for d in dirs if not os.path.exists(os.path.join(dirpath, d, "pyvenv.cfg"))]
        if "CMakeFiles" not in dirpath:
            continue
        for f in files:
            if not (f.endswith(".c.o") or f.endswith(".cu.o")):
                continue
            # CMakeFiles/<target>.dir/<source path relative to the target's folder>.o
            tgt_dir = dirpath.split("CMakeFiles" + os.sep, 1)
            rel_build = os.path.relpath(tgt_dir[0], build)
            inside = tgt_dir[1].split(os.sep, 1)
            src = os.path.normpath(
                os.path.join(rel_build, inside[1] if len(inside) > 1 else "", f[:-2]))
            if src.startswith(C_SKIP) or not os.path.exists(os.path.join(source, src)):
                continue
            objs[src] = os.path.join(dirpath, f)
    return objs


def c_graph(objs):
    """File -> {file it uses a global symbol of: that symbol}, from nm on each object."""
    defined, used = {}, {}
    for src, obj in objs.items():
        out = subprocess.run(["nm", "--defined-only", "-g", obj], capture_output=True,
                             text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3:
                defined.setdefault(parts[2], set()).add(src)
        out = subprocess.run(["nm", "-u", obj], capture_output=True, text=True,
                             check=True).stdout
        used[src] = {l.split()[-1] for l in out.splitlines() if l.strip()}
    edges = {src: {} for src in objs}
    for src, syms in used.items():
        for s in sorted(syms):
            for d in defined.get(s, ()):
                if d != src:
                    edges[src].setdefault(d, s)
    return edges


def python_modules(pkg_dir):
    """Maps each module of the package in pkg_dir (named by the folder) to its .py file;
    a package's module is its __init__.py."""
    top = os.path.basename(os.path.normpath(pkg_dir))
    mods = {}
    for dirpath, dirs, files in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(dirpath, pkg_dir)
        prefix = top if rel == "." else top + "." + rel.replace(os.sep, ".")
        for f in sorted(files):
            if f == "__init__.py":
                mods[prefix] = os.path.join(dirpath, f)
            elif f.endswith(".py"):
                mods[prefix + "." + f[:-3]] = os.path.join(dirpath, f)
    return mods


def extension_modules(pkg_dir):
    """Names of the package's compiled modules (pshard._C): those a PyModuleDef in the C
    sources beside the package names, and any built extension file in the package. They are
    modules, not names bound by an __init__.py, and import no Python module of the package."""
    top = os.path.basename(os.path.normpath(pkg_dir))
    names = set()
    src_dir = os.path.join(os.path.dirname(os.path.normpath(pkg_dir)), "src")
    if os.path.isdir(src_dir):
        for f in os.listdir(src_dir):
            if f.endswith(".c"):
                with open(os.path.join(src_dir, f), encoding="utf-8", errors="replace") as fh:
                    names.update(re.findall(r'PyModuleDef_HEAD_INIT\s*,\s*"([\w.]+)"',
                                            fh.read()))
    for dirpath, _, files in os.walk(pkg_dir):
        rel = os.path.relpath(dirpath, pkg_dir)
        prefix = top if rel == "." else top + "." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith((".so", ".pyd")):
                names.add(prefix + "." + f.split(".", 1)[0])
    return names


def python_imports(name, path, mods, exts):
    """{module of the package that module name imports: line of the first such import}.
    `from P import n` depends on P.n when that is a module, else on P; a module's parent
    packages, which Python imports implicitly, are not counted unless the file names them
    (`import pshard`, `from pshard import x`). Imports of other packages are left out."""
    top = name.split(".")[0]
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    out = {}

    def depend(target, line):
        # The longest prefix of target that is a module of the package (pshard.x.f -> pshard.x).
        while target and target not in mods:
            if target in exts:
                return
            target = target.rpartition(".")[0]
        if target and target != name:
            out.setdefault(target, line)

    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    depend(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                if node.module:
                    base = base + "." + node.module if base else node.module
            else:
                base = node.module or ""
            if base != top and not base.startswith(top + "."):
                continue
            for alias in node.names:
                sub = base + "." + alias.name
                if sub in mods or sub in exts:
                    depend(sub, node.lineno)
                else:
                    depend(base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            # importlib.import_module("pshard.x") is an import too.
            target = node.args[0].value
            if target == top or target.startswith(top + "."):
                depend(target, node.lineno)
    return out


def python_graph(pkg_dir):
    """Module -> {module of the same package it imports: line}, for every module in pkg_dir."""
    mods = python_modules(pkg_dir)
    exts = extension_modules(pkg_dir)
    return {m: python_imports(m, p, mods, exts) for m, p in mods.items()}


def cycles(edges):
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, sccs = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                sccs.append(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(sccs)


def read_allow(path):
    """The allowed cycles: one per line, its files sorted and separated by spaces; '#' starts a
    comment. A missing file allows nothing."""
    allowed = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                files = line.split("#", 1)[0].split()
                if files:
                    allowed.add(tuple(sorted(files)))
    return allowed


def report(sccs, edges, allowed, why):
    """Prints each cycle, "known" when allowed, "NEW" otherwise, with its edges inside the
    cycle (why(a, b) says what makes a depend on b); returns the number of new cycles."""
    new = 0
    for comp in sccs:
        known = comp in allowed
        new += not known
        print(f"{'known' if known else 'NEW'} cycle of {len(comp)}: " + " ".join(comp))
        for a in comp:
            into = [f"{b} ({why(a, b)})" for b in sorted(edges[a]) if b in comp]
            print(f"    {a} -> {', '.join(into)}")
    return new


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", nargs="?", default="build",
                    help="build folder whose object files the C check reads (default: build)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a Python cycle or a C cycle not in the allow list")
    ap.add_argument("--python-only", action="store_true",
                    help="only the Python package (no build folder needed)")
    ap.add_argument("--source", default=os.path.dirname(SCRIPT_DIR),
                    help="the source tree (default: the one holding this script)")
    ap.add_argument("--package", help="the Python package folder "
                    "(default: SOURCE/client/python/pshard)")
    ap.add_argument("--allow", default=os.path.join(SCRIPT_DIR, "file-cycles.allow"),
                    help="the known C cycles (default: file-cycles.allow beside this script)")
    args = ap.parse_args()
    pkg_dir = args.package or os.path.join(args.source, "client", "python", "pshard")
    failures = 0

    if not args.python_only:
        objs = c_objects(args.build, args.source)
        if not objs:
            print(f"file-cycles: no product object files under {args.build} for sources in "
                  f"{args.source}; build first", file=sys.stderr)
            return 2
        edges = c_graph(objs)
        # A build without CUDA compiles no coll_nccl.c: a known cycle through it is known
        # there without that file.
        allowed = {tuple(f for f in comp if f in objs) for comp in read_allow(args.allow)}
        allowed = {comp for comp in allowed if len(comp) > 1}
        print(f"C: {len(objs)} product files, "
              f"{sum(len(e) for e in edges.values())} file-to-file dependencies")
        sccs = cycles(edges)
        new = report(sccs, edges, allowed, lambda a, b: "uses " + edges[a][b])
        for comp in sorted(allowed - set(sccs)):
            print("gone (remove it from the allow list): " + " ".join(comp))
        print(f"C: {len(sccs)} cycles ({sum(len(c) for c in sccs)} files in them), "
              f"{len(sccs) - new} known, {new} new")
        failures += new

    edges = python_graph(pkg_dir)
    if not edges:
        print(f"file-cycles: no Python modules in {pkg_dir}", file=sys.stderr)
        return 2
    print(f"Python: {len(edges)} modules of {os.path.basename(os.path.normpath(pkg_dir))}, "
          f"{sum(len(e) for e in edges.values())} imports between them")
    sccs = cycles(edges)
    report(sccs, edges, set(), lambda a, b: f"line {edges[a][b]}")
    print(f"Python: {len(sccs)} cycles (none are allowed)")
    failures += len(sccs)

    if args.check and failures:
        print(f"file-cycles: FAILED, {failures} new cycles", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
