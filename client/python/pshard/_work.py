"""torch's Work for backend "pshard": what every operation of the backend returns.

A pshard operation is one or more calls queued on the client's own thread
(``pshard._C.Client.collective_start``), in issue order behind everything issued before it, or
calls that already ran (a blocking operation). ``wait()`` waits for the queued calls, raises the
first error (pshard's: PeerLostError naming the rank, DesyncError naming both, ...), then runs
the copies that complete the outputs (a non-contiguous output, a list output). ``get_future()``
gives a torch Future that completes without anyone calling ``wait()``: one completion thread
per process waits for such Works in issue order (the order they finish in) and sets each
Future, as DDP's communication hooks and torch's functional collectives expect.
"""
import queue
import threading

import torch
from torch._C._distributed_c10d import Work as _CWork

__all__ = ["Work"]


class Work(_CWork):
    """A torch.distributed Work over pshard calls. works: the pshard._C Works still to wait for
    (empty when the calls ran already); outputs: what the Future's value is (torch's: the
    operation's output tensors); after: functions that complete the outputs once the calls
    finished; error: an exception the operation already met (raised by wait()). Thread-safe:
    wait(), is_completed() and the completion thread may race; the calls are waited once, and
    whoever returns from wait() finds the Future (if one was asked for) done."""

    def __init__(self, works=(), outputs=(), after=(), error=None):
        super().__init__()
        self._works = list(works)
        self._after = list(after)
        self._outputs = list(outputs)
        self._error = error
        self._done = False
        self._future = None
        self._future_set = False  # whose _finish completes the Future (exactly one)
        self._lock = threading.RLock()

    def _finish(self):
        """Waits for the calls (once), runs the copies, completes the Future."""
        with self._lock:
            if not self._done:
                err = self._error
                for w in self._works:
                    try:
                        w.wait()
                    except Exception as e:  # every call is waited for; the first error wins
                        err = err or e
                self._works = []
                if err is None:
                    try:
                        for fn in self._after:
                            fn()
                    except Exception as e:
                        err = e
                self._after = []
                self._error = err
                self._done = True
            # One caller completes the Future (a second set_result raises), and under the lock,
            # so that a wait() racing the completion thread returns only once the Future is
            # done too. The lock is reentrant: the Future's callbacks run in this thread and
            # may ask this Work again.
            if self._future is not None and not self._future_set:
                self._future_set = True
                if self._error is not None:
                    self._future.set_exception(self._error)
                else:
                    self._future.set_result(self._outputs)

    def wait(self, timeout=None):
        """Blocks until the operation finished; raises its error. The operation's own timeout
        (the group's, default the shard servers' 10 minutes) bounds the wait; timeout is
        accepted for torch's signature."""
        self._finish()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        """True once the operation finished (an error is kept for wait() to raise)."""
        if not self._done and not all(w.is_completed() for w in self._works):
            return False
        self._finish()
        return True

    def is_success(self):
        if not self.is_completed():
            raise RuntimeError("is_success() on a Work that has not completed: call wait()")
        return self._error is None

    def exception(self):
        return self._error if self.is_completed() else None

    def result(self):
        """The output tensors, after waiting."""
        self.wait()
        return self._outputs

    def synchronize(self):
        self.wait()

    def get_future(self):
        """A torch.futures.Future completed with the output tensors (or the error) once the
        operation finishes, whether or not anyone waits on this Work."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if not self._done:
                    _completer().put(self)
                    return self._future
            fut = self._future
        if not fut.done():
            self._finish()
        return fut


_COMPLETER = None
_COMPLETER_LOCK = threading.Lock()


def _completer():
    """The queue of the process's completion thread (started on first use)."""
    global _COMPLETER
    with _COMPLETER_LOCK:
        if _COMPLETER is None:
            q = queue.SimpleQueue()
            t = threading.Thread(target=_complete_loop, args=(q,), name="pshard-work-futures",
                                 daemon=True)
            t.start()
            _COMPLETER = q
        return _COMPLETER


def _complete_loop(q):
    while True:
        work = q.get()
        try:
            work._finish()
        except Exception:  # _finish keeps errors for the Future; nothing may kill this thread
            pass
