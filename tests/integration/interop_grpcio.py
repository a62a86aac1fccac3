"""Interoperability of pshard-coordinator with an independent gRPC implementation (Python grpcio).

Each test starts the real coordinator binary on an ephemeral loopback port, reaches it the way
grpcurl does (health checking, server reflection, messages built only from reflected
descriptors) and kills it by PID afterwards.

Usage: python interop_grpcio.py PATH/TO/pshard-coordinator [unittest options]
"""

import os
import queue
import sys
import threading
import time
import unittest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc loads: no GOAWAY chatter

import grpc  # noqa: E402
from google.protobuf import descriptor_pool, message_factory  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import proto_reflection_descriptor_database as refl_db  # noqa: E402

from coordinator_proc import CoordinatorProcess  # noqa: E402
from coordinator_proc import STOP_TIMEOUT_S  # noqa: E402

COORDINATOR = None  # set from argv in __main__
RPC_TIMEOUT_S = 10.0
MIB = 1024 * 1024

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Coordinator(CoordinatorProcess):
    """One pshard-coordinator process on 127.0.0.1:<ephemeral>, stopped by PID."""

    def __init__(self, *args, token=None):
        super().__init__(COORDINATOR, args, token, "pshard-interop-")
        self._pool = None
        self._pool_lock = threading.Lock()
        self._db = None

    def start(self):
        deadline = self.launch()
        # Ready once health says SERVING (wait_for_ready bounded by the deadline).
        stub = health_pb2_grpc.HealthStub(self.channel())
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("health never answered SERVING:\n" + self.log_text())
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=left,
                                  wait_for_ready=True)
                if resp.status == SERVING:
                    return self
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            time.sleep(0.01)

    # ---- channels and calls ---------------------------------------------------------------

    def channel(self, separate=False, options=()):
        """A channel to the coordinator; separate=True gets its own TCP connection."""
        opts = list(options)
        if separate:
            opts.append(("grpc.use_local_subchannel_pool", 1))
        ch = grpc.insecure_channel(self.target, options=opts)
        self.channels.append(ch)
        return ch

    def metadata(self):
        return (("authorization", "Bearer " + self.token),) if self.token else ()

    @property
    def pool(self):
        """A DescriptorPool fed only by the server's reflection service (grpcurl's flow)."""
        with self._pool_lock:  # tests call from several threads
            if self._pool is None:
                self._db = refl_db.ProtoReflectionDescriptorDatabase(self.channel())
                pool = descriptor_pool.DescriptorPool(self._db)
                # Loads pshard/coordinator.proto whole, so that later lookups from other
                # threads only read what is already there.
                pool.FindServiceByName("pshard.Coordinator")
                self._pool = pool
            return self._pool

    def _unary(self, method, channel):
        """A callable for unary pshard.Coordinator/<method> and its request class."""
        m = self.pool.FindServiceByName("pshard.Coordinator").methods_by_name[method]
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        fn = (channel or self.channel()).unary_unary(
            "/pshard.Coordinator/" + method, request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString)
        return fn, req_cls

    def call(self, method, channel=None, metadata=None, timeout=RPC_TIMEOUT_S, **fields):
        """Unary call with reflected message classes; returns the reply or raises RpcError."""
        fn, req_cls = self._unary(method, channel)
        md = self.metadata() if metadata is None else metadata
        return fn(req_cls(**fields), timeout=timeout, metadata=md)

    def call_future(self, method, channel=None, timeout=RPC_TIMEOUT_S, **fields):
        fn, req_cls = self._unary(method, channel)
        return fn.future(req_cls(**fields), timeout=timeout, metadata=self.metadata())

    def raw(self, path, payload, metadata=None, timeout=RPC_TIMEOUT_S, channel=None):
        """Unary call with raw request bytes; returns the raw reply bytes."""
        fn = (channel or self.channel()).unary_unary(path)
        md = self.metadata() if metadata is None else metadata
        return fn(payload, timeout=timeout, metadata=md)

    def watch(self, channel=None, timeout=30.0):
        """Opens pshard.Coordinator/Watch; returns a StreamReader of ClusterEvents."""
        m = self.pool.FindServiceByName("pshard.Coordinator").methods_by_name["Watch"]
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        fn = (channel or self.channel()).unary_stream(
            "/pshard.Coordinator/Watch", request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString)
        return StreamReader(fn(req_cls(), timeout=timeout, metadata=self.metadata()))

    def register(self, name, role=None, channel=None, **extra):
        role_value = self.pool.FindEnumTypeByName("pshard.Role").values_by_name[
            role or "SHARD_SERVER"].number
        fields = dict(role=role_value, name=name, address="127.0.0.1:1", node="node-a",
                      device="cpu")
        fields.update(extra)
        return self.call("Register", channel=channel, **fields)

    def health(self, service="", channel=None):
        stub = health_pb2_grpc.HealthStub(channel or self.channel())
        return stub.Check(health_pb2.HealthCheckRequest(service=service),
                          timeout=RPC_TIMEOUT_S).status

    def state_name(self, number):
        return self.pool.FindEnumTypeByName("pshard.ClusterState").values_by_number[number].name


class StreamReader:
    """Reads a server stream on a thread so that the test can wait with a timeout."""

    _END = object()

    def __init__(self, call):
        self.call = call
        self.items = queue.Queue()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for item in self.call:
                self.items.put(item)
        except grpc.RpcError as e:
            self.error = e
        self.items.put(self._END)

    def next(self, timeout=RPC_TIMEOUT_S):
        try:
            item = self.items.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no stream message within %.1f s" % timeout)
        if item is self._END:
            raise AssertionError("stream ended: %r" % (self.error,))
        return item

    def wait_for(self, predicate, timeout=RPC_TIMEOUT_S):
        """Returns the first message satisfying predicate; fails after timeout seconds."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("no matching stream message; saw %r" % seen)
            item = self.next(left)
            if predicate(item):
                return item
            seen.append(item)

    def wait_end(self, timeout=RPC_TIMEOUT_S):
        """Waits for the stream to end; returns its RpcError or None."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("stream did not end within %.1f s" % timeout)
            try:
                item = self.items.get(timeout=left)
            except queue.Empty:
                continue
            if item is self._END:
                return self.error

    def close(self):
        self.call.cancel()
        self.thread.join(timeout=5)


class CoordinatorTest(unittest.TestCase):
    """Base class: start_coordinator() starts one and registers its cleanup."""

    def start_coordinator(self, *args, token=None):
        c = Coordinator(*args, token=token)
        self.addCleanup(c.cleanup)
        c.start()
        return c

    def assertRpcError(self, code, fn, *args, contains=(), **kwargs):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(*args, **kwargs)
        err = cm.exception
        self.assertEqual(err.code(), code, "details: %r" % err.details())
        details = err.details() or ""
        for text in ([contains] if isinstance(contains, str) else contains):
            self.assertIn(text, details)
        return err

    def assertAlive(self, c):
        """The server still answers health and a real call after a bad request."""
        self.assertEqual(c.health(""), SERVING)
        self.assertGreater(c.call("StoreAdd", key="alive-probe", delta=1).value, 0)


# ---------------------------------------------------------------------------------------------
# 1. Health


class HealthTest(CoordinatorTest):

    def test_check_services(self):
        c = self.start_coordinator("--world-size", "2")
        self.assertEqual(c.health(""), SERVING)
        self.assertEqual(c.health("pshard.Coordinator"), SERVING)
        self.assertEqual(c.health("pshard.Cluster"), NOT_SERVING)
        c.register("shard-0")
        self.assertEqual(c.health("pshard.Cluster"), NOT_SERVING, "one of two registered")
        c.register("shard-1")
        self.assertEqual(c.health("pshard.Cluster"), SERVING)

    def test_check_unknown_service_is_not_found(self):
        c = self.start_coordinator()
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.health, "no.such.Service",
                            contains="no.such.Service")
        self.assertAlive(c)

    def test_watch_cluster_formation(self):
        c = self.start_coordinator("--world-size", "2")
        stub = health_pb2_grpc.HealthStub(c.channel())
        watch = StreamReader(stub.Watch(health_pb2.HealthCheckRequest(service="pshard.Cluster"),
                                        timeout=30))
        self.addCleanup(watch.close)
        self.assertEqual(watch.next().status, NOT_SERVING)
        c.register("shard-0", channel=c.channel(separate=True))
        c.register("shard-1", channel=c.channel(separate=True))
        self.assertEqual(watch.next().status, SERVING)

    def test_sigterm_exits_zero_with_open_streams(self):
        c = self.start_coordinator()
        stub = health_pb2_grpc.HealthStub(c.channel())
        health_watch = StreamReader(stub.Watch(health_pb2.HealthCheckRequest(service=""),
                                               timeout=30))
        self.addCleanup(health_watch.close)
        self.assertEqual(health_watch.next().status, SERVING)
        cluster_watch = c.watch()
        self.addCleanup(cluster_watch.close)
        cluster_watch.next()
        pending = c.call_future("StoreWait", keys=["never-set"], timeout_ms=60000, timeout=30)
        wait_until(lambda: c.call("Status").store_waiters == 1, "the store wait is pending")
        started = time.monotonic()
        self.assertEqual(c.stop(), 0, c.log_text())
        self.assertLess(time.monotonic() - started, STOP_TIMEOUT_S)
        # Open streams and waits end rather than hang.
        cluster_watch.wait_end()
        health_watch.wait_end()
        with self.assertRaises(grpc.RpcError) as cm:
            pending.result(timeout=RPC_TIMEOUT_S)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE,
                         cm.exception.details())


def wait_until(predicate, what, timeout=RPC_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting until " + what)
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# 2. Reflection


class ReflectionTest(CoordinatorTest):

    SERVICES = ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection", "pshard.Coordinator"]

    def test_list_services_v1alpha(self):
        c = self.start_coordinator()
        db = refl_db.ProtoReflectionDescriptorDatabase(c.channel())
        services = db.get_services()
        for s in self.SERVICES:
            self.assertIn(s, services)

    def test_descriptor_pool_finds_service_and_methods(self):
        c = self.start_coordinator()
        svc = c.pool.FindServiceByName("pshard.Coordinator")
        self.assertEqual(
            sorted(m.name for m in svc.methods),
            sorted(["Register", "Heartbeat", "Leave", "Watch", "StoreSet", "StoreGet",
                    "StoreWait", "StoreCompareSet", "StoreAdd", "StoreDelete", "Status",
                    "ReportJoin"]))
        register = c.pool.FindMethodByName("pshard.Coordinator.Register")
        self.assertEqual(register.input_type.full_name, "pshard.RegisterRequest")
        self.assertEqual(register.output_type.full_name, "pshard.MemberView")
        watch = c.pool.FindMethodByName("pshard.Coordinator.Watch")
        self.assertTrue(watch.server_streaming)
        self.assertFalse(watch.client_streaming)
        fields = c.pool.FindMessageTypeByName("pshard.RegisterRequest").fields_by_name
        self.assertEqual(fields["name"].number, 2)
        self.assertEqual(fields["role"].enum_type.full_name, "pshard.Role")

    def test_file_containing_symbol(self):
        c = self.start_coordinator()
        for symbol in ("pshard.Coordinator", "pshard.RegisterRequest",
                       "pshard.Coordinator.Register"):
            # A fresh database each time: one answers from files it already fetched, so a
            # shared one would never ask the server about the later symbols.
            db = refl_db.ProtoReflectionDescriptorDatabase(c.channel())
            fd = db.FindFileContainingSymbol(symbol)
            self.assertEqual(fd.name, "pshard/coordinator.proto", symbol)
            self.assertEqual(fd.package, "pshard")
        db = refl_db.ProtoReflectionDescriptorDatabase(c.channel())
        with self.assertRaises(KeyError):
            db.FindFileContainingSymbol("pshard.NoSuchMessage")

    def test_v1_list_services_with_raw_bytes(self):
        c = self.start_coordinator()
        # Build grpc.reflection.v1's classes from what the server itself reflects.
        req_cls = message_factory.GetMessageClass(
            c.pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
        resp_cls = message_factory.GetMessageClass(
            c.pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
        fn = c.channel().stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
        requests = [req_cls(list_services="*").SerializeToString(),
                    req_cls(file_containing_symbol="pshard.StoreSetRequest").SerializeToString(),
                    req_cls(file_containing_symbol="no.such.Symbol").SerializeToString()]
        replies = [resp_cls.FromString(b) for b in fn(iter(requests), timeout=RPC_TIMEOUT_S)]
        self.assertEqual(len(replies), 3)
        listed = [s.name for s in replies[0].list_services_response.service]
        for s in self.SERVICES:
            self.assertIn(s, listed)
        self.assertEqual(replies[0].original_request.list_services, "*")
        self.assertTrue(replies[1].file_descriptor_response.file_descriptor_proto)
        fdp_cls = message_factory.GetMessageClass(
            descriptor_pool.Default().FindMessageTypeByName("google.protobuf.FileDescriptorProto"))
        names = [fdp_cls.FromString(b).name
                 for b in replies[1].file_descriptor_response.file_descriptor_proto]
        self.assertIn("pshard/coordinator.proto", names)
        self.assertEqual(replies[2].error_response.error_code, grpc.StatusCode.NOT_FOUND.value[0])


# ---------------------------------------------------------------------------------------------
# 3. pshard methods through reflected message classes


class CoordinatorMethodsTest(CoordinatorTest):

    def test_register_heartbeat_forms_cluster(self):
        c = self.start_coordinator("--world-size", "2", "--lease-ms", "7000",
                                   "--heartbeat-ms", "700")
        first = c.register("shard-a")
        self.assertEqual(len(first.member_id), 32)
        self.assertEqual(first.rank, -1, "no rank before the cluster formed")
        self.assertEqual(first.world_size, 0)
        self.assertEqual(c.state_name(first.state), "FORMING")
        self.assertEqual(first.lease_ms, 7000)
        self.assertEqual(first.heartbeat_ms, 700)
        second = c.register("shard-b")
        self.assertNotEqual(second.member_id, first.member_id)
        self.assertGreater(second.generation, first.generation)
        self.assertEqual(second.world_size, 2)
        self.assertEqual(c.state_name(second.state), "FORMED")
        beat = c.call("Heartbeat", member_id=first.member_id, lease_key=first.lease_key)
        self.assertEqual(beat.member_id, first.member_id)
        self.assertEqual(beat.world_size, 2)
        self.assertEqual(c.state_name(beat.state), "FORMED")
        self.assertGreaterEqual(beat.generation, second.generation)
        self.assertEqual({beat.rank, second.rank}, {0, 1})

    def test_trainer_gets_no_rank(self):
        c = self.start_coordinator("--world-size", "1")
        shard = c.register("shard-only")
        trainer = c.register("trainer-0", role="TRAINER")
        self.assertEqual(shard.rank, 0)
        self.assertEqual(trainer.rank, -1)
        self.assertEqual(trainer.world_size, 1)

    def test_leave_declares_a_trainer_lost(self):
        """Leave {name, lost}: a launcher declares a trainer it reaped lost at once, and a shard
        server too (its rank is vacant at once; the server that takes it again learns the rank's
        state was lost); an unknown name, half a request or a bad reason are refused, and the
        coordinator keeps serving."""
        c = self.start_coordinator("--world-size", "2", "--lease-ms", "60000")
        shard = c.register("shard-only")
        c.register("shard-two")  # survives the loss of shard-only below
        trainer = c.register("trainer-0", role="TRAINER")
        gen = c.call("Leave", name="trainer-0", lost="its process exited with status 3").generation
        self.assertGreater(gen, trainer.generation)
        # Its lease is gone: the dead trainer's key no longer renews it
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat",
                            member_id=trainer.member_id, lease_key=trainer.lease_key)
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Leave", name="trainer-0",
                            lost="again", contains='no member named "trainer-0"')
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "Leave", name="trainer-0",
                            contains="name and lost go together")
        c.register("trainer-1", role="TRAINER")
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "Leave", name="trainer-1",
                            lost="a\nb", contains="control character")
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "Leave", name="trainer-1",
                            lost="x" * 201, contains="1 to 200 bytes")
        self.assertEqual(c.state_name(c.call("Heartbeat", member_id=shard.member_id,
                                             lease_key=shard.lease_key).state), "FORMED")
        self.assertFalse(shard.replaces_lost)
        c.call("Leave", name="shard-only", lost="killed by signal 9")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat",
                            member_id=shard.member_id, lease_key=shard.lease_key)
        again = c.register("shard-only")
        self.assertEqual((again.rank, c.state_name(again.state)), (0, "FORMED"))
        self.assertTrue(again.replaces_lost)
        self.assertAlive(c)

    def test_store_set_get_round_trip(self):
        c = self.start_coordinator()
        value = bytes(range(256)) * 4
        c.call("StoreSet", key="nccl/unique-id", value=value)
        self.assertEqual(c.call("StoreGet", key="nccl/unique-id").value, value)
        c.call("StoreSet", key="nccl/unique-id", value=b"replaced")
        self.assertEqual(c.call("StoreGet", key="nccl/unique-id").value, b"replaced")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "StoreGet", key="absent",
                            contains="is not set")

    def test_status_lists_members(self):
        c = self.start_coordinator("--world-size", "2", "--lease-ms", "9000")
        a = c.register("status-a", address="127.0.0.1:4001", device="cuda:3")
        c.call("StoreSet", key="k1", value=b"v")
        st = c.call("Status")
        self.assertEqual(c.state_name(st.state), "FORMING")
        self.assertEqual(st.world_size, 0)
        self.assertEqual((st.min_nodes, st.max_nodes), (2, 2))
        self.assertEqual(st.generation, a.generation)
        self.assertEqual(st.lease_ms, 9000)
        self.assertEqual(st.store_keys, 1)
        self.assertTrue(st.version)
        self.assertTrue(st.awaiting, "FORMING names whom it waits for")
        by_name = {m.name: m for m in st.members}
        self.assertEqual(list(by_name), ["status-a"])
        m = by_name["status-a"]
        self.assertEqual(m.member_id, a.member_id)
        self.assertEqual(m.address, "127.0.0.1:4001")
        self.assertEqual(m.device, "cuda:3")
        self.assertGreater(m.lease_remaining_ms, 0)
        self.assertLessEqual(m.lease_remaining_ms, 9000)
        counters = {x.method: x for x in st.counters}
        self.assertGreaterEqual(counters["/pshard.Coordinator/Register"].calls, 1)
        c.register("status-b")
        st = c.call("Status")
        self.assertEqual(c.state_name(st.state), "FORMED")
        self.assertEqual(sorted((m.name, m.rank) for m in st.members),
                         [("status-a", 0), ("status-b", 1)])

    def test_leave(self):
        c = self.start_coordinator("--world-size", "2")
        a = c.register("leaver")
        left = c.call("Leave", member_id=a.member_id, lease_key=a.lease_key)
        self.assertGreater(left.generation, a.generation)
        self.assertEqual(list(c.call("Status").members), [])
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat",
                            member_id=a.member_id, lease_key=a.lease_key,
                            contains="unknown member id")


# ---------------------------------------------------------------------------------------------
# 4. Bad input


class BadInputTest(CoordinatorTest):

    def test_garbage_bytes(self):
        c = self.start_coordinator()
        # Field 1 as a length-delimited field whose length runs past the end.
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.raw,
                            "/pshard.Coordinator/Register", b"\x12\xff\xff\xff\x0f\x01",
                            contains="is not a valid pshard.RegisterRequest message")
        self.assertAlive(c)
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.raw,
                            "/pshard.Coordinator/StoreSet", b"\xff\xff\xff\xff",
                            contains="is not a valid pshard.StoreSetRequest message")
        self.assertAlive(c)

    def test_nul_in_strings(self):
        # C strings end at a NUL: "a\0x" and "a\0y" must not become one key "a".
        c = self.start_coordinator()
        c.call("StoreSet", key="a", value=b"plain")
        for key in ("a\x00x", "a\x00y", "\x00"):
            self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "StoreSet", key=key,
                                value=b"clobber", contains="field 'key' holds a NUL byte")
        self.assertEqual(c.call("StoreGet", key="a").value, b"plain")
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.register, "srv\x00-1",
                            contains="field 'name' holds a NUL byte")
        self.assertAlive(c)

    def test_unknown_method(self):
        c = self.start_coordinator()
        self.assertRpcError(grpc.StatusCode.UNIMPLEMENTED, c.raw, "/pshard.Coordinator/Nope",
                            b"", contains="/pshard.Coordinator/Nope")
        self.assertRpcError(grpc.StatusCode.UNIMPLEMENTED, c.raw, "/no.such.Service/Method",
                            b"", contains="/no.such.Service/Method")
        self.assertAlive(c)

    def test_message_over_limit(self):
        c = self.start_coordinator("--max-message-bytes", "65536")
        self.assertRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, c.call, "StoreSet",
                            key="big", value=b"x" * (100 * 1024),
                            contains=("larger than max", "65536"))
        self.assertAlive(c)
        # Under the limit still goes through.
        c.call("StoreSet", key="small", value=b"y" * 60000)
        self.assertEqual(len(c.call("StoreGet", key="small").value), 60000)

    def test_token_required(self):
        c = self.start_coordinator(token="s3cret-token-0123456")
        for md in ((), (("authorization", "Bearer wrong-token"),),
                   (("authorization", "s3cret-token"),)):
            self.assertRpcError(grpc.StatusCode.UNAUTHENTICATED, c.call, "Status", metadata=md,
                                contains="token")
        self.assertRpcError(grpc.StatusCode.UNAUTHENTICATED, c.raw,
                            "/pshard.Coordinator/StoreGet", b"", metadata=())
        # Health and reflection need no token.
        self.assertEqual(c.health(""), SERVING)
        self.assertEqual(c.health("pshard.Coordinator"), SERVING)
        services = refl_db.ProtoReflectionDescriptorDatabase(c.channel()).get_services()
        self.assertIn("pshard.Coordinator", services)
        # The right token works (c.call sends it by default).
        self.assertAlive(c)
        self.assertEqual(c.register("token-holder").rank, 0)

    def test_empty_name(self):
        c = self.start_coordinator()
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.register, "",
                            contains="name is empty")
        self.assertAlive(c)
        self.assertEqual(list(c.call("Status").members), [])

    def test_name_too_long(self):
        c = self.start_coordinator()
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.register, "n" * 300,
                            contains=("300 bytes", "253"))
        self.assertAlive(c)
        self.assertEqual(c.register("n" * 253).rank, 0, "253 bytes is allowed")

    def test_store_value_limit(self):
        c = self.start_coordinator()
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "StoreSet", key="huge",
                            value=b"v" * (MIB + 1), contains=("1048577", "1048576"))
        self.assertAlive(c)
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "StoreGet", key="huge")
        exact = bytes(i % 251 for i in range(MIB))
        c.call("StoreSet", key="huge", value=exact)
        self.assertEqual(c.call("StoreGet", key="huge").value, exact)

    def test_heartbeat_unknown_member(self):
        c = self.start_coordinator()
        known = c.register("known")
        real = known.member_id
        unknown = "0123456789abcdef0123456789abcdef"
        self.assertNotEqual(unknown, real)
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat", member_id=unknown,
                            contains=("unknown member id", unknown))
        self.assertAlive(c)
        self.assertEqual(c.call("Heartbeat", member_id=real, lease_key=known.lease_key).member_id,
                         real)
        # The id alone is no credential: Status and Watch publish it.
        self.assertRpcError(grpc.StatusCode.PERMISSION_DENIED, c.call, "Heartbeat",
                            member_id=real, contains="no lease key")
        self.assertRpcError(grpc.StatusCode.PERMISSION_DENIED, c.call, "Leave", member_id=real,
                            lease_key="0" * 32, contains="wrong lease key")
        status = c.call("Status")
        self.assertEqual([m.member_id for m in status.members], [real])
        self.assertNotIn(known.lease_key.encode(), status.SerializeToString())


    def test_jobs_are_apart(self):
        """The pshard-job header scopes a call to one job (torchrun's --rdzv-id), as grpcurl -H
        sends it: members, ranks, generations and the store are each job's own."""
        c = self.start_coordinator("--world-size", "1")

        def job(name):
            return c.metadata() + (("pshard-job", name),)

        a = c.call("Register", metadata=job("job-a"), role=1, name="srv", address="127.0.0.1:1")
        b = c.call("Register", metadata=job("job-b"), role=1, name="srv", address="127.0.0.1:2")
        self.assertEqual((a.rank, b.rank), (0, 0), "the same name forms rank 0 in each job")
        self.assertEqual(a.generation, b.generation, "each job counts its own generations")
        st_a = c.call("Status", metadata=job("job-a"))
        self.assertEqual(st_a.job, "job-a")
        self.assertEqual([m.member_id for m in st_a.members], [a.member_id])
        # The default job first, then the others newest first.
        self.assertEqual([j.job for j in st_a.jobs], ["default", "job-b", "job-a"])
        self.assertEqual(list(c.call("Status").members), [], "the default job has no members")
        # A member is known only in its own job.
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat", metadata=job("job-b"),
                            member_id=a.member_id, lease_key=a.lease_key,
                            contains="unknown member id")
        c.call("Heartbeat", metadata=job("job-a"), member_id=a.member_id, lease_key=a.lease_key)
        c.call("StoreSet", metadata=job("job-a"), key="k", value=b"a")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "StoreGet", metadata=job("job-b"),
                            key="k")
        self.assertEqual(c.call("StoreGet", metadata=job("job-a"), key="k").value, b"a")
        self.assertTrue(c.call("StoreDelete", metadata=job("job-a"), key="k").deleted)
        self.assertFalse(c.call("StoreDelete", metadata=job("job-a"), key="k").deleted)
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "Status",
                            metadata=job("no spaces"), contains="job id")
        self.assertAlive(c)


# ---------------------------------------------------------------------------------------------
# 5. Watch


class WatchTest(CoordinatorTest):

    def test_register_is_pushed(self):
        c = self.start_coordinator("--world-size", "3")
        c.register("early")
        watch = c.watch()
        self.addCleanup(watch.close)
        initial = watch.next()
        self.assertEqual([m.name for m in initial.members], ["early"])
        self.assertEqual(c.state_name(initial.state), "FORMING")
        late = c.register("late", channel=c.channel(separate=True))
        ev = watch.wait_for(lambda e: any(m.name == "late" for m in e.members))
        self.assertGreater(ev.generation, initial.generation)
        self.assertEqual(ev.generation, late.generation)
        self.assertEqual(sorted(m.name for m in ev.members), ["early", "late"])
        self.assertIn(late.member_id, [m.member_id for m in ev.members])

    def test_lease_expiry_is_pushed(self):
        c = self.start_coordinator("--lease-ms", "300", "--heartbeat-ms", "100",
                                   "--world-size", "2")
        keeper = c.register("keeper")
        # Keep one member alive by heartbeating while "doomed" stays silent. The longest gap
        # between the keeper's successful heartbeats tells whether it was kept alive for sure
        # (a starved test thread on a loaded machine could let its lease lapse too).
        stop = threading.Event()
        beat_channel = c.channel(separate=True)
        beats = {"last_ok": time.monotonic(), "max_gap": 0.0}

        def beat():
            while not stop.is_set():
                try:
                    c.call("Heartbeat", channel=beat_channel, member_id=keeper.member_id,
                           lease_key=keeper.lease_key, timeout=2)
                    now = time.monotonic()
                    beats["max_gap"] = max(beats["max_gap"], now - beats["last_ok"])
                    beats["last_ok"] = now
                except grpc.RpcError:
                    pass
                stop.wait(0.03)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            watch = c.watch()
            self.addCleanup(watch.close)
            watch.next()
            doomed = c.register("doomed", channel=c.channel(separate=True))
            joined = watch.wait_for(lambda e: any(m.name == "doomed" for m in e.members))
            self.assertLessEqual(joined.generation, doomed.generation)
            gone = watch.wait_for(
                lambda e: "expire" in e.reason.lower() and "doomed" in e.reason, timeout=5)
        finally:
            stop.set()
            beater.join()
        self.assertIn("doomed", gone.reason)
        self.assertGreater(gone.generation, joined.generation)
        names = [m.name for m in gone.members]
        self.assertNotIn("doomed", names)
        if beats["max_gap"] < 0.2:  # well inside the 300 ms lease
            self.assertIn("keeper", names, "a member that kept heartbeating was evicted")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, c.call, "Heartbeat",
                            member_id=doomed.member_id, lease_key=doomed.lease_key,
                            contains="unknown member id")


# ---------------------------------------------------------------------------------------------
# 6. Store semantics


class StoreTest(CoordinatorTest):

    def test_wait_released_by_set(self):
        c = self.start_coordinator()
        result = {}

        def waiter():
            try:
                result["reply"] = c.call("StoreWait", channel=c.channel(separate=True),
                                         keys=["k"], timeout_ms=20000, timeout=30)
            except grpc.RpcError as e:
                result["error"] = e

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        wait_until(lambda: c.call("Status").store_waiters == 1, "the wait is pending")
        self.assertTrue(t.is_alive(), "StoreWait returned before the key was set: %r" % result)
        c.call("StoreSet", channel=c.channel(separate=True), key="k", value=b"released")
        t.join(timeout=RPC_TIMEOUT_S)
        self.assertFalse(t.is_alive(), "StoreWait was not released")
        self.assertNotIn("error", result)
        self.assertEqual(list(result["reply"].values), [b"released"])
        self.assertEqual(c.call("Status").store_waiters, 0)

    def test_wait_existing_keys_returns_in_order(self):
        c = self.start_coordinator()
        c.call("StoreSet", key="a", value=b"1")
        c.call("StoreSet", key="b", value=b"2")
        reply = c.call("StoreWait", keys=["b", "a"], timeout_ms=1000)
        self.assertEqual(list(reply.values), [b"2", b"1"])

    def test_wait_timeout(self):
        c = self.start_coordinator()
        started = time.monotonic()
        self.assertRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, c.call, "StoreWait",
                            keys=["missing"], timeout_ms=200, contains=("timed out", "missing"))
        elapsed = time.monotonic() - started
        self.assertGreaterEqual(elapsed, 0.15)
        self.assertLess(elapsed, 5.0)
        self.assertEqual(c.call("Status").store_waiters, 0)
        self.assertAlive(c)

    def test_add(self):
        c = self.start_coordinator()
        self.assertEqual(c.call("StoreAdd", key="counter", delta=5).value, 5)
        self.assertEqual(c.call("StoreAdd", key="counter", delta=-2).value, 3)
        self.assertEqual(c.call("StoreGet", key="counter").value, b"3")
        c.call("StoreSet", key="text", value=b"not a number")
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, c.call, "StoreAdd", key="text",
                            delta=1, contains="integer")

    def test_compare_set(self):
        c = self.start_coordinator()
        r = c.call("StoreCompareSet", key="leader", expected=b"", desired=b"alice")
        self.assertTrue(r.swapped, "an absent key with empty expected swaps")
        self.assertEqual(r.value, b"alice")
        r = c.call("StoreCompareSet", key="leader", expected=b"", desired=b"bob")
        self.assertFalse(r.swapped)
        self.assertEqual(r.value, b"alice")
        r = c.call("StoreCompareSet", key="leader", expected=b"carol", desired=b"bob")
        self.assertFalse(r.swapped)
        self.assertEqual(r.value, b"alice")
        r = c.call("StoreCompareSet", key="leader", expected=b"alice", desired=b"bob")
        self.assertTrue(r.swapped)
        self.assertEqual(r.value, b"bob")
        self.assertEqual(c.call("StoreGet", key="leader").value, b"bob")


# ---------------------------------------------------------------------------------------------
# Memory stays bounded for clients that do not read


def rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS for pid %d" % pid)


def under_asan(pid):
    """AddressSanitizer keeps freed memory in quarantine: RSS says nothing about bounds there."""
    with open("/proc/%d/maps" % pid) as f:
        return "libasan" in f.read()


class UnreadStreamsTest(CoordinatorTest):

    def assertGrowthBelow(self, c, grown_kb, limit_kb, what):
        # Under ASan the flows still run, but freed memory sits in quarantine: no bound to see.
        if under_asan(c.proc.pid):
            print("(AddressSanitizer build: RSS bound not checked)", file=sys.stderr)
            return
        self.assertLess(grown_kb, limit_kb, what)

    def test_reflection_requests_without_reading_replies(self):
        # Before the bound: ~165,000 unread 20-byte requests grew a server by 700+ MiB.
        c = self.start_coordinator()
        req_cls = message_factory.GetMessageClass(
            c.pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
        one = req_cls(list_services="*").SerializeToString()
        sent = [0]
        stop = threading.Event()

        def requests():
            while not stop.is_set() and sent[0] < 200000:
                sent[0] += 1
                yield one

        before = rss_kb(c.proc.pid)
        fn = c.channel(separate=True).stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
        call = fn(requests(), timeout=60)  # never read
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and sent[0] < 200000:
            time.sleep(0.2)
        grown = rss_kb(c.proc.pid) - before
        stop.set()
        call.cancel()
        print("reflection: %d requests offered, coordinator RSS +%d kB" % (sent[0], grown),
              file=sys.stderr)
        self.assertGrowthBelow(c, grown, 8 * 1024, "%d requests grew the coordinator by %d kB"
                               % (sent[0], grown))
        self.assertAlive(c)

    def test_watch_streams_that_never_read(self):
        # Before the bound: 50 unread Watch streams and 425 long registrations took the
        # coordinator from 54 to 843 MiB.
        c = self.start_coordinator("--world-size", "1000")
        watch_cls = message_factory.GetMessageClass(
            c.pool.FindMessageTypeByName("pshard.WatchRequest"))
        calls = []
        for _ in range(20):
            fn = c.channel(separate=True).unary_stream("/pshard.Coordinator/Watch")
            calls.append(fn(watch_cls().SerializeToString(), timeout=60,
                            metadata=c.metadata()))
        before = rss_kb(c.proc.pid)
        for i in range(300):
            c.register("srv-%04d-%s" % (i, "x" * 200), address="127.0.0.1:%d" % (1000 + i),
                       node="n" * 200, device="d" * 200)
        grown = rss_kb(c.proc.pid) - before
        print("watch: 20 unread streams, 300 registrations, coordinator RSS +%d kB" % grown,
              file=sys.stderr)
        self.assertGrowthBelow(c, grown, 256 * 1024, "the coordinator grew by %d kB" % grown)
        self.assertAlive(c)
        # A dropped watcher learns why.
        dropped = 0
        for call in calls:
            try:
                for _ in call:
                    pass
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "watch again" in e.details():
                    dropped += 1
            call.cancel()
        self.assertGreater(dropped, 0)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: %s PATH/TO/pshard-coordinator [unittest options]" % sys.argv[0])
    COORDINATOR = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
