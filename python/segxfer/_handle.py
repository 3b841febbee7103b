"""Ownership of the C objects behind Agent, Segment and Batch.

The library requires batches to be destroyed before their segment and
segments before their agent.  Python's collector does not promise that order
(objects in a reference cycle are finalized in any order, after the weak
references to them are cleared), so the C pointers live in small handles
that form the same tree as the C objects: a handle holds its children
strongly and closes them before itself.  The Python objects hold their
handle, and their finalizers only close it; closing twice is a no-op, and
every use of a closed handle raises instead of passing a dangling pointer.

A handle also counts callers that are inside a C call which must not race
with destroy (a batch wait in another thread): close() asks the object to
stop (cancel) and waits for them to leave before it destroys.  That wait
polls: it only happens when a close races a wait in another thread, and a
plain lock per handle keeps every batch cheap to make.
"""
import threading
import time

from .errors import invalid


class Handle:
    __slots__ = ("ptr", "_destroy", "_stop", "what", "parent", "children", "keep",
                 "closed", "_users", "_lock")

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
        if parent is not None:
            parent.children.add(self)

    def get(self):
        if self.closed:
            raise invalid("%s is closed" % self.what)
        return self.ptr

    def __enter__(self):
        """Use the pointer in a C call that must finish before destroy."""
        with self._lock:
            if self.closed:
                raise invalid("%s is closed" % self.what)
            self._users += 1
        return self.ptr

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1

    def close(self):
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
        self._destroy(self.ptr)
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
