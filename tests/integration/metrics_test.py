"""Prometheus metrics of pshard-coordinator and pshard-server, read by a real scraper's parser.

Starts a coordinator and two shard servers with --metrics-listen 127.0.0.1:0 (ports read back
from --metrics-port-file), attaches a trainer to each shard server over gRPC (messages from the
server's own reflection, scratch memory in /dev/shm), runs all-reduces on both ranks, then
scrapes /metrics over HTTP and parses it with PyPI's prometheus_client
(text_string_to_metric_families): names, types, labels (one server's name holds a quote and a
backslash, so escaping is tested by the parser), counter and histogram values. Also: 404, HEAD,
405 for POST, an oversized request refused while the endpoint keeps serving. Everything is
stopped by PID.

Usage: python metrics_test.py PATH/TO/pshard-coordinator PATH/TO/pshard-server [unittest opts]
"""

import http.client
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402
from google.protobuf import descriptor_pool, message_factory  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import proto_reflection_descriptor_database as refl_db  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from coordinator_proc import die_with_parent  # noqa: E402

COORDINATOR = SERVER = None  # from argv
START_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 20.0
SCRATCH = 4096
NCOLL = 3
ODD_NAME = 'mx-1"q\\z'  # printable, no spaces: a valid member name that needs escaping


def wait_port_file(path, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("%s exited with %d before serving" % (proc.args, proc.returncode))
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise AssertionError("no port file %s after %.0f s" % (path, timeout))


def stop(proc):
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def scrape(port, path="/metrics"):
    """The parsed families of one scrape: {family name: Metric}."""
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
        assert r.status == 200, r.status
        ctype = r.headers.get("Content-Type")
        assert ctype.startswith("text/plain; version=0.0.4"), ctype
        text = r.read().decode("utf-8")
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def sample(families, family, sample_name=None, **labels):
    """The value of the one sample of family with exactly these labels (and name)."""
    f = families[family]
    hits = [s for s in f.samples if s.labels == labels
            and (sample_name is None or s.name == sample_name)]
    assert len(hits) == 1, (family, sample_name, labels, f.samples)
    return hits[0].value


class Cluster:
    """A coordinator and two shard servers, all with metrics listeners."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pshard-metrics-")
        self.procs = []
        self.logs = []

    def spawn(self, name, cmd):
        log = open(os.path.join(self.tmp.name, name + ".log"), "wb")
        self.logs.append(log)
        p = subprocess.Popen(die_with_parent() + cmd, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def start(self):
        d = self.tmp.name
        self.coord = self.spawn("coordinator", [
            COORDINATOR, "--listen", "127.0.0.1:0", "--port-file", d + "/c.port",
            "--world-size", "2", "--metrics-listen", "127.0.0.1:0",
            "--metrics-port-file", d + "/c.mport"])
        self.coord_port = wait_port_file(d + "/c.port", self.coord, 15)
        self.coord_mport = wait_port_file(d + "/c.mport", self.coord, 1)
        self.servers, self.grpc_ports, self.mports = [], [], []
        for i, name in enumerate(["mx-0", ODD_NAME]):
            p = self.spawn("server-%d" % i, [
                SERVER, "--coordinator", "127.0.0.1:%d" % self.coord_port, "--name", name,
                "--port-file", "%s/s%d.port" % (d, i), "--metrics-listen", "127.0.0.1:0",
                "--metrics-port-file", "%s/s%d.mport" % (d, i)])
            self.servers.append(p)
        for i, p in enumerate(self.servers):
            self.grpc_ports.append(wait_port_file("%s/s%d.port" % (d, i), p, 15))
            self.mports.append(wait_port_file("%s/s%d.mport" % (d, i), p, 1))
        self.channels = [grpc.insecure_channel("127.0.0.1:%d" % port)
                         for port in self.grpc_ports]
        deadline = time.monotonic() + START_TIMEOUT_S
        for ch in self.channels:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service="pshard.ShardServer"),
                                   timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError("shard servers never became SERVING:\n" + self.log_text())
                time.sleep(0.02)
        db = refl_db.ProtoReflectionDescriptorDatabase(self.channels[0])
        self.pool = descriptor_pool.DescriptorPool(db)
        self.service = self.pool.FindServiceByName("pshard.ShardServer")
        return self

    def call(self, i, method, **fields):
        m = self.service.methods_by_name[method]
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        fn = self.channels[i].unary_unary("/pshard.ShardServer/" + method,
                                          request_serializer=req_cls.SerializeToString,
                                          response_deserializer=resp_cls.FromString)
        return fn(req_cls(**fields), timeout=RPC_TIMEOUT_S)

    def log_text(self):
        out = []
        for log in self.logs:
            log.flush()
            with open(log.name, "rb") as f:
                out.append("== %s ==\n%s" % (log.name, f.read().decode(errors="replace")[-4000:]))
        return "\n".join(out)

    def stop(self):
        for ch in getattr(self, "channels", []):
            ch.close()
        codes = [stop(p) for p in reversed(self.procs)]
        for log in self.logs:
            log.close()
        self.tmp.cleanup()
        return codes


class MetricsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster()
        cls.shm = []
        try:
            cls.cluster.start()
            cls.run_collectives()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for name, mm in cls.shm:
            mm.close()
            try:
                os.unlink("/dev/shm" + name)
            except FileNotFoundError:
                pass
        codes = cls.cluster.stop()
        assert all(c == 0 for c in codes), "a process did not exit 0: %s" % codes

    @classmethod
    def run_collectives(cls):
        c = cls.cluster
        sessions = []
        for i in range(2):
            rank = c.call(i, "Status").rank
            name = "/pshard-test-metrics-%d-%d" % (os.getpid(), i)
            fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, SCRATCH)
            mm = mmap.mmap(fd, SCRATCH)
            os.close(fd)
            cls.shm.append((name, mm))
            mm[0:16] = struct.pack("<4f", 1.0 + rank, 2.0, 3.0, 4.0)
            r = c.call(i, "Attach", rank=rank, shm_name=name, shm_bytes=SCRATCH,
                       trainer_name="metrics_test")
            sessions.append(r.session)
        errors = []

        def run(i):
            try:
                for _ in range(NCOLL):
                    c.call(i, "Collective", session=sessions[i], op=3, dtype=0, count=4,
                           send_offset=0, recv_offset=64)
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for _, mm in cls.shm:
            got = struct.unpack("<4f", mm[64:80])
            assert got == (3.0, 4.0, 6.0, 8.0), got

    # ---- the shard servers -------------------------------------------------------------------

    def test_names_follow_prometheus_rules(self):
        for port in self.cluster.mports + [self.cluster.coord_mport]:
            families, text = scrape(port)
            self.assertGreater(len(families), 20)
            for name, f in families.items():
                self.assertTrue(name.startswith("pshard_"), name)
                self.assertIn(f.type, ("counter", "gauge", "histogram"), name)
                self.assertTrue(f.documentation, name)
                for s in f.samples:
                    if f.type == "counter":
                        self.assertTrue(s.name.endswith("_total"), s.name)
                    for label in s.labels:
                        self.assertRegex(label, r"^[a-zA-Z_][a-zA-Z0-9_]*$")
            # Durations in seconds, sizes in bytes: no other unit suffix.
            for unit in ("_ms", "_milliseconds", "_kb", "_mib"):
                self.assertNotIn(unit + " ", text)
                self.assertNotIn(unit + "{", text)

    def test_shard_collective_counters_bytes_and_histogram(self):
        for port in self.cluster.mports:
            fam, _ = scrape(port)
            self.assertEqual(sample(fam, "pshard_shard_ops", op="all_reduce"), NCOLL)
            self.assertEqual(sample(fam, "pshard_shard_op_errors", op="all_reduce"), 0)
            self.assertEqual(sample(fam, "pshard_shard_op_bytes", op="all_reduce"), NCOLL * 16)
            self.assertEqual(sample(fam, "pshard_shard_ops", op="gather"), 0)
            self.assertEqual(sample(fam, "pshard_shard_ops", op="step"), 0)
            h = fam["pshard_shard_op_duration_seconds"]
            self.assertEqual(h.type, "histogram")
            buckets = [(float(s.labels["le"]), s.value) for s in h.samples
                       if s.name.endswith("_bucket") and s.labels["op"] == "all_reduce"]
            self.assertGreater(len(buckets), 5)
            self.assertEqual(buckets[-1][0], float("inf"))
            values = [v for _, v in buckets]
            self.assertEqual(values, sorted(values), "buckets must be cumulative")
            self.assertEqual(values[-1], NCOLL)
            self.assertEqual(sample(fam, "pshard_shard_op_duration_seconds",
                                    "pshard_shard_op_duration_seconds_count", op="all_reduce"),
                             NCOLL)
            total = sample(fam, "pshard_shard_op_duration_seconds",
                           "pshard_shard_op_duration_seconds_sum", op="all_reduce")
            self.assertGreater(total, 0)
            self.assertLess(total, 60)

    def test_shard_state_rpc_and_process(self):
        ranks = set()
        for i, port in enumerate(self.cluster.mports):
            fam, _ = scrape(port)
            ranks.add(sample(fam, "pshard_shard_rank"))
            self.assertEqual(sample(fam, "pshard_shard_world_size"), 2)
            self.assertEqual(sample(fam, "pshard_shard_ring_up"), 1)
            self.assertEqual(sample(fam, "pshard_shard_serving"), 1)
            self.assertEqual(sample(fam, "pshard_shard_trainer_attached"), 1)
            self.assertEqual(sample(fam, "pshard_shard_joined"), 0)
            self.assertEqual(sample(fam, "pshard_shard_step"), 0)
            self.assertGreater(sample(fam, "pshard_shard_generation"), 0)
            self.assertGreaterEqual(sample(fam, "pshard_shard_lease_age_seconds"), 0)
            self.assertLess(sample(fam, "pshard_shard_lease_age_seconds"),
                            sample(fam, "pshard_shard_lease_seconds"))
            name = ["mx-0", ODD_NAME][i]
            self.assertEqual(sample(fam, "pshard_shard_info", name=name, backend="tcp",
                                    offload="none", version=self.version(fam)), 1)
            calls = sample(fam, "pshard_rpc_calls", service="pshard.ShardServer",
                           method="Collective")
            self.assertEqual(calls, NCOLL)
            self.assertEqual(sample(fam, "pshard_rpc_errors", service="pshard.ShardServer",
                                    method="Collective"), 0)
            self.assertEqual(sample(fam, "pshard_rpc_calls", service="pshard.ShardServer",
                                    method="Attach"), 1)
            self.assertGreaterEqual(sample(fam, "pshard_rpc_calls",
                                           service="grpc.health.v1.Health", method="Check"), 1)
            self.assertEqual(sample(fam, "pshard_rpc_workers"), 4)
            self.assertEqual(sample(fam, "pshard_rpc_queued_calls"), 0)
            self.assertGreater(sample(fam, "pshard_process_resident_memory_bytes"), 1 << 20)
            self.assertGreater(sample(fam, "pshard_process_open_fds"), 3)
        self.assertEqual(ranks, {0, 1})

    @staticmethod
    def version(fam):
        return fam["pshard_shard_info"].samples[0].labels["version"]

    # ---- the coordinator ---------------------------------------------------------------------

    def test_coordinator_membership_generation_store(self):
        fam, _ = scrape(self.cluster.coord_mport)
        job = "default"  # no pshard-job header
        self.assertGreaterEqual(sample(fam, "pshard_coordinator_jobs"), 1)
        self.assertEqual(sample(fam, "pshard_coordinator_cluster_state", job=job,
                                state="formed"), 1)
        self.assertEqual(sample(fam, "pshard_coordinator_cluster_state", job=job,
                                state="forming"), 0)
        self.assertEqual(sample(fam, "pshard_coordinator_world_size", job=job), 2)
        self.assertEqual(sample(fam, "pshard_coordinator_members", job=job,
                                role="shard_server"), 2)
        self.assertGreater(sample(fam, "pshard_coordinator_generation", job=job), 0)
        self.assertGreater(sample(fam, "pshard_coordinator_formed_generation", job=job), 0)
        self.assertGreater(sample(fam, "pshard_coordinator_store_keys", job=job), 0)  # rings
        self.assertGreaterEqual(sample(fam, "pshard_coordinator_store_waiters", job=job), 0)
        lease = sample(fam, "pshard_coordinator_lease_seconds")
        names = set()
        for s in fam["pshard_coordinator_member_lease_age_seconds"].samples:
            self.assertEqual(s.labels["job"], job)
            names.add(s.labels["name"])
            self.assertLess(s.value, lease)
        # The parser unescaped the quote and the backslash the writer escaped.
        self.assertEqual(names, {"mx-0", ODD_NAME})
        self.assertGreaterEqual(sample(fam, "pshard_rpc_calls", service="pshard.Coordinator",
                                       method="Register"), 2)
        self.assertGreater(sample(fam, "pshard_rpc_calls", service="pshard.Coordinator",
                                  method="Heartbeat"), 0)
        self.assertEqual(sample(fam, "pshard_coordinator_joined_ranks", job=job), 0)

    # ---- HTTP behaviour ----------------------------------------------------------------------

    def request(self, port, method, path, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read(), r.getheader("Allow")
        finally:
            conn.close()

    def test_http_paths_methods_and_limits(self):
        for port in (self.cluster.mports[0], self.cluster.coord_mport):
            self.assertEqual(self.request(port, "GET", "/")[0], 404)
            self.assertEqual(self.request(port, "GET", "/metricsx")[0], 404)
            status, body, _ = self.request(port, "HEAD", "/metrics")
            self.assertEqual((status, body), (200, b""))
            # On the wire: GET's Content-Length, and not one byte of body after the headers.
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                raw = b""
                while chunk := s.recv(65536):
                    raw += chunk
            head, _, rest = raw.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.1 200"), raw[:200])
            self.assertEqual(rest, b"", raw[:300])
            length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
            self.assertEqual(len(length), 1, head)
            self.assertGreater(int(length[0].split(b":")[1]), 100, head)
            status, _, allow = self.request(port, "POST", "/metrics")
            self.assertEqual(status, 405)
            self.assertEqual(allow, "GET, HEAD")
            # 64 KiB of headers: refused or cut off, never served, and the endpoint lives on.
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536
                          + b"\r\n\r\n")
                try:
                    reply = s.recv(64)
                except (ConnectionResetError, socket.timeout):
                    reply = b""
            self.assertFalse(reply.startswith(b"HTTP/1.1 200"), reply)
            self.assertEqual(scrape(port)[0]["pshard_process_open_fds"].type, "gauge")

    def test_connection_flood_is_bounded(self):
        """/metrics is unauthenticated: 300 connections that each send a byte and then trickle
        (what locked gRPC out when each held a descriptor) are held to a small number, each
        for a bounded time; gRPC (health, on the same process) answers meanwhile, the process's
        descriptors stay bounded, refusals are logged once, and scraping works afterwards."""
        port = self.cluster.mports[0]
        pid = self.cluster.servers[0].pid
        fds_before = len(os.listdir("/proc/%d/fd" % pid))
        socks = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                try:
                    s.sendall(b"G")
                except OSError:
                    pass  # refused and closed at once
                socks.append(s)
            stub = health_pb2_grpc.HealthStub(self.cluster.channels[0])
            r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)
            held = len(os.listdir("/proc/%d/fd" % pid)) - fds_before
            self.assertLess(held, 64, "the server holds %d more descriptors" % held)
            # Those it kept are closed within the per-connection deadline, trickle or not.
            t0 = time.monotonic()
            alive = list(socks)
            while alive and time.monotonic() - t0 < 60:
                still = []
                for s in alive:
                    try:
                        s.sendall(b"E")
                        s.settimeout(0.01)
                        if s.recv(1) == b"":
                            continue  # closed by the server
                    except (socket.timeout, BlockingIOError):
                        pass
                    except OSError:
                        continue  # reset: closed
                    still.append(s)
                alive = still
                time.sleep(0.5)
            self.assertEqual(alive, [], "connections still open after %.0f s" %
                             (time.monotonic() - t0))
        finally:
            for s in socks:
                s.close()
        self.assertEqual(scrape(port)[0]["pshard_process_open_fds"].type, "gauge")
        log = self.cluster.log_text()
        self.assertIn("connections refused", log)
        self.assertLessEqual(log.count("connections refused"), 2, log[-3000:])


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: %s PATH/TO/pshard-coordinator PATH/TO/pshard-server" % sys.argv[0])
    COORDINATOR = os.path.abspath(sys.argv.pop(1))
    SERVER = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
