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
stop (cancel) and waits for them to leave before it destroys.
"""
import threading

from .errors import invalid


class Handle:
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
        self._cv = threading.Condition()
        if parent is not None:
            parent.children.add(self)

    def get(self):
        if self.closed:
            raise invalid("%s is closed" % self.what)
        return self.ptr

    def __enter__(self):
        """Use the pointer in a C call that must finish before destroy."""
        with self._cv:
            if self.closed:
                raise invalid("%s is closed" % self.what)
            self._users += 1
        return self.ptr

    def __exit__(self, *exc):
        with self._cv:
            self._users -= 1
            if self._users == 0:
                self._cv.notify_all()

    def close(self):
        with self._cv:
            if self.closed:
                return
            self.closed = True
        for child in list(self.children):
            child.close()
        with self._cv:
            if self._users and self._stop is not None:
                self._stop(self.ptr)
            while self._users:
                self._cv.wait()
        self._destroy(self.ptr)
        self.ptr = None
        self.keep = []
        if self.parent is not None:
            self.parent.children.discard(self)
