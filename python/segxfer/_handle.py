"""Ownership of the C objects behind Agent, Segment and Batch.

The library requires batches to be destroyed before their segment and
segments before their agent.  Python's collector does not promise that order
(objects in a reference cycle are finalized in any order, after the weak
references to them are cleared), so the C pointers live in small handles
that form the same tree as the C objects: a handle holds its children
strongly and closes them before itself.  The Python objects hold their
handle, and their finalizers only close it; closing twice is a no-op, and
every use of a closed handle raises instead of passing a dangling pointer.

Every C call on the object runs inside `with handle as ptr:`, which counts
the caller in: close() refuses new callers, asks the object to stop (cancel)
when some are inside (a batch wait in another thread), and waits for them to
leave before it destroys.  A child is made inside its parent's `with` block
(the C call that makes it and its Handle), so a close of the parent that
starts meanwhile waits for it and then closes the new child too.  The wait
polls: it only happens when a close races a call in another thread, and a
plain lock per handle keeps every batch cheap to make.

A forked child inherits the handles but not the agent's thread: a call
would wait forever for a thread that is not there, and a destroy would join
it.  Handles remember the process that made them; in another process every
use raises, and close() only forgets the C object (the parent still owns it).
"""
import os
import threading
import time

from .errors import invalid

_pid = os.getpid()  # this process; set again in a forked child


def _after_fork():
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class Handle:
    __slots__ = ("ptr", "_destroy", "_stop", "what", "parent", "children", "keep",
                 "closed", "_users", "_lock", "pid")

    def __init__(self, ptr, destroy, what, parent=None, stop=None):
        self.ptr = ptr
        self._destroy = destroy
        self._stop = stop
        self.what = what
        self.parent = parent
        self.children = set()
        self.keep = []            # Python objects the C object may use
        self.closed = False
        self._users = 0
        self._lock = threading.Lock()
        self.pid = _pid
        if parent is not None:
            parent.children.add(self)

    def _unusable(self):
        if self.pid != _pid:
            return invalid("%s was made in process %d, before fork(): it cannot be used "
                           "in this process (%d); make a new one here"
                           % (self.what, self.pid, _pid))
        return invalid("%s is closed" % self.what)

    def __enter__(self):
        """Use the pointer in a C call that must finish before destroy."""
        with self._lock:
            if self.closed or self.pid != _pid:
                raise self._unusable()
            self._users += 1
        return self.ptr

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1

    def close(self):
        if self.pid != _pid:
            self._forget()
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            users = self._users
        for child in list(self.children):
            child.close()
        if users and self._stop is not None:
            self._stop(self.ptr)
        while self._users:
            time.sleep(0.001)
        # Children made by calls that were inside: no call can start now.
        for child in list(self.children):
            child.close()
        self._destroy(self.ptr)
        self.ptr = None
        self.keep = []
        if self.parent is not None:
            self.parent.children.discard(self)

    def _forget(self):
        """close() in a forked child: the C object is the parent's; drop
        the references without calling into the library."""
        if self.closed:
            return
        self.closed = True
        for child in list(self.children):
            child._forget()
        self.ptr = None
        self.keep = []
        if self.parent is not None:
            self.parent.children.discard(self)


class Owned:
    """What Agent, Segment and Batch share: a handle in self._h, closed by
    close() (idempotent), on leaving a `with` block and when collected."""

    def close(self):
        h = getattr(self, "_h", None)
        if h is not None:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()
