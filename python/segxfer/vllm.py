"""A vLLM V1 KV connector over segxfer: the decode engine pulls a finished
prefill's KV blocks by segment name, and the prefill engine frees them when
the reader's read notice says every byte arrived.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "SegxferConnector",
        "kv_connector_module_path": "segxfer.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"metadata_url": "redis://10.0.0.5:6379"}}'

vLLM builds the class by name from the module path (KVConnectorFactory),
once with role SCHEDULER in the engine core and once with role WORKER in
each worker.  The interface is vLLM's KVConnectorBase_V1
(vllm/distributed/kv_transfer/kv_connector/v1/base.py, read at commit
13f4ad0f55b08ca1d37d1459f50ce950feaeb547); the request life cycle follows
its NIXL connector (v1/nixl_connector.py at commit
002a1057e9ae674d7bdc9c4be95bc29d65d2e808) where vLLM's scheduler depends on
it: the kv_transfer_params keys do_remote_prefill, do_remote_decode,
remote_block_ids, remote_engine_id, remote_request_id and tp_size keep their
meaning.  What differs:

- No side channel: request_finished returns remote_segment, the name under
  which the prefill's workers publish (<prefix>/<engine_id>; rank r is
  <remote_segment>/tp<r>), instead of remote_host and remote_port.  The
  decode worker opens that name in the metadata store.
- Compatibility: vLLM's compatibility hash (model, dtype, KV heads, head
  size, layers, cache dtype, connector version) is the segment's
  fingerprint; Segment.check() compares it, the dtype, the layout tag and
  every region's block size before the first read from a peer.
- Completion: the decode reads each request with notify_tag (a 64-bit tag
  derived from the prefill's request id, its low byte the decode's tp
  size); the prefill frees the blocks once read notices covered every layer
  and slot it registered, from as many decode ranks as read from it (as
  NIXL counts notifications: decode tp // prefill tp when the decode has
  more ranks, else one), or after abort_request_timeout seconds.
- Different tensor parallelism: each worker publishes its block
  description (KV heads it holds, tokens per block, head_dim, NHD or HND
  from the cache's strides, MLA); request_finished carries the prefill's
  tp_size.  A decode whose tp_size differs opens the prefill ranks it needs
  as a segment set (Agent.open_group) and reads each request through the
  set's plan: head slices of one rank's blocks (decode tp a multiple of the
  prefill's) or several ranks' blocks into one (prefill tp a multiple of
  the decode's), each prefill rank notified on its own; blocks a failed
  rank was filling are load errors.

Settings (kv_connector_extra_config; environment fallbacks in brackets):
metadata_url [SX_METADATA_URL] (required), prefix ("vllm"), transports
("auto"; "tcp", "rdma", "cuda_ipc" or a list), load_async (True: loads run
between scheduler steps, as NIXL's; False: in the step, each layer awaited
by wait_for_layer_load), transfer_timeout (30 s), open_timeout (5 s),
abort_request_timeout (480 s, as VLLM_NIXL_ABORT_REQUEST_TIMEOUT),
takeover (False: a name another live worker holds is SX_EHELD; True: a
restarted engine replaces its dead predecessor at once), lease_ms (5000),
fingerprint (default: the compatibility hash), kv_layout (layout tag, e.g.
"HND"; default: vLLM's), log_level ("warn").

Equal tensor parallelism: decode rank r reads prefill rank r, a batch per
request (per layer in the step).  Different: decode rank r reads the set
_source_ranks() names through a segment set, one read per request (in the
step too: the first layer waits for it).  FlashInfer's joint K/V blocks
carry no block description: those engines need equal TP.
"""
import concurrent.futures
import hashlib
import json
import logging
import os
import select
import time

from . import _lib
from ._vllm_base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from .agent import Agent, serving_transports, slot_number
from .errors import SegxferError, code, error

log = logging.getLogger("segxfer.vllm")

CONNECTOR_VERSION = 1
_NEEDED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_segment")


MAX_TP = 255   # a tp size travels in the notice tag's low byte


def _tag_key(request_id):
    """The prefill request's part of its notice tag (56 bits)."""
    return int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=7).digest(),
                          "little")


def notify_tag(request_id, reader_tp=1):
    """The 64-bit tag of a prefill request's read notices: both sides
    compute the upper 56 bits from the prefill's request id; the low byte is
    the reading decode's tp size, from which the prefill knows how many
    decode ranks read each of its ranks."""
    if not 1 <= reader_tp <= MAX_TP:
        raise ValueError("a tp size of 1..%d (got %r)" % (MAX_TP, reader_tp))
    return _tag_key(request_id) << 8 | reader_tp


def readers_per_rank(reader_tp, tp_size):
    """How many decode ranks read one prefill rank: decode tp // prefill tp
    when the decode has more ranks (each reads its heads' share), else one
    (NIXL's consumers_per_producer)."""
    return reader_tp // tp_size if reader_tp > tp_size else 1


def source_ranks(tp_rank, tp_size, remote_tp):
    """The prefill ranks decode rank tp_rank of tp_size reads: itself with
    equal TP; a block of remote_tp // tp_size ranks (its heads spread over
    them) or rank tp_rank // (tp_size // remote_tp) (its heads a part of
    one).  Sizes neither of which divides the other are refused, as NIXL
    refuses them: a prefill rank would then be read by a number of decode
    ranks that readers_per_rank cannot tell, and free its blocks early."""
    if remote_tp == tp_size:
        return [tp_rank]
    if remote_tp % tp_size == 0:
        k = remote_tp // tp_size
        return list(range(tp_rank * k, (tp_rank + 1) * k))
    if tp_size % remote_tp == 0:
        return [tp_rank // (tp_size // remote_tp)]
    raise error(code("SX_EINCOMPAT"), "prefill tp_size %d, decode tp_size %d: one must "
                "divide the other" % (remote_tp, tp_size))


def _extra(vllm_config, key, default=None):
    cfg = vllm_config.kv_transfer_config
    get = getattr(cfg, "get_from_extra_config", None)
    if get is not None:
        return get(key, default)
    return (getattr(cfg, "kv_connector_extra_config", None) or {}).get(key, default)


def compat_hash(vllm_config):
    """vLLM's compatibility factors as a fingerprint: prefill and decode
    must agree on every one, or check() refuses the peer."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm import __version__ as vllm_version
    except ImportError:
        vllm_version = None
    factors = {
        "vllm_version": vllm_version, "segxfer_connector_version": CONNECTOR_VERSION,
        "model": str(model.model), "dtype": str(model.dtype),
        "num_kv_heads": model.get_total_num_kv_heads(), "head_size": model.get_head_size(),
        "num_hidden_layers": model.get_total_num_hidden_layers(),
        "cache_dtype": str(cache.cache_dtype)}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()
    return "vllm:" + digest


def _bad_params(params):
    """What is wrong with a remote prefill's kv_transfer_params (they come
    with the client's request), or None."""
    missing = [k for k in _NEEDED if k not in params]
    if missing:
        return "no " + ", ".join(missing)
    ids = params["remote_block_ids"]
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**63 for b in ids):
        return "remote_block_ids is not a list of block ids"
    seg = params["remote_segment"]
    if not isinstance(seg, str) or not seg or len(seg) > 180:
        return "remote_segment is not a segment name"
    if not isinstance(params["remote_request_id"], (str, int)):
        return "remote_request_id is not a request id"
    tp = params.get("tp_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        return "tp_size is not an integer of 1..%d" % MAX_TP
    return None


def _status_name(status):
    return getattr(status, "name", str(status)).rpartition(".")[2]


class RecvMeta:
    """One request the decode side loads: its blocks and the prefill's."""

    __slots__ = ("local_block_ids", "remote_block_ids", "remote_engine_id",
                 "remote_request_id", "remote_segment", "tp_size")

    def __init__(self, local_block_ids, params):
        self.local_block_ids = list(local_block_ids)
        self.remote_block_ids = list(params["remote_block_ids"])
        self.remote_engine_id = params["remote_engine_id"]
        self.remote_request_id = params["remote_request_id"]
        self.remote_segment = params["remote_segment"]
        self.tp_size = params.get("tp_size", 1)


class SegxferConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-side connector hands the workers each step."""

    def __init__(self):
        self.reqs_to_recv = {}         # request id -> RecvMeta
        self.reqs_to_send = {}         # request id -> expiry (time.perf_counter)
        self.reqs_in_batch = set()     # prefill requests computed this step
        self.reqs_not_processed = set()


class SegxferConnector(KVConnectorBase_V1):
    """vLLM's KVConnectorBase_V1 over segxfer (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        if self.engine_id is None:
            raise ValueError("SegxferConnector: kv_transfer_config.engine_id is not set")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = _Scheduler(vllm_config, self.engine_id)
            self.connector_worker = None
        else:
            self.connector_scheduler = None
            self.connector_worker = _Worker(vllm_config, self.engine_id, kv_cache_config)

    # ------------------------------------------------------------ scheduler

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return self.connector_scheduler.update_state_after_alloc(request, blocks,
                                                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches):
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not isinstance(meta, SegxferConnectorMetadata):
            raise TypeError("SegxferConnector: connector metadata of type %s"
                            % type(meta).__name__)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name):
        self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing to save: the decode side pulls from the registered cache."""

    def wait_for_save(self):
        """Nothing to wait for (see save_kv_layer)."""

    def get_finished(self, finished_req_ids):
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self):
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


class _Scheduler:
    """The scheduler side: which requests load or send, in vLLM's terms."""

    def __init__(self, vllm_config, engine_id):
        self.engine_id = engine_id
        self.segment = "%s/%s" % (_extra(vllm_config, "prefix", "vllm"), engine_id)
        self.tp_size = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
        self.load_async = bool(_extra(vllm_config, "load_async", True))
        self.abort_timeout = float(_extra(vllm_config, "abort_request_timeout", 480))
        self._need_recv = {}      # request id -> (request, local block ids)
        self._need_send = {}      # request id -> expiry
        self._in_batch = set()
        self._not_processed = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """A remote prefill's prompt tokens, all of them from the peer."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            bad = _bad_params(params)
            if bad is None and not params["remote_block_ids"]:
                bad = "no remote_block_ids"   # nothing would ever arrive
            if bad is not None:
                log.warning("request %s: kv_transfer_params refused (%s); its KV is computed "
                            "here", request.request_id, bad)
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, self.load_async
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._in_batch.add(request.request_id)
        elif params.get("do_remote_prefill"):
            if params.get("remote_block_ids"):
                bad = _bad_params(params)
                if bad is not None:
                    log.warning("request %s: kv_transfer_params refused (%s); its KV is "
                                "computed here", request.request_id, bad)
                else:
                    # Only blocks without a local prefix-cache hit are read.
                    local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 \
                        else []
                    self._need_recv[request.request_id] = (request, local)
            # One transfer per request.
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output):
        meta = SegxferConnectorMetadata()
        for req_id, (req, local) in self._need_recv.items():
            meta.reqs_to_recv[req_id] = RecvMeta(local, req.kv_transfer_params)
        meta.reqs_to_send = self._need_send
        meta.reqs_in_batch = self._in_batch
        meta.reqs_not_processed = self._not_processed
        self._need_recv = {}
        self._need_send = {}
        self._in_batch = set()
        self._not_processed = set()
        return meta

    def request_finished(self, request, block_ids):
        """A finished prefill keeps its blocks until the decode read them
        (True) and says where: segment name and block ids, no address."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before it was scheduled: nothing is read; the
            # prefill's blocks go at its abort_request_timeout.
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if _status_name(request.status) != "FINISHED_LENGTH_CAPPED":
            self._not_processed.add(request.request_id)
            return False, None
        delay = len(block_ids) > 0
        if delay:
            self._need_send[request.request_id] = time.perf_counter() + self.abort_timeout
        return delay, dict(do_remote_prefill=True, do_remote_decode=False,
                           remote_block_ids=list(block_ids), remote_engine_id=self.engine_id,
                           remote_request_id=request.request_id,
                           remote_segment=self.segment, tp_size=self.tp_size)


def _tp(vllm_config):
    """(rank, size) of this worker's tensor-parallel group."""
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001  (no vLLM, or its groups are not set up)
        return (int(_extra(vllm_config, "tp_rank", 0)),
                getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))


def _kv_layout(vllm_config):
    layout = _extra(vllm_config, "kv_layout")
    if layout is None:
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout
            layout = get_kv_cache_layout()
        except Exception:  # noqa: BLE001  (no vLLM)
            layout = ""
    return layout


class _Load:
    """A request's running read batches on the decode side."""

    __slots__ = ("meta", "batches")

    def __init__(self, meta):
        self.meta, self.batches = meta, []


class _SetResult:
    """A segment-set read's end in the terms _settle reads of a batch's."""

    def __init__(self, ok, message, state, failed):
        self.ok, self.message, self.state = ok, message, state
        self.failed_blocks = [(None, b) for b in failed]


class _SetRead:
    """A segment-set read (Group.read_blocks waits) on the set's own thread,
    so loads run between steps as batches do; one read at a time per set."""

    def __init__(self, pool, group, remote, local, timeout, tag):
        self.local = list(local)
        self.future = pool.submit(self._read, group, remote, local, timeout, tag)

    @staticmethod
    def _read(group, remote, local, timeout, tag):
        try:
            return group.read_blocks(remote, local, timeout, tag)
        except SegxferError as e:
            if e.code != code("SX_ELIMIT"):
                raise
            why = str(e)
        # A notice would list too many ranges (a head slice of NHD blocks is
        # a range per token): nothing was sent.  Read without one: the KV
        # arrives, and the prefill frees at its abort_request_timeout.
        log.warning("a read notice would list too many ranges for %d blocks (%s); read "
                    "without one: the prefill frees them at its abort_request_timeout",
                    len(local), why)
        return group.read_blocks(remote, local, timeout)

    def done(self):
        return self.future.done()

    def wait(self):
        concurrent.futures.wait([self.future])

    def result(self):
        try:
            r = self.future.result()
        except Exception as e:  # noqa: BLE001  (refused before anything was sent:
            # a load error, never an exception in vLLM's worker loop)
            return _SetResult(False, "%s: %s" % (type(e).__name__, e), "FAILED", self.local)
        return _SetResult(r.ok, r.message, r.state, r.failed if not r.ok else [])

    def close(self):
        """Nothing to free: the set outlives its reads."""


class _Set:
    """An open segment set and the thread its reads run on."""

    def __init__(self, group):
        self.group = group
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "segxfer-set")

    def close(self):
        self.pool.shutdown(wait=True)
        self.group.close()


def _block_desc(part, total_heads):
    """Agent keywords describing the blocks of one layer's K (or MLA) part:
    [num_blocks, tokens, heads, head_dim] with the physical order from its
    strides (vLLM's HND keeps the logical shape and permutes the strides),
    or [num_blocks, tokens, dim] for MLA; None for what it cannot describe."""
    shape, stride = tuple(part.shape), tuple(part.stride())
    if len(shape) == 3:
        return dict(kv_layout="MLA", block_tokens=shape[1], head_dim=shape[2])
    if len(shape) != 4:
        return None
    order = "NHD" if stride[1] >= stride[2] else "HND"
    return dict(kv_layout=order, block_tokens=shape[1], head_dim=shape[3],
                kv_heads=(None, shape[2], max(total_heads, shape[2])))


class _Worker:
    """The worker side: one agent per worker, publishing its KV cache as
    <prefix>/<engine_id>/tp<rank>, reading peers' by name."""

    def __init__(self, vllm_config, engine_id, kv_cache_config=None):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.url = _extra(vllm_config, "metadata_url") or os.environ.get("SX_METADATA_URL")
        if not self.url:
            raise ValueError("SegxferConnector: no metadata URL (kv_connector_extra_config "
                             "metadata_url, or SX_METADATA_URL)")
        self.prefix = _extra(vllm_config, "prefix", "vllm")
        self.transports = serving_transports(_extra(vllm_config, "transports", "auto"))
        self.load_async = bool(_extra(vllm_config, "load_async", True))
        self.transfer_timeout = float(_extra(vllm_config, "transfer_timeout", 30))
        self.open_timeout = float(_extra(vllm_config, "open_timeout", 5))
        self.fingerprint = _extra(vllm_config, "fingerprint") or compat_hash(vllm_config)
        self.kv_layout = _kv_layout(vllm_config)
        self.log_level = _extra(vllm_config, "log_level", "warn")
        self.takeover = bool(_extra(vllm_config, "takeover", False))
        self.lease_ms = _extra(vllm_config, "lease_ms")
        self.tp_rank, self.tp_size = _tp(vllm_config)
        if not 1 <= self.tp_size <= MAX_TP:
            raise ValueError("SegxferConnector: tensor_parallel_size %d (1..%d)"
                             % (self.tp_size, MAX_TP))
        self.total_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.segment_name = "%s/%s/tp%d" % (self.prefix, engine_id, self.tp_rank)
        self.agent = None
        self.layers = {}          # layer name -> layer index
        self.cover = frozenset()  # (layer, slot) of every registered region
        self._segments = {}       # peer segment name -> checked Segment
        self._sets = {}           # (peer engine name, its tp size) -> _Set
        self._region_keys = {}    # region id -> (layer, slot number)
        self._retired = []        # segments of failed peers, closed when idle
        self._loads = {}          # request id -> _Load (asynchronous)
        self._layer_batches = {}  # layer index -> [(request id, batch)] (in-step loads)
        self._step_loads = {}     # request id -> _Load (in-step)
        self._invalid = set()
        self._failed_recv = set()
        self._to_send = {}        # request id -> expiry
        self._to_process = set()
        self._tags = {}           # notify tag key (_tag_key) -> request id
        self._read = {}           # request id -> {reader: (layer, slot) its notices covered}

    # ------------------------------------------------------------ registering

    def _parts(self, cache):
        """[(slot, tensor [num_blocks, ...])] of one layer's cache: K and V
        apart (FlashAttention's [2, num_blocks, ...]), or one tensor whose
        block holds both (blocks first: FlashInfer, MLA)."""
        shape = tuple(cache.shape)
        if len(shape) >= 3 and shape[0] == 2 and (self.num_blocks is None or
                                                  shape[1] == self.num_blocks):
            return [("K", cache[0]), ("V", cache[1])]
        return [("K", cache)]

    def register_kv_caches(self, kv_caches):
        """Register every layer's cache (its K and V, or its joint blocks)
        as regions of layer i, then publish."""
        if not kv_caches:
            raise ValueError("SegxferConnector: no KV caches to register")
        first = next(iter(kv_caches.values()))
        from . import dtype_name
        parts = self._parts(first)
        # K and V apart (or MLA's one latent) is what a block description
        # says; joint K/V blocks are read whole, with equal TP only.
        desc = _block_desc(parts[0][1], self.total_heads) if len(parts) == 2 or \
            first.dim() == 3 else None
        self.agent = Agent(
            self.segment_name, self.url, transports=self.transports,
            fingerprint=self.fingerprint, tag=self.kv_layout,
            dtype=dtype_name(first.dtype), tp_rank=self.tp_rank,
            tp_size=self.tp_size, lease_ms=self.lease_ms, log_level=self.log_level,
            **(desc or {}))
        seen, cover = set(), set()
        for name, cache in kv_caches.items():
            index = len(self.layers)
            self.layers[name] = index
            for slot, part in self._parts(cache):
                if part.data_ptr() in seen:  # layers sharing one tensor
                    continue
                seen.add(part.data_ptr())
                blocks = part.shape[0]
                size = part.numel() * part.element_size()
                region = self.agent.register(part, layer_first=index, layers=1, slot=slot,
                                             block_bytes=size // blocks, num_blocks=blocks)
                cover.add((index, slot_number(slot)))
                self._region_keys[region.id] = (index, slot_number(slot))
        self.cover = frozenset(cover)
        try:
            self.agent.publish(takeover=self.takeover)
        except SegxferError as e:
            if e.code != code("SX_EHELD"):
                raise
            raise error(e.code, "%s (a restarted engine with the same engine_id: wait for the "
                        "old lease to lapse, or set takeover)" % e) from None

    # ------------------------------------------------------------ loading

    def _source_ranks(self, meta):
        """The segment names of the prefill ranks this worker reads a
        request from (source_ranks)."""
        return ["%s/tp%d" % (meta.remote_segment, r)
                for r in source_ranks(self.tp_rank, self.tp_size, meta.tp_size)]

    def _set(self, meta):
        """The prefill ranks of another tp size, opened as a set and
        planned once (IncompatibleLayout or SX_ENOENT before any read)."""
        key = (meta.remote_segment, meta.tp_size)
        s = self._sets.get(key)
        if s is None:
            g = self.agent.open_group(self._source_ranks(meta), timeout=self.open_timeout)
            log.info("reading %s (tp %d) at tp rank %d of %d:\n%s", meta.remote_segment,
                     meta.tp_size, self.tp_rank, self.tp_size, g.plan())
            s = self._sets[key] = _Set(g)
        return s

    def _segment(self, name):
        """The peer's segment, opened and checked once (check() before any
        read: fingerprint, dtype, layout tag, block sizes)."""
        seg = self._segments.get(name)
        if seg is None:
            seg = self.agent.open(name, timeout=self.open_timeout)
            try:
                seg.check()
            except BaseException:
                seg.close()
                raise
            self._segments[name] = seg
        return seg

    def _fail(self, req_id, local_ids, why):
        log.error("request %s: loading its KV failed, %d blocks to recompute: %s",
                  req_id, len(local_ids), why)
        self._invalid.update(local_ids)

    def start_load_kv(self, meta):
        for req_id, m in meta.reqs_to_recv.items():
            local = m.local_block_ids
            if not local:
                continue  # a full prefix-cache hit: nothing to read
            remote = m.remote_block_ids[-len(local):]  # a partial hit reads the tail
            load = _Load(m)
            tag = notify_tag(m.remote_request_id, self.tp_size)
            try:
                if m.tp_size != self.tp_size:
                    s = self._set(m)
                    b = _SetRead(s.pool, s.group, remote, local, self.transfer_timeout, tag)
                    load.batches.append(b)
                    if not self.load_async:
                        # One read for every layer: the first layer waits.
                        first = min(self.layers.values())
                        self._layer_batches.setdefault(first, []).append((req_id, b))
                for name in self._source_ranks(m) if m.tp_size == self.tp_size else ():
                    seg = self._segment(name)
                    if self.load_async:
                        load.batches.append(seg.read_blocks(
                            remote, local, timeout=self.transfer_timeout, notify_tag=tag))
                    else:
                        for index in sorted(set(self.layers.values())):
                            b = seg.read_blocks(remote, local, layers=(index, 1),
                                                timeout=self.transfer_timeout,
                                                notify_tag=tag)
                            load.batches.append(b)
                            self._layer_batches.setdefault(index, []).append((req_id, b))
            except SegxferError as e:
                self._drop_segments(m)
                for b in load.batches:
                    b.close()
                self._layer_batches = {i: [(r, b) for r, b in v if r != req_id]
                                       for i, v in self._layer_batches.items()}
                self._fail(req_id, local, e)
                if self.load_async:
                    self._failed_recv.add(req_id)
                continue
            (self._loads if self.load_async else self._step_loads)[req_id] = load
        # The prefill side: requests computed here, then finished.
        for req_id in meta.reqs_in_batch:
            self._to_process.add(req_id)
            self._tags[_tag_key(req_id)] = req_id
        for req_id in meta.reqs_not_processed:
            self._forget(req_id)
        for req_id, expiry in meta.reqs_to_send.items():
            if req_id in self._to_process:
                self._to_send[req_id] = expiry

    def _drop_segments(self, meta):
        """Forget a failed peer's segments, so the next load opens it anew
        (a restarted prefill).  Closing one would end other requests'
        batches on it: they are closed once no load runs."""
        if meta.tp_size != self.tp_size:
            s = self._sets.pop((meta.remote_segment, meta.tp_size), None)
            if s is not None:
                self._retired.append(s)
            return
        for name in self._source_ranks(meta):
            seg = self._segments.pop(name, None)
            if seg is not None:
                self._retired.append(seg)

    def _close_retired(self):
        if self._retired and not self._loads and not self._step_loads:
            for seg in self._retired:
                seg.close()
            self._retired = []

    def _settle(self, req_id, load):
        """A load whose batches all ended: blocks of failed entries (or all
        of them) become load errors."""
        failed = set()
        why = None
        for b in load.batches:
            res = b.result()
            if not res.ok:
                why = res.message or res.state
                ids = [local for _, local in res.failed_blocks]
                failed.update(ids or load.meta.local_block_ids)
            b.close()
        if failed:
            self._drop_segments(load.meta)
            self._fail(req_id, sorted(failed), why)

    def wait_for_layer_load(self, layer_name):
        """In-step loads (load_async False): wait for this layer's batches."""
        index = self.layers.get(layer_name)
        for _, b in self._layer_batches.pop(index, ()):
            b.wait()

    def _finish_step_loads(self):
        for index in list(self._layer_batches):
            for _, b in self._layer_batches.pop(index):
                b.wait()
        for req_id, load in self._step_loads.items():
            self._settle(req_id, load)
        self._step_loads = {}

    # ------------------------------------------------------------ finishing

    def _ended(self):
        """Request ids whose read batches all ended, from their fds."""
        fds, pending = {}, set()
        for req_id, load in self._loads.items():
            for b in load.batches:
                if isinstance(b, _SetRead):
                    if not b.done():
                        pending.add(req_id)
                else:
                    fds[b.fileno()] = req_id
        if not fds:
            return set(self._loads) - pending
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(0)}
        pending |= {fds[fd] for fd in fds if fd not in ready}
        return set(self._loads) - pending

    def _notices(self):
        """Prefill requests every layer and slot of which the read notices
        say each decode rank reading this rank has (one reader with equal
        TP or fewer decode ranks; decode tp // prefill tp with more)."""
        done = set()
        if self.agent is None:
            return done
        for n in self.agent.notices():
            if n.kind != "read":
                continue
            req_id = self._tags.get(n.tag >> 8)
            reader_tp = n.tag & 0xff
            if req_id is None or req_id not in self._to_process or reader_tp == 0:
                log.warning("a read notice from %s names no request waiting here (tag %d); "
                            "it may have expired", n.producer or "a reader", n.tag)
                continue
            got = self._read.setdefault(req_id, {}).setdefault(n.producer, set())
            for run in n.blocks:
                for layer in range(run.layer_first, run.layer_first + run.layer_count):
                    got.update((layer, s) for s in range(_lib.MAX_SLOTS) if run.slots >> s & 1)
            # A set read's notice lists ranges: each in one registered region.
            got.update(self._region_keys[r.region] for r in n.ranges
                       if r.region in self._region_keys)
            readers = sum(self.cover <= c for c in self._read[req_id].values())
            if readers >= readers_per_rank(reader_tp, self.tp_size):
                done.add(req_id)
                self._forget(req_id)
        return done

    def _forget(self, req_id):
        self._to_process.discard(req_id)
        self._to_send.pop(req_id, None)
        self._read.pop(req_id, None)
        self._tags.pop(_tag_key(req_id), None)

    def get_finished(self):
        """(done sending, done receiving): prefill requests whose blocks the
        decode read (read notices) or that expired; decode requests whose
        batches ended (batch fds), failed ones included."""
        self._finish_step_loads()
        done_sending = self._notices()
        done_recving = set()
        for req_id in self._ended():
            self._settle(req_id, self._loads.pop(req_id))
            done_recving.add(req_id)
        done_recving |= self._failed_recv
        self._failed_recv = set()
        self._close_retired()
        now = time.perf_counter()
        for req_id, expiry in list(self._to_send.items()):
            if now >= expiry:
                log.warning("request %s: no read notice within its timeout; its blocks are "
                            "freed", req_id)
                self._forget(req_id)
                done_sending.add(req_id)
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self):
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self):
        for load in list(self._loads.values()) + list(self._step_loads.values()):
            for b in load.batches:
                b.close()
        self._loads, self._step_loads, self._layer_batches = {}, {}, {}
        for seg in list(self._segments.values()) + list(self._sets.values()) + self._retired:
            seg.close()
        self._segments, self._sets, self._retired = {}, {}, []
        if self.agent is not None:
            self.agent.close()
            self.agent = None
