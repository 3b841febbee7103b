"""What segxfer's SGLang backend (segxfer.sglang) shares between its prefill
and decode sides: region groups, the side-channel messages it adds to
SGLang's, sending on a side-channel socket, settings from the environment.

The message kinds are the first frame of a multipart message on SGLang's
side channel (each manager's PULL socket, common/conn.py); the other
frames are JSON, ASCII numbers or int32 page ids, as noted per kind.
"""
import os
import threading

import numpy as np

from .errors import SegxferError

# Region groups of an engine rank's segment.
GROUP_KV, GROUP_AUX, GROUP_STATE = 0, 1, 2
# A write batch's notice lists at most 1024 runs (SX_NOTICE_MAX_ENTRIES);
# requests with more runs go in several batches with the same tag.
_RUNS_PER_BATCH = 1000

# Side-channel messages of this backend (the first frame).
_REGISTER = b"SEGXFER_REGISTER"    # decode -> prefill: its segments, TP, endpoint
_PEER = b"SEGXFER_PEER"            # prefill -> decode: checked; its segments to grant
_GRANTED = b"SEGXFER_GRANTED"      # decode -> prefill: granted, write away
_REFUSED = b"SEGXFER_REFUSED"      # prefill -> decode: this pair cannot transfer
_ROOM = b"SEGXFER_ROOM"            # decode -> prefill: a request's destination
_FAILED = b"SEGXFER_FAILED"        # prefill -> decode: a request's transfer failed
_ABORT = b"ABORT"                  # decode -> prefill, as CommonKVReceiver sends it


def _env(name, default=None):
    v = os.environ.get(name)
    return default if v in (None, "") else v


def _env_seconds(name, default):
    v = _env(name)
    if v is None:
        return default
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not 0 < s < 2**31 / 1000:
        raise ValueError("%s must be a positive number of seconds (got %r)" % (name, v))
    return s


def _ids(v, what):
    """Page or slot ids as a 1-D int64 numpy array (SGLang passes int32/int64
    numpy arrays, lists or tensors)."""
    if hasattr(v, "cpu") and hasattr(v, "numpy"):
        v = v.cpu().numpy()
    a = np.asarray(v)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError("%s must be a 1-D array of integers (got %s of %s)"
                         % (what, a.shape, a.dtype))
    return a.astype(np.int64, copy=False)


_send_lock = threading.Lock()


def send(sock_lock, frames):
    """Send on a side-channel socket: a manager's (from its thread and the
    scheduler's; sockets are not thread-safe) or a receiver's with its lock
    (CommonKVReceiver._connect_to_bootstrap_server's pair)."""
    sock, lock = sock_lock if isinstance(sock_lock, tuple) else (sock_lock, _send_lock)
    with lock:
        sock.send_multipart(frames)


def cancel(batch):
    try:
        batch.cancel()
    except SegxferError:
        pass    # it ended already
