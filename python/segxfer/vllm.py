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
  derived from the prefill's request id); the prefill frees the blocks once
  read notices covered every layer and slot it registered, or after
  abort_request_timeout seconds.

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

Equal tensor parallelism only: decode rank r reads prefill rank r.
Heterogeneous TP (fan-in/fan-out reads) plugs into _source_ranks().
"""
import hashlib
import json
import logging
import os
import select
import time

from . import _lib
from ._vllm_base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from .agent import Agent, slot_number
from .errors import SegxferError, code, error

log = logging.getLogger("segxfer.vllm")

CONNECTOR_VERSION = 1
_NEEDED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_segment")


def notify_tag(request_id):
    """The 64-bit tag of a prefill request's read notices: both sides
    compute it from the prefill's request id."""
    return int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=8).digest(),
                          "little")


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
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return "tp_size is not a positive integer"
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
        self.transports = _extra(vllm_config, "transports", "auto")
        self.load_async = bool(_extra(vllm_config, "load_async", True))
        self.transfer_timeout = float(_extra(vllm_config, "transfer_timeout", 30))
        self.open_timeout = float(_extra(vllm_config, "open_timeout", 5))
        self.fingerprint = _extra(vllm_config, "fingerprint") or compat_hash(vllm_config)
        self.kv_layout = _kv_layout(vllm_config)
        self.log_level = _extra(vllm_config, "log_level", "warn")
        self.takeover = bool(_extra(vllm_config, "takeover", False))
        self.lease_ms = _extra(vllm_config, "lease_ms")
        self.tp_rank, self.tp_size = _tp(vllm_config)
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.segment_name = "%s/%s/tp%d" % (self.prefix, engine_id, self.tp_rank)
        self.agent = None
        self.layers = {}          # layer name -> layer index
        self.cover = frozenset()  # (layer, slot) of every registered region
        self._segments = {}       # peer segment name -> checked Segment
        self._retired = []        # segments of failed peers, closed when idle
        self._loads = {}          # request id -> _Load (asynchronous)
        self._layer_batches = {}  # layer index -> [(request id, batch)] (in-step loads)
        self._step_loads = {}     # request id -> _Load (in-step)
        self._invalid = set()
        self._failed_recv = set()
        self._to_send = {}        # request id -> expiry
        self._to_process = set()
        self._tags = {}           # notify tag -> request id
        self._read = {}           # request id -> (layer, slot) its read notices covered

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
        self.agent = Agent(
            self.segment_name, self.url, transports=self.transports,
            fingerprint=self.fingerprint, tag=self.kv_layout,
            dtype=dtype_name(first.dtype), tp_rank=self.tp_rank,
            tp_size=self.tp_size, lease_ms=self.lease_ms, log_level=self.log_level)
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
                self.agent.register(part, layer_first=index, layers=1, slot=slot,
                                    block_bytes=size // blocks, num_blocks=blocks)
                cover.add((index, slot_number(slot)))
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
        request from.  Equal TP: rank r reads rank r.  Heterogeneous TP
        (fan-in/fan-out reads of head ranges) hooks in here."""
        if meta.tp_size != self.tp_size:
            raise error(code("SX_EINCOMPAT"), "prefill tp_size %s, decode tp_size %d: only "
                        "equal tensor parallelism is supported" % (meta.tp_size, self.tp_size))
        return ["%s/tp%d" % (meta.remote_segment, self.tp_rank)]

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
            try:
                for name in self._source_ranks(m):
                    seg = self._segment(name)
                    tag = notify_tag(m.remote_request_id)
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
            self._tags[notify_tag(req_id)] = req_id
        for req_id in meta.reqs_not_processed:
            self._forget(req_id)
        for req_id, expiry in meta.reqs_to_send.items():
            if req_id in self._to_process:
                self._to_send[req_id] = expiry

    def _drop_segments(self, meta):
        """Forget a failed peer's segments, so the next load opens it anew
        (a restarted prefill).  Closing one would end other requests'
        batches on it: they are closed once no load runs."""
        for name in self._source_ranks(meta) if meta.tp_size == self.tp_size else ():
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
        fds = {}
        for req_id, load in self._loads.items():
            for b in load.batches:
                fds[b.fileno()] = req_id
        if not fds:
            return set()
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(0)}
        pending = {fds[fd] for fd in fds if fd not in ready}
        return set(fds.values()) - pending

    def _notices(self):
        """Prefill requests every layer and slot of which the read notices
        say the decode has."""
        done = set()
        if self.agent is None:
            return done
        for n in self.agent.notices():
            if n.kind != "read":
                continue
            req_id = self._tags.get(n.tag)
            if req_id is None or req_id not in self._to_process:
                log.warning("a read notice from %s names no request waiting here (tag %d); "
                            "it may have expired", n.producer or "a reader", n.tag)
                continue
            got = self._read.setdefault(req_id, set())
            for run in n.blocks:
                for layer in range(run.layer_first, run.layer_first + run.layer_count):
                    got.update((layer, s) for s in range(_lib.MAX_SLOTS) if run.slots >> s & 1)
            if self.cover <= got:
                done.add(req_id)
                self._forget(req_id)
        return done

    def _forget(self, req_id):
        self._to_process.discard(req_id)
        self._to_send.pop(req_id, None)
        self._read.pop(req_id, None)
        self._tags.pop(notify_tag(req_id), None)

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
        for seg in list(self._segments.values()) + self._retired:
            seg.close()
        self._segments, self._retired = {}, []
        if self.agent is not None:
            self.agent.close()
            self.agent = None
