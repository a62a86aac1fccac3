"""One pshard-coordinator process for the Python suites: started on 127.0.0.1:<ephemeral>, its
port read from --port-file with a deadline, stopped by PID (SIGTERM, wait, SIGKILL fallback).
The suites add how readiness is checked (plaintext or TLS health)."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def die_with_parent():
    """A command prefix that kills the child when the test runner dies before its cleanups.

    setpriv sets PR_SET_PDEATHSIG and then execs, so the PID stays the coordinator's. This
    is not done with Popen(preexec_fn=...): running Python in a child forked from a process
    with gRPC's threads can deadlock before exec, and Popen then waits forever."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


class CoordinatorProcess:
    """Process management shared by the suites' Coordinator classes."""

    def __init__(self, binary, args, token, tmp_prefix):
        self.binary = binary
        self.args = list(args)
        self.token = token
        self.tmp = tempfile.TemporaryDirectory(prefix=tmp_prefix)
        self.port_file = os.path.join(self.tmp.name, "port")
        self.log_path = os.path.join(self.tmp.name, "coordinator.log")
        self.proc = None
        self.port = None
        self.channels = []

    def launch(self, extra_args=()):
        """Starts the process and waits (START_TIMEOUT_S) for its port file. Returns the
        deadline left for the caller's readiness check."""
        cmd = [self.binary, "--listen", LOOPBACK + ":0", "--port-file", self.port_file,
               "--log", "warn"] + list(extra_args) + self.args
        if self.token is not None:
            token_file = os.path.join(self.tmp.name, "token")
            with open(token_file, "w") as f:
                f.write(self.token + "\n")
            cmd += ["--token-file", token_file]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(die_with_parent() + cmd, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        # The port file is written (atomically, by rename) once the server is bound.
        while self.port is None:
            if self.proc.poll() is not None:
                raise AssertionError("coordinator exited with %d before serving:\n%s"
                                     % (self.proc.returncode, self.log_text()))
            if time.monotonic() > deadline:
                raise AssertionError("no port file after %.0f s:\n%s"
                                     % (START_TIMEOUT_S, self.log_text()))
            try:
                with open(self.port_file) as f:
                    text = f.read().strip()
                if text:
                    self.port = int(text)
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        return deadline

    def stop(self):
        """SIGTERM, wait, SIGKILL fallback. Returns the exit status (negative: killed).

        Channels stay open until the process is gone, so the server has to end open streams
        itself."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    rc = "did not exit within %.0f s of SIGTERM" % STOP_TIMEOUT_S
            else:
                rc = self.proc.returncode
            self.proc = None
            self.log.close()
        for ch in self.channels:
            ch.close()
        self.channels = []
        return rc

    def cleanup(self):
        """Stops the coordinator; a crash or an unclean exit during the test fails it."""
        try:
            rc = self.stop()
            log = self.log_text()
        finally:
            self.tmp.cleanup()
        if rc not in (0, None):
            raise AssertionError("coordinator exit status %r on SIGTERM:\n%s" % (rc, log))

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-4000:].decode("utf-8", "replace")
        except OSError:
            return ""

    @property
    def target(self):
        return "%s:%d" % (LOOPBACK, self.port)
