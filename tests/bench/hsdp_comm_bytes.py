"""Where an HSDP model's bytes travel: runs the test MLP (tests/python/worker.py) on 4 ranks
for 8 steps with a (2, 2) mesh and without one, with PSHARD_LOG_SUBSYS=coll, and sums server
0's collectives per communicator and operation (the world ring is "shard", HSDP's are
"hsdp<attempt>s<replica>" for a replica's shard ranks and "hsdp<attempt>r<index>" across the
replicas). Prints a figure; asserts nothing.

Usage: build/torch-venv/bin/python tests/bench/hsdp_comm_bytes.py"""
import collections
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from conftest import pshardrun  # noqa: E402

ES = {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8, "fp64": 8, "int32": 4, "uint8": 1}
LINE = re.compile(r"coll (\w+) seq \d+ (\w+) .*?total (\d+).*?\(communicator (\S+)")


def main():
    worker = os.path.join(HERE, "..", "python", "worker.py")
    for mesh in ([2, 2], None):
        d = tempfile.mkdtemp()
        cfg = {"model": "mlp", "steps": 8, "lr": 1e-2, "two_groups": True, "scheduler": True}
        if mesh:
            cfg["mesh"] = mesh
        with open(os.path.join(d, "cfg.json"), "w") as f:
            json.dump(cfg, f)
        p = pshardrun(4, worker, [os.path.join(d, "cfg.json"), d],
                      env={"PSHARD_LOG": "info", "PSHARD_LOG_SUBSYS": "coll"})
        agg = collections.defaultdict(lambda: [0, 0])
        for line in p.stdout.splitlines():
            m = LINE.search(line) if line.startswith("[server 0]") else None
            if not m:
                continue
            op, dt, total, comm = m.groups()
            if comm.startswith("hsdp"):
                comm = re.sub(r"\d+", "N", comm)
            agg[(comm, op)][0] += 1
            agg[(comm, op)][1] += int(total) * ES.get(dt, 4)
        print(f"mesh {mesh or 'none (FSDP over the world)'}: exit {p.returncode}")
        for (comm, op), (n, b) in sorted(agg.items()):
            print(f"  {comm:10s} {op:15s} {n:5d} ops {b:10d} bytes (every rank's elements)")


if __name__ == "__main__":
    main()
