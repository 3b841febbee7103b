"""Block descriptions and segment sets (include/segxfer/plan.h, group.h).

    # Prefill rank 1 of 2 (half the KV heads), an NHD cache
    # [layers, blocks, tokens, heads, head_dim]:
    agent = segxfer.Agent("prefill-0/tp1", url, tp_rank=1, tp_size=2,
                          kv_layout="NHD", kv_cache=k_cache)
    # A decode rank with all heads reads both prefill ranks as one set:
    with agent.open_group(engine="prefill-0", tp_size=2) as g:
        print(g.plan())                  # "reads heads 2-3 of each block of ..."
        result = g.read_blocks(remote_ids, local_ids)   # or await read_blocks_async
"""
import asyncio
import ctypes

from . import _lib
from ._handle import Handle, Owned
from .errors import IncompatibleLayout, check, code, invalid

_lib_ = _lib.lib


def block_desc(cache=None, *, kv_layout="NHD", tokens=None, head_first=None,
               head_count=None, heads_total=None, head_dim=None, dtype=None, group=0,
               slots=None, tp_rank=0, tp_size=0):
    """The description of one group's blocks, as a dict Agent(blocks=...)
    takes.  What is not given comes from cache, a paged cache tensor shaped
    [layers, num_blocks, tokens, heads, head_dim] (NHD),
    [layers, num_blocks, heads, tokens, head_dim] (HND) or
    [layers, num_blocks, tokens, head_dim] (MLA).  The heads this rank holds
    default to its tensor-parallel share: heads_total = heads * tp_size (or
    given, for GQA replication where tp_size exceeds it) and head_first =
    tp_rank * heads, or the replica's heads when ranks share them."""
    from . import dtype_name
    if kv_layout not in _lib.KV_ORDERS:
        raise invalid("kv_layout must be one of %s (got %r)" % (", ".join(_lib.KV_ORDERS),
                                                                kv_layout))
    shape = tuple(getattr(cache, "shape", ())) if cache is not None else None
    if shape is not None:
        want = 4 if kv_layout == "MLA" else 5
        if len(shape) != want:
            raise invalid("a %s cache is shaped [layers, num_blocks, %s] (got %s)"
                          % (kv_layout, "tokens, head_dim" if kv_layout == "MLA" else
                             "tokens, heads, head_dim" if kv_layout == "NHD" else
                             "heads, tokens, head_dim", shape))
        if kv_layout == "NHD":
            t, h, d = shape[2:]
        elif kv_layout == "HND":
            h, t, d = shape[2:]
        else:
            (t, d), h = shape[2:], 1
        tokens = t if tokens is None else tokens
        head_count = h if head_count is None else head_count
        head_dim = d if head_dim is None else head_dim
        if dtype is None:
            dtype = dtype_name(cache.dtype)
    if None in (tokens, head_count, head_dim) or not dtype:
        raise invalid("block_desc: tokens, heads, head_dim and dtype are needed (give a "
                      "cache tensor, or them)")
    if kv_layout == "MLA":
        head_first, heads_total = 0, head_count
    if heads_total is None:
        heads_total = head_count * tp_size if tp_size else head_count
    if head_first is None:
        if tp_size and tp_size > heads_total:
            # GQA replication: tp_size // heads_total ranks share each head.
            head_first = tp_rank // (tp_size // heads_total) * head_count
        else:
            head_first = tp_rank * head_count if tp_size else 0
    return dict(group=group, kv_layout=kv_layout, tokens=int(tokens),
                head_first=int(head_first), head_count=int(head_count),
                heads_total=int(heads_total), head_dim=int(head_dim), dtype=dtype,
                slots=slots)


def fill_blocks(layout, blocks):
    """Write the block descriptions (dicts from block_desc) into an
    sx_layout."""
    from .batch import _slots_mask, _u32
    if len(blocks) > _lib.MAX_BLOCK_DESCS:
        raise invalid("at most %d block descriptions" % _lib.MAX_BLOCK_DESCS)
    for i, b in enumerate(blocks):
        d = layout.blocks[i]
        order = b.get("kv_layout", "NHD")
        if order not in _lib.KV_ORDERS:
            raise invalid("kv_layout must be one of %s (got %r)"
                          % (", ".join(_lib.KV_ORDERS), order))
        d.order = _lib.KV_ORDERS[order]
        for f in ("group", "tokens", "head_first", "head_count", "heads_total", "head_dim"):
            setattr(d, f, _u32(b.get(f, 0), f))
        raw = str(b.get("dtype", "")).encode()
        if len(raw) > _lib.TAG_MAX:
            raise invalid("block description dtype %r is too long" % b.get("dtype"))
        d.dtype = raw
        d.slots = 0 if b.get("slots") is None else _slots_mask(b["slots"], "slots")
    layout.n_blocks = len(blocks)


def _raise_mismatch(rc, m, what):
    if rc == code("SX_EINCOMPAT"):
        raise IncompatibleLayout(_lib.text(m.message),
                                 _lib.MISMATCH_KINDS.get(m.kind, str(m.kind)),
                                 _lib.text(m.field), m.group, m.layer, m.slot,
                                 _lib.text(m.local), _lib.text(m.remote))
    check(rc, what)


def plan_text(plan_ptr):
    out = ctypes.c_void_p()
    check(_lib_.sx_plan_text(plan_ptr, ctypes.byref(out)), "plan text")
    return _lib.take_string(out.value)


def _ids(v, what):
    from .batch import _u64
    v = list(v)
    return (ctypes.c_uint64 * max(len(v), 1))(*[_u64(x, what) for x in v]), len(v)


class GroupResult:
    """The end of a set read: state ("COMPLETED", "FAILED", "TIMEOUT",
    "CANCELLED"), error (0 or an SX_E* code), message, bytes, ranges,
    members read from, failed (local block ids that did not fill),
    transfer_ns."""

    def __init__(self, r):
        self.state = _lib.BATCH_STATES.get(r.state, str(r.state))
        self.error = r.error
        self.message = _lib.text(r.message)
        self.bytes, self.ranges, self.members = r.bytes, r.n_ranges, r.members
        self.failed = [r.failed[i] for i in range(r.n_failed)]
        self.transfer_ns = r.transfer_ns

    @property
    def ok(self):
        return self.state == "COMPLETED"

    def __repr__(self):
        return "<GroupResult %s %d bytes from %d members, %d failed blocks>" % (
            self.state, self.bytes, self.members, len(self.failed))


class Group(Owned):
    """A set of segments read as one (Agent.open_group): planned at open
    against the agent's layout, refused there (IncompatibleLayout, or
    SX_ENOENT for a rank not published) before any byte moves."""

    def __init__(self, agent, names=None, engine=None, tp_size=None, timeout=5.0,
                 ignore_fingerprint=False, pattern=None):
        from .batch import _timeout_ms, _u32
        self.agent = agent
        p = _lib.new_struct(_lib.GroupParams)
        _lib_.sx_group_params_init(p)
        keep = []
        if names is not None:
            if isinstance(names, (str, bytes)):
                raise invalid("names must be a list of segment names")
            raw = [str(n).encode() for n in names]
            arr = (ctypes.c_char_p * max(len(raw), 1))(*raw)
            keep += [raw, arr]
            p.names, p.n_names = arr, len(raw)
            self.names = list(names)
        elif engine is not None and tp_size is not None:
            raw = str(engine).encode()
            keep.append(raw)
            p.engine, p.tp_size = raw, _u32(tp_size, "tp_size")
            self.names = ["%s/tp%d" % (engine, i) for i in range(int(tp_size))]
        elif pattern is not None:
            raw = str(pattern).encode()
            keep.append(raw)
            p.pattern = raw
            self.names = [pattern]
        else:
            raise invalid("open_group needs names, engine and tp_size, or pattern")
        p.timeout_ms = _timeout_ms(timeout, "timeout")
        p.flags = _lib.CHECK_IGNORE_FINGERPRINT if ignore_fingerprint else 0
        out = ctypes.c_void_p()
        m = _lib.new_struct(_lib.Mismatch)
        with agent._h as ptr:
            rc = _lib_.sx_group_open(ptr, p, ctypes.byref(out), m)
            _raise_mismatch(rc, m, "open_group %s" % ", ".join(self.names))
            self._h = Handle(out.value, _lib_.sx_group_close, "the segment set", agent._h)

    def __len__(self):
        with self._h as ptr:
            return _lib_.sx_group_size(ptr)

    @property
    def transport(self):
        """What reads from the first member use: "tcp", "rdma", "cuda_ipc"."""
        with self._h as ptr:
            k = _lib_.sx_segment_transport(_lib_.sx_group_segment(ptr, 0))
        return _lib.TRANSPORT_NAMES.get(k, str(k))

    def plan(self):
        """The plan in words."""
        with self._h as ptr:
            return plan_text(_lib_.sx_group_plan(ptr))

    def plan_info(self):
        info = _lib.new_struct(_lib.PlanInfo)
        with self._h as ptr:
            check(_lib_.sx_plan_info_get(_lib_.sx_group_plan(ptr), info), "plan info")
        return {f: getattr(info, f) for f, _ in _lib.PlanInfo._fields_}

    def read_blocks(self, remote_ids, local_ids, timeout=30.0, notify_tag=None):
        """Read one request: remote_ids (its blocks on every member, in
        token order) into local_ids.  Waits (the GIL is released); returns a
        GroupResult.  Errors before anything is sent raise (SX_EBOUNDS,
        SX_ENOREGION; SX_ELIMIT for a notice of too many ranges).  With
        notify_tag (a 64-bit integer) every member read from gets a read
        notice of its own carrying it (Notice.ranges: what was read from
        it) once every byte from it arrived."""
        from .batch import _timeout_ms, _u64
        rb, nr = _ids(remote_ids, "remote block id")
        lb, nl = _ids(local_ids, "local block id")
        ms = _timeout_ms(timeout, "timeout")
        r = _lib.new_struct(_lib.GroupResult)
        with self._h as ptr:
            if notify_tag is None:
                rc = _lib_.sx_group_read(ptr, rb, nr, lb, nl, ms, r)
            else:
                rc = _lib_.sx_group_read_notify(ptr, rb, nr, lb, nl, ms,
                                                _u64(notify_tag, "notify_tag"), r)
            check(rc, "read_blocks")
            return GroupResult(r)

    async def read_blocks_async(self, remote_ids, local_ids, timeout=30.0, notify_tag=None):
        """read_blocks in a worker thread: the event loop runs meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: self.read_blocks(
            remote_ids, local_ids, timeout, notify_tag))
