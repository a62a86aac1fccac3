"""Runs worker.py under the pshardrun of the virtual environment the tests run in (the one
pip installed pshard into), on ephemeral loopback ports, and reads back what each rank wrote."""
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BIN = os.path.dirname(sys.executable)
# PSHARD_TEST_BUILD_DIR: a CMake build tree whose programs run instead of the venv's (the
# sanitizer pass runs some suites against its AddressSanitizer + UBSan servers).
BUILD = os.environ.get("PSHARD_TEST_BUILD_DIR")
_SUBDIR = {"pshardrun": "tools", "pshardctl": "tools", "pshard-coordinator": "coordinator",
           "pshard-server": "shard_server"}


def program(name):
    """The path of a pshard program (pshardrun, pshard-server, ...) the tests run."""
    return os.path.join(BUILD, _SUBDIR[name], name) if BUILD else os.path.join(BIN, name)


def pshardrun(nproc, script, args, *, timeout=300, extra=(), env=None):
    """Runs pshardrun --nproc N -- python script args...; returns the CompletedProcess."""
    cmd = [program("pshardrun"), "--nproc", str(nproc), *extra, "--",
           sys.executable, script, *args]
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    if env:
        e.update(env)
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=e, stdin=subprocess.DEVNULL)


def run_gloo(world, argv, timeout=300):
    """Runs python argv... as world plain processes on torch's gloo (RANK / WORLD_SIZE in the
    environment, no pshard cluster: the scripts compared with their pshard runs); asserts that
    each exits 0."""
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   PYTHONDONTWRITEBYTECODE="1")
        for k in ("PSHARD_SERVER", "PSHARD_COORDINATOR"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      stdin=subprocess.DEVNULL))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)


@pytest.fixture
def train(tmp_path):
    """train(cfg, world) -> (results per rank, final state dict or None, output)."""
    def run(cfg, world, *, expect_ok=True, extra=(), timeout=300, env=None):
        out = tmp_path / f"run-{world}-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        cfgfile = out / "cfg.json"
        cfgfile.write_text(json.dumps(cfg))
        p = pshardrun(world, os.path.join(HERE, "worker.py"), [str(cfgfile), str(out)],
                      extra=extra, timeout=timeout, env=env)
        if expect_ok:
            assert p.returncode == 0, p.stdout[-6000:]
        results = []
        for r in range(world):
            f = out / f"rank-{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else None)
        final = None
        if (out / "final.pt").exists():
            import torch
            final = torch.load(out / "final.pt")
        return results, final, p.stdout
    return run


def stop_procs(procs):
    """Stops what a test started: SIGTERM first, so that a shard server removes its shared memory
    (one killed with -9 leaves it in /dev/shm until the next server starts), then SIGKILL what
    has not exited within 20 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def metric(text, name, **labels):
    """The value of metric name with (at least) these labels in a /metrics text, or None."""
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


class Cluster:
    """A coordinator and N shard servers started by hand (not by pshardrun, which stops every
    trainer when one dies), on ephemeral loopback ports; trainers are started with
    trainer_env(rank). stop() kills what it started, by PID."""

    def __init__(self, tmp, n, lease_ms=2000, heartbeat_ms=500, rdzv_file=None, metrics=False,
                 server_args=(), env=None):
        """server_args: more flags for every shard server; env: more variables for the
        servers and the trainers."""
        self.n, self.tmp, self.procs = n, tmp, []
        self.env = dict(os.environ, **(env or {}))
        self.lease_ms = lease_ms
        extra = ["--rdzv-file", str(rdzv_file)] if rdzv_file else []

        def mx(name):  # with metrics: a /metrics listener on a free port, written to a file
            return (["--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                     str(tmp / f"{name}.mport")] if metrics else [])
        self._start([program("pshard-coordinator"), "--listen", "127.0.0.1:0",
                     "--port-file", str(tmp / "coord.port"), "--world-size", str(n),
                     "--lease-ms", str(lease_ms), "--heartbeat-ms", str(heartbeat_ms), *extra,
                     *mx("coord")], tmp / "coord.log")
        self.coord = "127.0.0.1:" + self._port(tmp / "coord.port")
        for r in range(n):
            self._start([program("pshard-server"), "--coordinator", self.coord,
                         "--listen", "127.0.0.1:0", "--port-file", str(tmp / f"s{r}.port"),
                         "--name", f"pshard-server-{r}", *mx(f"s{r}"), *server_args],
                        tmp / f"s{r}.log")
        self.servers = ["127.0.0.1:" + self._port(tmp / f"s{r}.port") for r in range(n)]
        if metrics:
            self.metrics = {k: "127.0.0.1:" + self._port(tmp / f"{k}.mport")
                            for k in ["coord"] + [f"s{r}" for r in range(n)]}

    def scrape(self, who):
        """The /metrics text of "coord" or "sR" (needs metrics=True)."""
        import urllib.request
        with urllib.request.urlopen(f"http://{self.metrics[who]}/metrics", timeout=10) as r:
            return r.read().decode()

    def ctl(self, *args):
        """pshardctl --coordinator COORD ARGS -> CompletedProcess (text)."""
        return subprocess.run([program("pshardctl"), "--coordinator", self.coord, *args],
                              capture_output=True, text=True, timeout=60)

    def _start(self, cmd, log):
        with open(log, "ab") as f:
            self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=self.env))

    def _port(self, path, timeout=20.0):
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}")
            time.sleep(0.02)
        raise TimeoutError(f"no port in {path} after {timeout} s")

    def trainer_env(self, rank):
        return dict(self.env, RANK=str(rank), WORLD_SIZE=str(self.n), LOCAL_RANK=str(rank),
                    PSHARD_SERVER=self.servers[rank], PSHARD_COORDINATOR=self.coord,
                    OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")

    def stop(self):
        stop_procs(self.procs)


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(n, **kw):
        c = Cluster(tmp_path, n, **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.stop()


def run_trainers(c, script, args, out):
    """Runs script (in this folder) with args as every rank of cluster c, each logging to
    out/tR.log; waits for all of them (at most 120 s each), killing any left over."""
    logs = [open(out / f"t{r}.log", "w") for r in range(c.n)]
    trainers = [subprocess.Popen([sys.executable, os.path.join(HERE, script), *args],
                                 env=c.trainer_env(r), stdout=logs[r], stderr=subprocess.STDOUT)
                for r in range(c.n)]
    try:
        for t in trainers:
            t.wait(timeout=120)
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        for f in logs:
            f.close()


def check_peer_lost(out, rank, lost):
    """Rank rank's result (out/rank-R.json, which out/killed stamps the death of rank lost
    against) is a PeerLostError naming lost, within the lease (2 s) + 1 s, plus 2 s of slack
    for a loaded machine."""
    killed_at = float((out / "killed").read_text())
    res = json.loads((out / f"rank-{rank}.json").read_text())
    e = res["error"]
    assert e is not None and e["type"] == "PeerLostError", (rank, res)
    assert f"trainer-{lost}" in e["message"] or f"rank {lost}" in e["message"], e
    assert e["time"] - killed_at <= (2000 + 1000 + 2000) / 1000, (e["time"] - killed_at, e)


def check_killed_trainer_named(c, tmp_path, cfg):
    """Runs worker.py on every rank of cluster c with cfg, whose kill_rank trainer kills itself
    mid-step (kill_step): every other rank must fail with PeerLostError naming it."""
    out = tmp_path / "out"
    out.mkdir()
    cfgfile = out / "cfg.json"
    cfgfile.write_text(json.dumps(cfg))
    run_trainers(c, "worker.py", [str(cfgfile), str(out)], out)
    for r in range(c.n):
        if r != cfg["kill_rank"]:
            check_peer_lost(out, r, cfg["kill_rank"])
