"""TLS, mutual TLS and the cluster token on pshard-coordinator, checked with Python grpcio.

Certificates are made for each run with the openssl command: a CA, a server certificate for
IP:127.0.0.1 and DNS:localhost, a client certificate from that CA, and an unrelated second CA
with its own client certificate. Every coordinator runs on 127.0.0.1:<ephemeral> and is killed
by PID afterwards.

Usage: python tls_test.py PATH/TO/pshard-coordinator [unittest options]
"""

import os
import subprocess
import sys
import tempfile
import time
import unittest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc loads: no handshake chatter

import grpc  # noqa: E402
from google.protobuf import descriptor_pool, message_factory  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import proto_reflection_descriptor_database as refl_db  # noqa: E402

from coordinator_proc import CoordinatorProcess  # noqa: E402

COORDINATOR = None  # set from argv in __main__
RPC_TIMEOUT_S = 10.0
# A handshake that cannot succeed fails fast; this only bounds a hang.
FAIL_TIMEOUT_S = 5.0
TOKEN = "tls-and-token-secret"

SERVING = health_pb2.HealthCheckResponse.SERVING

CERTS = None  # the Certs of this run, made in setUpModule


def _openssl(*args, cwd):
    proc = subprocess.run(["openssl"] + list(args), cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError("openssl %s failed:\n%s" % (" ".join(args),
                                                       proc.stdout.decode(errors="replace")))


class Certs:
    """PEM files in a temporary directory; read(name) returns bytes, path(name) the file."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="pshard-tls-")
        self.dir = self.tmp.name
        self._ca("ca", "pshard test CA")
        self._leaf("server", "ca", "localhost", "serverAuth",
                   "subjectAltName=IP:127.0.0.1,DNS:localhost")
        self._leaf("client", "ca", "pshard-client", "clientAuth")
        self._ca("other-ca", "unrelated test CA")
        self._leaf("other-client", "other-ca", "pshard-client", "clientAuth")

    def _ca(self, name, cn):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", name + ".key", "-out", name + ".pem", "-days", "2",
                 "-subj", "/CN=" + cn, "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.dir)

    def _leaf(self, name, ca, cn, usage, *extra):
        ext = os.path.join(self.dir, name + ".ext")
        with open(ext, "w") as f:
            f.write("basicConstraints=critical,CA:FALSE\n"
                    "keyUsage=critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage=%s\n" % usage)
            for line in extra:
                f.write(line + "\n")
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn,
                 cwd=self.dir)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
                 "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "2",
                 "-extfile", ext, "-out", name + ".pem", cwd=self.dir)

    def path(self, name):
        return os.path.join(self.dir, name)

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()

    def credentials(self, ca="ca", client=None):
        """Client TLS credentials trusting `ca`, presenting certificate `client` if given."""
        if client is None:
            return grpc.ssl_channel_credentials(root_certificates=self.read(ca + ".pem"))
        return grpc.ssl_channel_credentials(root_certificates=self.read(ca + ".pem"),
                                            private_key=self.read(client + ".key"),
                                            certificate_chain=self.read(client + ".pem"))

    def cleanup(self):
        self.tmp.cleanup()


def setUpModule():
    global CERTS
    CERTS = Certs()


def tearDownModule():
    if CERTS is not None:
        CERTS.cleanup()


class Coordinator(CoordinatorProcess):
    """One pshard-coordinator with TLS on 127.0.0.1:<ephemeral>, stopped by PID."""

    def __init__(self, ready_credentials, *args, token=None):
        super().__init__(COORDINATOR, args, token, "pshard-tls-coord-")
        self.ready_credentials = ready_credentials

    def start(self):
        deadline = self.launch(["--tls-cert", CERTS.path("server.pem"),
                                "--tls-key", CERTS.path("server.key")])
        stub = health_pb2_grpc.HealthStub(self.channel(self.ready_credentials))
        left = deadline - time.monotonic()
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(left, 0.1),
                              wait_for_ready=True)
        except grpc.RpcError as e:
            raise AssertionError("health never answered over TLS: %s %s\n%s"
                                 % (e.code(), e.details(), self.log_text()))
        if resp.status != SERVING:
            raise AssertionError("health is %d, not SERVING" % resp.status)
        return self

    def channel(self, credentials, options=()):
        """A channel of its own (own connection, so each handshake is really made)."""
        opts = [("grpc.use_local_subchannel_pool", 1)] + list(options)
        if credentials is None:
            ch = grpc.insecure_channel(self.target, options=opts)
        else:
            ch = grpc.secure_channel(self.target, credentials, options=opts)
        self.channels.append(ch)
        return ch


def health(channel, timeout=RPC_TIMEOUT_S):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status


def register(channel, name, metadata=()):
    """Register as a shard server with message classes from the server's own reflection."""
    pool = descriptor_pool.DescriptorPool(refl_db.ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindMethodByName("pshard.Coordinator.Register")
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    role = pool.FindEnumTypeByName("pshard.Role").values_by_name["SHARD_SERVER"].number
    fn = channel.unary_unary("/pshard.Coordinator/Register",
                             request_serializer=req_cls.SerializeToString,
                             response_deserializer=resp_cls.FromString)
    return fn(req_cls(role=role, name=name, address="127.0.0.1:1", device="cpu"),
              timeout=RPC_TIMEOUT_S, metadata=metadata)


class TlsTestCase(unittest.TestCase):

    def start(self, ready_credentials, *args, token=None):
        c = Coordinator(ready_credentials, *args, token=token)
        self.addCleanup(c.cleanup)
        c.start()
        return c

    def assertConnectFails(self, channel, code=grpc.StatusCode.UNAVAILABLE):
        with self.assertRaises(grpc.RpcError) as cm:
            health(channel, timeout=FAIL_TIMEOUT_S)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        return cm.exception


class TlsServerTest(TlsTestCase):

    def setUp(self):
        self.c = self.start(CERTS.credentials("ca"), "--world-size", "1")

    def test_right_ca_serves_health_and_register(self):
        ch = self.c.channel(CERTS.credentials("ca"))
        self.assertEqual(health(ch), SERVING)
        view = register(ch, "tls-shard")
        self.assertEqual(view.rank, 0)
        self.assertEqual(view.world_size, 1)
        self.assertEqual(len(view.member_id), 32)

    def test_dns_name_in_certificate(self):
        # Connect to 127.0.0.1 but verify the certificate against the name "localhost".
        ch = self.c.channel(CERTS.credentials("ca"),
                            options=[("grpc.ssl_target_name_override", "localhost")])
        self.assertEqual(health(ch), SERVING)

    def test_wrong_ca_fails(self):
        err = self.assertConnectFails(self.c.channel(CERTS.credentials("other-ca")))
        self.assertIn("handshake", err.details().lower())
        # The server is unharmed by the failed handshake.
        self.assertEqual(health(self.c.channel(CERTS.credentials("ca"))), SERVING)

    def test_plaintext_client_fails(self):
        self.assertConnectFails(self.c.channel(None))
        self.assertEqual(health(self.c.channel(CERTS.credentials("ca"))), SERVING)

    def test_sigterm_exits_zero(self):
        self.assertEqual(health(self.c.channel(CERTS.credentials("ca"))), SERVING)
        self.assertEqual(self.c.stop(), 0, self.c.log_text())


class MutualTlsTest(TlsTestCase):

    def setUp(self):
        self.c = self.start(CERTS.credentials("ca", client="client"),
                            "--tls-client-ca", CERTS.path("ca.pem"))

    def test_client_certificate_works(self):
        ch = self.c.channel(CERTS.credentials("ca", client="client"))
        self.assertEqual(health(ch), SERVING)
        self.assertEqual(register(ch, "mtls-shard").rank, 0)

    def test_no_client_certificate_fails(self):
        self.assertConnectFails(self.c.channel(CERTS.credentials("ca")))
        self.assertEqual(health(self.c.channel(CERTS.credentials("ca", client="client"))),
                         SERVING)

    def test_certificate_from_other_ca_fails(self):
        self.assertConnectFails(self.c.channel(CERTS.credentials("ca", client="other-client")))
        self.assertEqual(health(self.c.channel(CERTS.credentials("ca", client="client"))),
                         SERVING)

    def test_plaintext_client_fails(self):
        self.assertConnectFails(self.c.channel(None))


class TlsWithTokenTest(TlsTestCase):

    def setUp(self):
        self.c = self.start(CERTS.credentials("ca"), token=TOKEN)

    def test_token_over_tls(self):
        plain_tls = self.c.channel(CERTS.credentials("ca"))
        # Health and reflection need no token, even with one configured.
        self.assertEqual(health(plain_tls), SERVING)
        with self.assertRaises(grpc.RpcError) as cm:
            register(plain_tls, "no-token")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED,
                         cm.exception.details())
        self.assertIn("token", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            register(plain_tls, "bad-token", metadata=(("authorization", "Bearer nope"),))
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        # The right token as per-call metadata...
        view = register(plain_tls, "metadata-token",
                        metadata=(("authorization", "Bearer " + TOKEN),))
        self.assertEqual(len(view.member_id), 32)
        # ...and as call credentials composed with TLS, the way gRPC clients usually send it.
        creds = grpc.composite_channel_credentials(CERTS.credentials("ca"),
                                                   grpc.access_token_call_credentials(TOKEN))
        view2 = register(self.c.channel(creds), "callcreds-token")
        self.assertGreater(view2.generation, view.generation)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: %s PATH/TO/pshard-coordinator [unittest options]" % sys.argv[0])
    if subprocess.run(["openssl", "version"], stdout=subprocess.DEVNULL).returncode != 0:
        sys.exit("the openssl command is needed to make test certificates")
    COORDINATOR = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
