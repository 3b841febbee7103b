"""Agent and Segment: register memory, publish it by name, open peers by
name, check their layout, read their blocks.

    with segxfer.Agent("prefill-0/tp0", url, dtype="bf16", tag="NHD") as agent:
        agent.register_blocks(k_cache, slot="K")    # [layers, blocks, ...]
        agent.register_blocks(v_cache, slot="V")
        agent.publish()

    with segxfer.Agent(None, url, dtype="bf16", tag="NHD") as agent:
        ...register the decode cache the same way...
        with agent.open("prefill-0/tp0", timeout=5) as seg:
            seg.check()                              # IncompatibleLayout
            batch = seg.read_blocks(remote_ids, local_ids)
            await batch                              # or batch.wait()
"""
import atexit
import ctypes
import json
import os
import weakref

from . import _lib
from ._handle import Handle, Owned
from .batch import Batch, _index, _timeout_ms, _slots_mask, _u32, _u64
from .errors import IncompatibleLayout, check, code, invalid
from .memory import memory_of, pointer_location
from . import push
from .group import Group, _raise_mismatch, block_desc, fill_blocks, plan_text

_lib_ = _lib.lib
_live_agents = weakref.WeakSet()


@atexit.register
def _close_live_agents():
    # Before the interpreter tears down: agent threads may call back into
    # Python (a log callback), which is not safe during finalization.
    for agent in list(_live_agents):
        agent.close()


def _bytes(s, what):
    """s as the NUL-terminated UTF-8 the library takes.  A NUL inside would
    cut the text there (a name "a\\0b" would publish, open or grant "a"),
    so it is refused, as is text that is not UTF-8."""
    if s is None:
        return None
    if not isinstance(s, str):
        raise TypeError("%s must be a str (got %s)" % (what, type(s).__name__))
    if "\0" in s:
        raise invalid("%s must not contain NULs (got %r)" % (what, s))
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid("%s is not valid UTF-8 text (%s)" % (what, e.reason)) from None


def _fill(struct, field, value, what):
    """Copy text into a char array field, refusing what would not fit."""
    raw = _bytes(value or "", what)
    size = getattr(type(struct), field).size
    if len(raw) >= size or b"\0" in raw:
        raise invalid("%s must be at most %d bytes without NULs (got %r)"
                      % (what, size - 1, value))
    setattr(struct, field, raw)


def serving_transports(transports):
    """transports for an agent that publishes (an engine's KV cache):
    cuda_ipc hands its IPC handles over the TCP listener's control
    connection, so a choice naming cuda_ipc without tcp gets tcp as well
    (readers on the same host still pick cuda_ipc).  Anything else is
    returned as it is."""
    if transports in (None, "auto"):
        return transports
    names = ([t.strip() for t in transports.split(",") if t.strip()]
             if isinstance(transports, str) else list(transports))
    if "cuda_ipc" in names and "tcp" not in names:
        names.append("tcp")
    return ",".join(names) if isinstance(transports, str) else names


def transports_mask(transports):
    """"auto" (the library's default), or names: "tcp", "rdma", "cuda_ipc",
    as a list or "tcp,rdma"."""
    if transports in (None, "auto"):
        return None
    if isinstance(transports, str):
        transports = [t.strip() for t in transports.split(",") if t.strip()]
    mask = 0
    for t in transports:
        if t not in _lib.TRANSPORT_KINDS:
            raise invalid("unknown transport %r (auto, %s)"
                          % (t, ", ".join(_lib.TRANSPORT_KINDS)))
        mask |= 1 << _lib.TRANSPORT_KINDS[t]
    if mask == 0:
        raise invalid("no transport named")
    return mask


def slot_number(slot):
    if isinstance(slot, str):
        mask = _slots_mask([slot], "slot")
        return mask.bit_length() - 1
    slot = _index(slot)
    if slot is None or not 0 <= slot < _lib.MAX_SLOTS:
        raise invalid("slot must be a slot name (K, V, index, state) or a number below %d"
                      % _lib.MAX_SLOTS)
    return slot


def _desc_json(desc_p):
    out = ctypes.c_void_p()
    check(_lib_.sx_desc_to_json(desc_p, 0, ctypes.byref(out)), "descriptor")
    return json.loads(_lib.take_string(out.value))


class Region:
    """A registered memory region (Agent.register's result)."""

    __slots__ = ("id", "group", "layer_first", "layer_count", "layer_stride", "slot",
                 "addr", "length", "block_bytes", "block_stride", "num_blocks", "location",
                 "readable", "writable", "memory")

    def __repr__(self):
        return ("Region(id=%d, group=%d, layers=%d+%d, slot=%d, block_bytes=%d, "
                "num_blocks=%d, location=%s)" % (self.id, self.group, self.layer_first,
                                                 self.layer_count, self.slot,
                                                 self.block_bytes, self.num_blocks,
                                                 self.location))


class Agent(Owned):
    """A transfer agent: its own thread, store connection and data plane.

    name          the segment name to publish (None: a reader only)
    metadata_url  redis://..., redis+sentinel://..., redis+cluster://...,
                  etcd://... (default: $SX_METADATA_URL)
    transports    "auto", or names among "tcp", "rdma", "cuda_ipc"
    fingerprint, tag, dtype, tp_rank, tp_size, pp_rank, pp_size, labels:
                  the published layout (readers check it against theirs)
    lease_ms, renew_ms, listen, advertise, namespace, conns_per_peer,
    rdma_devices, rdma_gid_index, slice_bytes, cache_ttl_ms, staging_bytes,
    tcp_threads, tcp_thread_bytes: as in
                  sx_agent_params (include/segxfer/agent.h); None: default
    kv_layout     "NHD", "HND" or "MLA": describe the blocks of group 0 (what
                  plans across tensor-parallel splits, block sizes and orders
                  need); tokens, heads and head_dim come from kv_cache (a
                  paged cache tensor) or block_tokens, kv_heads (first,
                  count, total) and head_dim; see segxfer.block_desc
    blocks        block descriptions (dicts from segxfer.block_desc), for
                  several groups; instead of kv_layout
    pp_layers     (first, count): the pipeline stage's layers
    log_level     "error", "warn", "info", "debug"
    log           None (the library writes to stderr), or a callable
                  log(level, message) run on the agent's thread

    A context manager: close() on exit unpublishes at once, ends batches,
    closes segments and stops the thread.
    """

    def __init__(self, name=None, metadata_url=None, *, transports="auto",
                 fingerprint="", tag="", dtype="", tp_rank=0, tp_size=0, pp_rank=0,
                 pp_size=0, labels=None, lease_ms=None, renew_ms=None, listen=None,
                 advertise=None, namespace=None, conns_per_peer=None, rdma_devices=None,
                 rdma_gid_index=None, slice_bytes=None, cache_ttl_ms=None,
                 staging_bytes=None, tcp_threads=None, tcp_thread_bytes=None,
                 kv_layout=None, kv_cache=None, block_tokens=None,
                 kv_heads=None, head_dim=None, blocks=None, pp_layers=None,
                 log_level="info", log=None):
        if metadata_url is None:
            metadata_url = os.environ.get("SX_METADATA_URL")
        if not metadata_url:
            raise invalid("no metadata_url (and SX_METADATA_URL is not set)")
        p = _lib.new_struct(_lib.AgentParams)
        _lib_.sx_agent_params_init(p)
        keep = []  # what p points to must live until create returns

        def s(v, what):
            b = _bytes(v, what)
            keep.append(b)
            return b

        p.name = s(name, "name")
        p.metadata_url = s(metadata_url, "metadata_url")
        p.ns = s(namespace, "namespace")
        p.listen = s(listen, "listen")
        p.advertise = s(advertise, "advertise")
        p.rdma_devices = s(rdma_devices, "rdma_devices")
        mask = transports_mask(transports)
        if mask is not None:
            p.transports = mask
        for field, v in (("lease_ms", lease_ms), ("renew_ms", renew_ms),
                         ("conns_per_peer", conns_per_peer), ("slice_bytes", slice_bytes),
                         ("cache_ttl_ms", cache_ttl_ms), ("tcp_thread_bytes", tcp_thread_bytes)):
            if v is not None:
                setattr(p, field, _u32(v, field))
        if rdma_gid_index is not None:
            # A C int (-1: the library picks); ctypes would wrap a larger value.
            gid = _index(rdma_gid_index)
            if gid is None or not -1 <= gid < 2**31:
                raise invalid("rdma_gid_index must be an integer in -1 .. 2**31-1 (got %r)"
                              % (rdma_gid_index,))
            p.rdma_gid_index = gid
        if tcp_threads is not None:
            # A C int32 (-1: the library's default); ctypes would wrap a larger value.
            n = _index(tcp_threads)
            if n is None or not -1 <= n <= 64:
                raise invalid("tcp_threads must be an integer in -1 .. 64 (got %r)"
                              % (tcp_threads,))
            p.tcp_threads = n
        if staging_bytes is not None:
            p.staging_bytes = _u64(staging_bytes, "staging_bytes")
        _fill(p.layout, "fingerprint", fingerprint, "fingerprint")
        _fill(p.layout, "tag", tag, "tag")
        _fill(p.layout, "dtype", dtype, "dtype")
        for field, v in (("tp_rank", tp_rank), ("tp_size", tp_size), ("pp_rank", pp_rank),
                         ("pp_size", pp_size)):
            setattr(p.layout, field, _u32(v, field))
        if kv_layout is not None:
            if blocks is not None:
                raise invalid("give kv_layout or blocks, not both")
            first, count, total = (tuple(kv_heads) if kv_heads is not None
                                   else (None, None, None))
            blocks = [block_desc(kv_cache, kv_layout=kv_layout, tokens=block_tokens,
                                 head_first=first, head_count=count, heads_total=total,
                                 head_dim=head_dim, dtype=dtype or None, tp_rank=tp_rank,
                                 tp_size=tp_size)]
        if blocks:
            fill_blocks(p.layout, list(blocks))
        self.blocks = list(blocks or [])
        if pp_layers is not None:
            p.layout.layer_first = _u32(pp_layers[0], "pp_layers")
            p.layout.layer_count = _u32(pp_layers[1], "pp_layers")
        labels = dict(labels or {})
        if labels:
            arr = (_lib.Label * len(labels))()
            for i, (k, v) in enumerate(labels.items()):
                _fill(arr[i], "key", k, "label key")
                _fill(arr[i], "value", v, "label value")
            p.labels, p.n_labels = arr, len(labels)
            keep.append(arr)
        if log_level not in _lib.LOG_LEVELS:
            raise invalid("log_level must be one of %s" % ", ".join(_lib.LOG_LEVELS))
        p.log_level = _lib.LOG_LEVELS[log_level]
        cb = None
        if log is not None:
            names = {v: k for k, v in _lib.LOG_LEVELS.items()}
            cb = _lib.LOG_FN(lambda arg, level, msg:
                             log(names.get(level, "info"), _lib.text(msg)))
            p.log = cb
        out = ctypes.c_void_p()
        check(_lib_.sx_agent_create(p, ctypes.byref(out)), "agent")
        self.name = name
        self.metadata_url = metadata_url
        self.dtype, self.tag, self.fingerprint = dtype, tag, fingerprint
        self.regions = {}
        self._h = Handle(out.value, _lib_.sx_agent_destroy, "the agent")
        self._h.keep.append(cb)  # the callback runs until destroy returns
        self._notice_waiters = set()  # (loop, wake) of next_notice_async calls
        _live_agents.add(self)

    # ------------------------------------------------------------ memory

    def register(self, memory=None, *, addr=None, length=None, group=0, layer_first=0,
                 layers=1, layer_stride=None, slot="K", block_bytes, block_stride=None,
                 num_blocks=None, location=None, readable=True, writable=False):
        """Register memory with its block structure and return the Region.

        memory is a torch tensor, an object with __cuda_array_interface__ or
        __array_interface__, or a writable buffer; or give addr= and length=
        (the caller keeps that memory alive).  Block b of layer l (l from
        layer_first, `layers` of them) is at
            start + (l - layer_first) * layer_stride + b * block_stride
        and block_bytes long.  layer_stride defaults to length / layers,
        block_stride to block_bytes, num_blocks to what fits in a layer.
        location ("cpu", "cuda:N") defaults to the tensor's device (for a raw
        address: what the CUDA driver says of it, "cpu" without a driver).
        readable lets peers read it; writable lets producers this agent
        granted (grant_write) write into it.  Peers see the region from the
        next publish()."""
        if memory is not None:
            if addr is not None:
                raise invalid("give memory or addr=, not both")
            addr, nbytes, loc, keepalive = memory_of(memory, location)
            if length is None:
                length = nbytes
            elif _u64(length, "length") > nbytes:
                raise invalid("length %d is more than the %d bytes of the memory"
                              % (length, nbytes))
        else:
            if addr is None or length is None:
                raise invalid("register needs memory, or addr= and length=")
            keepalive = None
            loc = location or pointer_location(_u64(addr, "addr"),
                                               _u64(length, "length"))
        # Integers of any kind (numpy's, torch scalars) as Python ints.
        addr, length = _u64(addr, "addr"), _u64(length, "length")
        layers = _u32(layers, "layers")
        block_bytes = _u64(block_bytes, "block_bytes")
        group, layer_first = _u32(group, "group"), _u32(layer_first, "layer_first")
        if layer_stride is not None:
            layer_stride = _u64(layer_stride, "layer_stride")
        if block_stride is not None:
            block_stride = _u64(block_stride, "block_stride")
        if num_blocks is not None:
            num_blocks = _u64(num_blocks, "num_blocks")
        if layers == 0 or block_bytes == 0:
            raise invalid("layers and block_bytes must be positive")
        if layer_stride is None:
            layer_stride = length // layers if layers > 1 else 0
        if block_stride is None:
            block_stride = block_bytes
        if num_blocks is None:
            per_layer = layer_stride if layers > 1 else length
            num_blocks = per_layer // block_stride if block_stride else 0
        rp = _lib.new_struct(_lib.RegionParams)
        rp.addr, rp.length = addr, length
        rp.group = group
        rp.layer_first, rp.layer_count = layer_first, layers
        rp.layer_stride = _u64(layer_stride, "layer_stride")
        rp.slot = slot_number(slot)
        rp.block_bytes = block_bytes
        rp.block_stride = _u64(block_stride, "block_stride")
        rp.num_blocks = _u64(num_blocks, "num_blocks")
        loc_b = _bytes(loc, "location")
        rp.location = loc_b
        rp.access = (_lib.ACCESS_REMOTE_READ if readable else 0) | \
            (_lib.ACCESS_REMOTE_WRITE if writable else 0)
        rid = ctypes.c_uint32()
        with self._h as ptr:
            check(_lib_.sx_agent_register(ptr, rp, ctypes.byref(rid)), "register")
        r = Region()
        r.id, r.group, r.layer_first, r.layer_count = rid.value, group, layer_first, layers
        r.layer_stride, r.slot, r.addr, r.length = layer_stride, rp.slot, addr, length
        r.block_bytes, r.block_stride, r.num_blocks = block_bytes, block_stride, num_blocks
        r.location, r.memory = loc, keepalive
        r.readable, r.writable = bool(readable), bool(writable)
        self.regions[r.id] = r
        return r

    def register_blocks(self, cache, slot, group=0, layer_first=0, location=None,
                        readable=True, writable=False):
        """Register a paged cache tensor shaped [layers, num_blocks, ...]
        (one block of one layer is the trailing dimensions), as engines
        allocate one K and one V cache per group."""
        shape = tuple(getattr(cache, "shape", ()))
        if len(shape) < 2:
            raise invalid("register_blocks needs a tensor shaped [layers, num_blocks, ...] "
                          "(got shape %s)" % (shape,))
        _, nbytes, _, _ = memory_of(cache, location)
        layers, blocks = shape[0], shape[1]
        if layers == 0 or blocks == 0 or nbytes == 0:
            raise invalid("register_blocks: empty cache (shape %s)" % (shape,))
        block_bytes = nbytes // (layers * blocks)
        return self.register(cache, group=group, layer_first=layer_first, layers=layers,
                             layer_stride=blocks * block_bytes, slot=slot,
                             block_bytes=block_bytes, num_blocks=blocks, location=location,
                             readable=readable, writable=writable)

    def unregister(self, region):
        """Retire a region: withdrawn from the descriptor, reads in flight
        drained; the memory is free to go when this returns."""
        rid = region.id if isinstance(region, Region) else region
        with self._h as ptr:
            check(_lib_.sx_agent_unregister(ptr, _u32(rid, "region id")), "unregister")
        self.regions.pop(rid, None)

    def _shape(self, group, layers, slots):
        """(layer_first, layer_count, slot mask) of a block read; defaults
        from this agent's regions of the group."""
        group = _u32(group, "group")
        mine = [r for r in self.regions.values() if r.group == group]
        if layers is None:
            if not mine:
                raise invalid("no region of group %d is registered: register the "
                              "destination cache first (or give layers=)" % group)
            first = min(r.layer_first for r in mine)
            end = max(r.layer_first + r.layer_count for r in mine)
            layers = (first, end - first)
        elif isinstance(layers, range):
            if layers.step != 1 or len(layers) == 0:
                raise invalid("layers must be a non-empty range of step 1")
            layers = (layers.start, len(layers))
        try:
            first, count = layers
        except (TypeError, ValueError):
            raise invalid("layers must be a range or (first, count)") from None
        if slots is None:
            mask = 0
            for r in mine:
                mask |= 1 << r.slot
            if not mask:
                raise invalid("no region of group %d is registered (or give slots=)" % group)
        else:
            if isinstance(slots, (str, int)) or _index(slots) is not None:
                slots = [slots]
            mask = _slots_mask(slots, "slots")
        return _u32(first, "layer_first"), _u32(count, "layer count"), mask

    # ------------------------------------------------------------ publishing

    def publish(self, takeover=False):
        """Publish (or republish with the next generation) and keep the
        lease renewed.  SX_EHELD when another live incarnation holds the
        name (takeover=True replaces it)."""
        with self._h as ptr:
            check(_lib_.sx_agent_publish(ptr, _lib.PUBLISH_TAKEOVER if takeover else 0),
                  "publish")

    def unpublish(self):
        with self._h as ptr:
            check(_lib_.sx_agent_unpublish(ptr), "unpublish")

    def status(self):
        """Lease state and counters, as a dict."""
        st = _lib.new_struct(_lib.AgentStatus)
        with self._h as ptr:
            check(_lib_.sx_agent_status_get(ptr, st), "status")
        d = {f: getattr(st, f) for f, _ in _lib.AgentStatus._fields_}
        d["state"] = _lib.AGENT_STATES.get(st.state, str(st.state))
        return d

    @property
    def incarnation(self):
        buf = (ctypes.c_uint8 * _lib.INCARNATION_LEN)()
        with self._h as ptr:
            _lib_.sx_agent_incarnation(ptr, ctypes.byref(buf))
        return bytes(buf).hex()

    def descriptor(self):
        """The descriptor this agent publishes, as the dict `sxctl show
        --json` prints (no secrets)."""
        d = _lib.new_struct(_lib.Desc)
        with self._h as ptr:
            check(_lib_.sx_agent_descriptor(ptr, d), "descriptor")
        try:
            return _desc_json(d)
        finally:
            _lib_.sx_desc_free(d)

    def metrics_text(self):
        """Prometheus text of the agent's counters."""
        out = ctypes.c_void_p()
        with self._h as ptr:
            check(_lib_.sx_agent_metrics_text(ptr, ctypes.byref(out), None), "metrics")
        return _lib.take_string(out.value)

    # ------------------------------------------------------------ push mode

    def grant_write(self, producer=None, incarnation=None):
        """Let producer (a segment name) write this agent's writable
        regions: one life of it (incarnation: hex as Agent.incarnation, or
        16 bytes), any life of it (None: a restarted producer keeps the
        grant), or with producer None every segment of the namespace."""
        push.grant(self._h, _lib_.sx_agent_grant_write, producer, incarnation, "grant")

    def revoke_write(self, producer=None, incarnation=None):
        """Take grants back (incarnation None: every grant naming producer;
        producer None: the namespace grant).  From its return on, writes and
        notices of a producer no grant covers are refused, and a batch of
        it in flight delivers no notice."""
        push.grant(self._h, _lib_.sx_agent_revoke_write, producer, incarnation, "revoke")

    def next_notice(self, timeout=None):
        """The oldest Notice of a completed write batch, waiting up to
        timeout seconds (None: no limit; 0: do not wait); None when none
        came.  Releases the GIL while waiting.  SX_ESHUTDOWN if the agent
        is closed meanwhile."""
        if timeout is not None:
            _timeout_ms(timeout, "timeout")
        return push.next_notice(self._h, timeout)

    def notices(self):
        """Every notice queued now, oldest first (a list; never waits): what
        an engine asks each step ("which requests' blocks have arrived")."""
        return push.drain(self._h)

    async def next_notice_async(self, timeout=None):
        """`await agent.next_notice_async()`: the next Notice, with the loop
        watching the notice fd (no thread waits); None after timeout
        seconds.  Closing the agent wakes it with SX_ESHUTDOWN."""
        if timeout is not None:
            _timeout_ms(timeout, "timeout")
        return await push.next_notice_async(self, timeout)

    def notice_fileno(self):
        """An eventfd, readable while notices are queued, for an engine's own
        poll/epoll loop.  Owned by the agent: do not read or close it."""
        with self._h as ptr:
            return check(_lib_.sx_agent_notice_fd(ptr), "notice fd")

    # ------------------------------------------------------------ peers

    def open(self, name, timeout=5.0):
        """Open a segment by name, waiting up to timeout seconds for it to be
        published.  SX_ENOENT if it is not."""
        return Segment(self, name, timeout)

    def open_group(self, names=None, *, engine=None, tp_size=None, pattern=None,
                   timeout=5.0, ignore_fingerprint=False):
        """Open a set of segments read as one: names, the ranks
        "<engine>/tp0".."<engine>/tp<tp_size-1>", or the live names matching
        a glob pattern ("prefill-0/tp*").  Planned at once against
        this agent's layout and regions (register first); raises
        IncompatibleLayout (kind "heads_missing", "heads_overlap",
        "block_tokens", "tp", ...) or SX_ENOENT (a rank not published within
        timeout) before any byte moves.  See segxfer.Group."""
        return Group(self, names, engine, tp_size, timeout, ignore_fingerprint, pattern)

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Close segments and batches, unpublish, stop the agent, release
        the registered memory.  Idempotent."""
        super().close()
        self.regions = {}
        for loop, wake in list(getattr(self, "_notice_waiters", ())):
            try:
                loop.call_soon_threadsafe(wake)   # they raise SX_ESHUTDOWN
            except RuntimeError:                  # that loop is closed
                pass
        if _live_agents is not None:     # None late in interpreter shutdown
            _live_agents.discard(self)

    @property
    def closed(self):
        return self._h.closed

    def __repr__(self):
        # Also for an agent whose __init__ raised part way (a traceback, a
        # debugger): then it has no name or handle yet.
        h = getattr(self, "_h", None)
        return "Agent(%r, %s)" % (getattr(self, "name", None), "not created" if h is None
                                  else "closed" if h.closed else "open")


class Segment(Owned):
    """A peer's segment, opened by name (Agent.open).  close() (also on
    leaving a `with` block) destroys its batches first."""

    def __init__(self, agent, name, timeout=5.0):
        self.agent = agent
        self.name = name
        out = ctypes.c_void_p()
        raw = _bytes(name, "name")
        with agent._h as ptr:
            check(_lib_.sx_segment_open(ptr, raw, _timeout_ms(timeout, "timeout"),
                                        ctypes.byref(out)), "open %s" % name)
            self._h = Handle(out.value, _lib_.sx_segment_close, "the segment", agent._h)

    @property
    def transport(self):
        """"tcp", "rdma" or "cuda_ipc": what reads from it use."""
        with self._h as ptr:
            k = _lib_.sx_segment_transport(ptr)
        return _lib.TRANSPORT_NAMES.get(k, str(k))

    def descriptor(self):
        """The remote descriptor as opened, as a dict (no secrets)."""
        with self._h as ptr:
            return _desc_json(_lib_.sx_segment_desc(ptr))

    def regions(self):
        """The remote regions: dicts of id, group, layer_first, layer_count,
        slot, block_bytes, block_stride, num_blocks, length, location."""
        out = []
        with self._h as ptr:  # the descriptor is the segment's
            d = _lib_.sx_segment_desc(ptr).contents
            for i in range(d.n_regions):
                r = d.regions[i]
                out.append({"id": r.id, "group": r.group, "layer_first": r.layer_first,
                            "layer_count": r.layer_count, "layer_stride": r.layer_stride,
                            "slot": r.slot, "block_bytes": r.block_bytes,
                            "block_stride": r.block_stride, "num_blocks": r.num_blocks,
                            "length": r.length, "location": _lib.text(r.location),
                            "readable": bool(r.access & _lib.ACCESS_REMOTE_READ),
                            "writable": bool(r.access & _lib.ACCESS_REMOTE_WRITE)})
        return out

    def check(self, ignore_fingerprint=False):
        """Check the remote layout against this agent's (fingerprint, tag,
        dtype, (group, layer, slot) keys, block_bytes).  Raises
        IncompatibleLayout with the first difference."""
        m = _lib.new_struct(_lib.Mismatch)
        flags = _lib.CHECK_IGNORE_FINGERPRINT if ignore_fingerprint else 0
        with self._h as ptr:
            rc = _lib_.sx_segment_check(ptr, flags, m)
        if rc == code("SX_EINCOMPAT"):
            raise IncompatibleLayout(_lib.text(m.message),
                                     _lib.MISMATCH_KINDS.get(m.kind, str(m.kind)),
                                     _lib.text(m.field), m.group, m.layer, m.slot,
                                     _lib.text(m.local), _lib.text(m.remote))
        check(rc, "check %s" % self.name)

    def plan(self, ignore_fingerprint=False):
        """How this agent's blocks are read from this segment, in words
        (equal layouts: whole blocks; else head slices, token pieces, block
        ratios).  Raises IncompatibleLayout with the first misfit."""
        m = _lib.new_struct(_lib.Mismatch)
        out = ctypes.c_void_p()
        flags = _lib.CHECK_IGNORE_FINGERPRINT if ignore_fingerprint else 0
        with self._h as ptr:
            rc = _lib_.sx_segment_plan(ptr, flags, ctypes.byref(out), m)
        _raise_mismatch(rc, m, "plan %s" % self.name)
        try:
            return plan_text(out.value)
        finally:
            _lib_.sx_plan_free(out.value)

    def ping(self, timeout=5.0):
        """Round trip to the owner: (microseconds, transport name)."""
        rtt, via = ctypes.c_uint64(), ctypes.c_int()
        with self._h as ptr:
            check(_lib_.sx_segment_ping(ptr, _timeout_ms(timeout, "timeout"),
                                        ctypes.byref(rtt), ctypes.byref(via)), "ping")
        return rtt.value, _lib.TRANSPORT_NAMES.get(via.value, str(via.value))

    def batch(self, timeout=30.0, write=False, tag=0, notify_tag=None):
        """An empty batch with a deadline of timeout seconds from submit:
        reads, or with write=True writes whose notice carries tag; reads
        with notify_tag end with a read notice at the target carrying it."""
        return Batch(self, timeout, write, tag, notify_tag)

    def read_blocks(self, remote_ids, local_ids, group=0, layers=None, slots=None,
                    timeout=30.0, notify_tag=None):
        """Submit one batch reading block remote_ids[i] into local block
        local_ids[i] for every i (see Batch.add_block_ids); returns it.
        With notify_tag (a 64-bit integer, e.g. a request id) the target
        gets a read notice (Notice.kind == "read") carrying it, its blocks
        and this agent's name once every byte arrived; the batch ends
        COMPLETED only after the target accepted it."""
        return self._submit(Batch(self, timeout, notify_tag=notify_tag),
                            lambda b: b.add_block_ids(remote_ids, local_ids, group, layers,
                                                      slots))

    def read_ranges(self, ranges, timeout=30.0, notify_tag=None):
        """Submit one batch of raw byte ranges (see Batch.add_ranges);
        notify_tag as in read_blocks."""
        return self._submit(Batch(self, timeout, notify_tag=notify_tag),
                            lambda b: b.add_ranges(ranges))

    def write_blocks(self, local_ids, remote_ids, tag=0, group=0, layers=None, slots=None,
                     timeout=30.0):
        """Push mode: submit one write batch sending this agent's block
        local_ids[i] to the consumer's block remote_ids[i] for every i (in
        every layer and slot, as read_blocks); the consumer's notice carries
        tag.  It ends COMPLETED once every byte landed and the consumer
        accepted the notice."""
        return self._submit(Batch(self, timeout, True, tag),
                            lambda b: b.add_block_ids(remote_ids, local_ids, group, layers,
                                                      slots))

    def write_ranges(self, ranges, tag=0, timeout=30.0):
        """Push mode: one write batch of raw byte ranges (local,
        remote_region, offset, length), as read_ranges, submitted."""
        return self._submit(Batch(self, timeout, True, tag),
                            lambda b: b.add_range_writes(ranges))

    @staticmethod
    def _submit(b, add):
        """add(b) then submit; a batch that fails to build is closed."""
        try:
            add(b)
            return b.submit()
        except BaseException:
            b.close()
            raise
