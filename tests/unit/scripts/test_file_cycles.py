#!/usr/bin/env python3
"""Self-test of scripts/file-cycles.py (CTest file_cycles_selftest), so that the file_cycles
check cannot pass because it stopped finding cycles: throwaway packages in a temporary folder,
one with a cycle through an import inside a function and one through a submodule importing its
parent package, one with none; and, when a C compiler is there, two C files that call each
other, failing until the allow list names them. Plain asserts: the system python3 has no pytest.
usage: test_file_cycles.py [PATH/TO/file-cycles.py]"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = (sys.argv[1] if len(sys.argv) > 1
          else os.path.join(HERE, "..", "..", "..", "scripts", "file-cycles.py"))


def write(root, files):
    """Creates each relative path in files under root with its text."""
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)


def run(*args):
    """Runs the script; returns (exit status, stdout, the set of cycles it printed)."""
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    found = set()
    for line in p.stdout.splitlines():
        if " cycle of " in line:
            found.add(frozenset(line.split(": ", 1)[1].split()))
    return p.returncode, p.stdout + p.stderr, found


def test_python(tmp):
    """The cyclic package's two cycles are found, exactly, and fail --check; the clean one,
    with the same kinds of imports minus the cycles, passes."""
    cyclic = os.path.join(tmp, "cyc")
    write(cyclic, {
        "__init__.py": "from . import a\nfrom .b import thing\n",
        # a -> c only inside a function; c -> a at the top: a cycle all the same.
        "a.py": "import os\n\ndef f():\n    from . import c\n    return c\n\ndef g():\n    pass\n",
        "c.py": "from .a import g\n",
        # b imports its own parent package, whose __init__ imports b.
        "b.py": "import cyc\n\nthing = 1\n",
        "d.py": "from . import _C\nfrom ._C import Error\n",
        "_C.cpython-311-x86_64-linux-gnu.so": "",
        "sub/__init__.py": "from .. import d\n",
        "sub/e.py": "from ..d import Error\nfrom cyc.sub import __name__ as n\n",
    })
    rc, out, found = run("--python-only", "--package", cyclic)
    assert rc == 0, out  # without --check: informative only
    rc, out, found = run("--check", "--python-only", "--package", cyclic)
    assert rc == 1, out
    assert found == {frozenset({"cyc.a", "cyc.c"}), frozenset({"cyc", "cyc.b"})}, out

    clean = os.path.join(tmp, "clean")
    write(clean, {
        "__init__.py": "from . import a\nfrom .b import thing\n",
        "a.py": "def f():\n    from . import c\n    return c\n",
        "c.py": "import os\n",
        "b.py": "thing = 1\n",
        # Not imported by the package's __init__, so importing the parent is no cycle; nor is
        # the extension module, which is a module of its own, not a name of __init__.
        "d.py": "import clean\nfrom . import _C\nfrom ._C import Error\n",
        "_C.cpython-311-x86_64-linux-gnu.so": "",
        "sub/__init__.py": "from .. import d\n",
        "sub/e.py": "from ..d import Error\n",
    })
    rc, out, found = run("--check", "--python-only", "--package", clean)
    assert rc == 0 and not found, out
    assert "Python: 7 modules of clean" in out, out


def test_c(tmp):
    """Two C files that use each other's functions are a cycle: new (exit 1) without an allow
    list, known (exit 0) with one that names them, and new again once a third joins."""
    cc = shutil.which("cc")
    if not cc or not shutil.which("nm"):
        print("no cc or nm: the C part is skipped")
        return
    src, build = os.path.join(tmp, "src"), os.path.join(tmp, "build")
    write(src, {
        "lib/a.c": "int b(int);\nint a(int x) { return x ? b(x - 1) : 0; }\n",
        "lib/b.c": "int a(int);\nint b(int x) { return a(x); }\n",
        "lib/c.c": "int a(int);\nint c(int x) { return a(x); }\n",
    })
    objdir = os.path.join(build, "lib", "CMakeFiles", "t.dir")
    os.makedirs(objdir)
    for f in ("a.c", "b.c", "c.c"):
        subprocess.run([cc, "-c", os.path.join(src, "lib", f), "-o",
                        os.path.join(objdir, f + ".o")], check=True)
    pkg = os.path.join(tmp, "clean")
    allow = os.path.join(tmp, "allow")
    # lib/nccl.c is not compiled here (as coll_nccl.c without CUDA): known all the same.
    write(tmp, {"allow": "# known\nlib/b.c lib/a.c lib/nccl.c\n"})
    common = ["--check", "--source", src, "--package", pkg, build]
    rc, out, found = run("--allow", os.path.join(tmp, "none"), *common)
    assert rc == 1 and found == {frozenset({"lib/a.c", "lib/b.c"})} and "NEW cycle" in out, out
    rc, out, found = run("--allow", allow, *common)
    assert rc == 0 and "known cycle of 2" in out, out
    write(src, {"lib/a.c": "int b(int);\nint c(int);\nint a(int x) { return b(x) + c(x); }\n"})
    subprocess.run([cc, "-c", os.path.join(src, "lib", "a.c"), "-o",
                    os.path.join(objdir, "a.c.o")], check=True)
    rc, out, found = run("--allow", allow, *common)
    assert rc == 1 and found == {frozenset({"lib/a.c", "lib/b.c", "lib/c.c"})}, out


def main():
    with tempfile.TemporaryDirectory() as tmp:
        test_python(tmp)
        test_c(tmp)
    print("file-cycles self-test: ok")


if __name__ == "__main__":
    main()
