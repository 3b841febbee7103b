"""A prefill/decode KV transfer backend for SGLang over segxfer's push mode.

SGLang (sgl-project/sglang, python/sglang/srt/disaggregation/) moves a
request's KV from prefill to decode through a backend of four classes
(base/conn.py at 0094505d: BaseKVManager, BaseKVSender, BaseKVReceiver and
a bootstrap server), chosen by get_kv_class in utils.py (000eaffa).  Its
Mooncake backend (mooncake/conn.py at 0005973a) sends the decode's raw buffer
pointers and a transfer-engine session (ip:port) to the prefill over a ZMQ
side channel, and the prefill writes into those addresses.

This backend keeps SGLang's bootstrap server and side channel for what they
do that segxfer does not (finding the prefill ranks of a request; sending
the decode's page indices per request) and replaces the rest:

- Each engine rank's KV, aux and state buffers are regions of a segment it
  publishes by name in the metadata store (SX_METADATA_URL), under a lease.
  Peers are told segment names, never addresses or pointers.
- The decode grants the prefill's segment write access (one incarnation:
  a restarted prefill must register again) once the prefill has opened the
  decode's segment and checked its layout against its own; only then does
  the prefill's request leave Bootstrapping, so nothing is written before
  the check and the grant.
- send() is one write batch per request (per chunk with chunked prefill):
  every layer, K and V, and on the last chunk the aux row and the state
  slots, tagged with the bootstrap room.  (A batch whose notice would list
  more than 1024 runs is split; see _Plan.)
- The decode's poll turns Success when the notices tagged with the room,
  from that prefill, add up to every byte the request expects: a notice is
  sent only after every byte of its batch is in the decode's memory.
- Failure: the prefill learns it from the batch (refused, timed out,
  disconnected) and tells the decode; the decode learns it from that
  message, from the waiting deadline (SGLANG_DISAGGREGATION_WAITING_TIMEOUT),
  or from the prefill's segment no longer answering (a killed prefill).  Both
  report through failure_exception() (KVTransferError with the reason).

Different attention TP on the two sides: each prefill rank writes the head
slices it shares with each decode rank (_sglang_slices; see _tp_plan).
docs/engines.md#sglang has the
settings and how SGLang loads this backend (segxfer's .pth hook).

Files: this one (publishing, the manager's setup and teardown, sender,
receiver, get_kv_class), _sglang_prefill.py and _sglang_decode.py (the
manager's prefill and decode sides), _sglang_proto.py (what both share),
_sglang_compat.py (SGLang's classes or their stand-in).

The classes derive from SGLang's CommonKVManager/Sender/Receiver when SGLang
is importable, else from the stand-in in segxfer._sglang_compat; they are
built on first use (module __getattr__), so importing this module imports
neither.
"""
import json
import logging
import operator
import os
import socket
import threading
import time

import numpy as np

from . import _sglang_compat, _sglang_slices
from ._sglang_decode import DecodeSide
from ._sglang_prefill import PrefillSide
from ._sglang_proto import (_REGISTER, _ROOM, GROUP_AUX, GROUP_KV, GROUP_STATE, _env,
                            _env_seconds, _ids, cancel, send)
from .agent import Agent, serving_transports
from .errors import SegxferError

logger = logging.getLogger("segxfer.sglang")


class _Part:
    """One agent (segment) of an engine rank.  A rank whose buffers all lie
    in one kind of memory has one part ("kv": KV, aux, state).  A rank with
    its KV on a GPU and its aux rows in host memory (SGLang's MetadataBuffers
    are host memory) has two, "kv" and "aux": a segment that is all GPU
    memory can take cuda_ipc writes on one host, which a mixed one cannot."""

    __slots__ = ("key", "agent", "name", "groups")

    def __init__(self, key, agent, name):
        self.key, self.agent, self.name, self.groups = key, agent, name, set()


def _int_list(v, what, positive=False):
    """v (a list or tuple of integers) as a list of ints, or ValueError."""
    if not isinstance(v, (list, tuple)):
        raise ValueError("segxfer: KVArgs.%s must be a list of integers (got %s)"
                         % (what, type(v).__name__))
    out = []
    for i, x in enumerate(v):
        try:
            n = operator.index(x)
        except TypeError:
            n = None
        if n is None or isinstance(x, bool) or n < (1 if positive else 0):
            raise ValueError("segxfer: KVArgs.%s[%d] must be a %s integer (got %r)"
                             % (what, i, "positive" if positive else "non-negative", x))
        out.append(n)
    return out


def _check_kv_args(a):
    """Refuse KVArgs whose buffer lists do not pair up (zip would silently
    drop the buffers past the shortest list), sizes that are not integers,
    or a page size that is not a positive integer, before anything is bound
    or registered.  (A buffer of 0 bytes or items of 0 bytes is left out of
    the segment, as SGLang's own backends leave it out.)"""
    page = getattr(a, "page_size", None)
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ValueError("segxfer: KVArgs.page_size must be a positive integer (got %r)"
                         % (page,))

    def triple(ptrs, lens, items, what, at=""):
        names = ["%s_%s%s" % (what, k, at) for k in ("data_ptrs", "data_lens", "item_lens")]
        ptrs, lens, items = (_int_list(x, k) for x, k in zip((ptrs, lens, items), names))
        if not len(ptrs) == len(lens) == len(items):
            raise ValueError("segxfer: KVArgs.%s, %s and %s differ in length (%d, %d, %d)"
                             % tuple(names + [len(ptrs), len(lens), len(items)]))

    triple(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, "kv")
    triple(a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens, "aux")
    states = [getattr(a, "state_data_%s" % k, None) or [] for k in ("ptrs", "lens")]
    states.append(getattr(a, "state_item_lens", None) or [])
    if not len(states[0]) == len(states[1]) == len(states[2]):
        raise ValueError("segxfer: KVArgs.state_data_ptrs, state_data_lens and "
                         "state_item_lens differ in length (%d, %d, %d)"
                         % tuple(len(x) for x in states))
    for c, (ptrs, lens, items) in enumerate(zip(*states)):
        triple(ptrs, lens, items, "state", "[%d]" % c)


def _layout_parts(kv_args, is_mla):
    """[(key, group, layer, slot, ptr, length, item_len)]: every buffer of
    kv_args as a region, by part.  MHA buffers are K of layers 0..L-1 then
    V (SGLang's get_contiguous_buf_infos order); MLA buffers one per layer."""
    regions = []
    kv = list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens))
    if not is_mla and len(kv) % 2 == 0 and kv:
        half = len(kv) // 2
        for i, (p, n, item) in enumerate(kv):
            regions.append((GROUP_KV, i % half, "K" if i < half else "V", p, n, item))
    else:
        for i, (p, n, item) in enumerate(kv):
            regions.append((GROUP_KV, i, "K", p, n, item))
    for j, (p, n, item) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens,
                                         kv_args.aux_item_lens)):
        regions.append((GROUP_AUX, j, "K", p, n, item))
    for c, (ptrs, lens, items) in enumerate(zip(getattr(kv_args, "state_data_ptrs", []) or [],
                                                getattr(kv_args, "state_data_lens", []) or [],
                                                getattr(kv_args, "state_item_lens", []) or [])):
        for t, (p, n, item) in enumerate(zip(ptrs, lens, items)):
            regions.append((GROUP_STATE + c, t, "state", p, n, item))
    return [r for r in regions if r[4] and r[5]]


def _build(api):
    """The backend's classes on top of api (see _sglang_compat.load)."""
    KVPoll = api.KVPoll
    Mode = api.DisaggregationMode
    wire_errors = api.wire_errors

    class SegxferKVManager(PrefillSide, DecodeSide, api.CommonKVManager):
        """One per engine rank (SGLang makes it in the scheduler process of
        each rank).  Publishes the rank's buffers, runs the side channel's
        thread, and on decode takes the notices."""

        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
            _check_kv_args(args)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            self._stopped = False
            self._lock = threading.RLock()
            self._wire_errors = wire_errors
            self.is_prefill = disaggregation_mode == Mode.PREFILL
            self.transfer_timeout = _env_seconds("SEGXFER_SGLANG_TRANSFER_TIMEOUT", 60.0)
            self.open_timeout = _env_seconds("SEGXFER_SGLANG_OPEN_TIMEOUT", 10.0)
            self.liveness_interval = _env_seconds("SEGXFER_SGLANG_LIVENESS_S", 1.0)
            try:
                self.parts = self._publish(args, is_mla_backend)
            except BaseException:
                # Nothing was published: the side channel's socket goes too.
                try:
                    self.server_socket.close(linger=0)
                except Exception:  # noqa: BLE001
                    pass
                raise
            self._threads = []
            if self.is_prefill:
                self.decode_peers = {}   # decode segment name -> dict
                self.room_batches = {}   # room -> [Batch]
                self.room_last_sent = set()
                self._start(self._prefill_loop, "sx-sglang-prefill")
            else:
                self.prefill_peers = {}  # (ip, port) of a prefill rank -> dict
                self.rooms = {}          # room -> dict: expected, got, endpoints
                self._start(self._decode_loop, "sx-sglang-decode")
                start_heartbeat = getattr(self, "_start_heartbeat_checker_thread", None)
                if api.real and start_heartbeat is not None:
                    start_heartbeat()    # SGLang's /health polling, where it has one

        # ------------------------------------------------------------ setup

        def _segment_base(self):
            """<prefix>/<mode>/<instance>/r<engine rank>/pp<pp rank>: unique in
            the namespace while the process lives (the instance is
            host/pid unless SEGXFER_SGLANG_NAME names it)."""
            prefix = _env("SEGXFER_SGLANG_PREFIX", "sglang")
            inst = _env("SEGXFER_SGLANG_NAME",
                        "%s/%d" % (socket.gethostname().split(".")[0], os.getpid()))
            return "%s/%s/%s/r%d/pp%d" % (prefix, "prefill" if self.is_prefill else "decode",
                                         inst, self.kv_args.engine_rank, self.pp_rank)

        def _layout(self):
            sa = self.server_args
            fp = _env("SEGXFER_FINGERPRINT")
            if fp is None:
                model = str(getattr(sa, "served_model_name", None) or
                            getattr(sa, "model_path", None) or "")
                fp = "sglang:%s:p%d" % (model.rstrip("/").rsplit("/", 1)[-1],
                                        self.kv_args.page_size)
            dtype = _env("SEGXFER_DTYPE", str(getattr(sa, "kv_cache_dtype", "") or ""))
            return dict(fingerprint=fp[:127], dtype=dtype[:31],
                        tag="sglang-mla" if self.is_mla_backend else "sglang-mha",
                        tp_rank=self.attn_tp_rank, tp_size=self.attn_tp_size,
                        pp_rank=self.pp_rank, pp_size=self.pp_size)

        def _publish(self, args, is_mla):
            from .memory import pointer_location
            regions = _layout_parts(args, is_mla)
            if not any(r[0] == GROUP_KV for r in regions):
                raise ValueError("segxfer: KVArgs has no KV buffers (kv_data_ptrs)")
            loc = {r: pointer_location(r[3], r[4]) for r in regions}
            kv_kinds = {loc[r] != "cpu" for r in regions if r[0] != GROUP_AUX}
            aux_kinds = {loc[r] != "cpu" for r in regions if r[0] == GROUP_AUX}
            # SEGXFER_SGLANG_AUX_SEGMENT: auto (a segment of its own for the aux
            # rows when they lie in another kind of memory than the KV), yes,
            # no (one segment: then no cuda_ipc for a GPU cache).
            mode = _env("SEGXFER_SGLANG_AUX_SEGMENT", "auto")
            if mode not in ("auto", "yes", "no"):
                raise ValueError("SEGXFER_SGLANG_AUX_SEGMENT must be auto, yes or no (got %r)"
                                 % mode)
            split = bool(aux_kinds) and (mode == "yes" or
                                         (mode == "auto" and kv_kinds != aux_kinds))
            base = self._segment_base()
            kw = self._layout()
            transports = serving_transports(_env("SEGXFER_TRANSPORTS", "auto"))
            extra = {}
            if _env("SEGXFER_LEASE_MS"):
                extra["lease_ms"] = int(_env("SEGXFER_LEASE_MS"))
            for key in ("listen", "advertise"):
                if _env("SEGXFER_" + key.upper()):
                    extra[key] = _env("SEGXFER_" + key.upper())
            parts = {}
            writable = not self.is_prefill
            try:
                for r in regions:
                    key = "aux" if split and r[0] == GROUP_AUX else "kv"
                    part = parts.get(key)
                    if part is None:
                        name = base if key == "kv" else base + "/aux"
                        part = parts[key] = _Part(key, Agent(
                            name, None, transports=transports, log_level="warn", **kw,
                            **extra), name)
                    group, layer, slot, ptr, length, item = r
                    part.agent.register(addr=ptr, length=length, group=group,
                                        layer_first=layer, layers=1, slot=slot,
                                        block_bytes=item, num_blocks=length // item,
                                        location=loc[r], writable=writable)
                    part.groups.add(group)
                for part in parts.values():
                    part.agent.publish()
            except BaseException:
                for part in parts.values():
                    part.agent.close()
                raise
            return parts

        def _start(self, fn, name):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

        def segment_names(self):
            return {k: p.name for k, p in self.parts.items()}

        def _tp_plan(self, remote_tp_size, remote_segment):
            """None where prefill and decode shard heads alike (equal
            attention TP): pages then map one to one, block for block.
            Where they differ, "slices": each prefill rank writes the head
            slices it shares with each decode rank it serves
            (_sglang_slices, as SGLang's Mooncake backend does in
            send_kvcache_slice); the prefill plans them from both ranks'
            statements when the decode registers.  Refused here, before any
            write, where no such plan exists (MLA, uneven ratios, heads
            that do not split evenly)."""
            remote = int(remote_tp_size)
            if remote == self.attn_tp_size:
                return None
            side = "prefill" if self.is_prefill else "decode"
            reason = None
            if self.is_mla_backend:
                reason = "MLA caches across different attention TP are not supported"
            else:
                reason = _sglang_slices.ratio_reason(self.attn_tp_size, remote,
                                                     self.kv_args.kv_head_num)
            if reason:
                raise ValueError(
                    "segxfer's SGLang backend cannot pair this %s (attn_tp_size %d, %d KV "
                    "heads a rank) with %s (attn_tp_size %d): %s"
                    % (side, self.attn_tp_size, int(self.kv_args.kv_head_num),
                       remote_segment, remote, reason))
            return "slices"

        # ------------------------------------------------------------ bytes

        def expected_bytes(self, n_pages, aux, state_indices):
            a = self.kv_args
            total = n_pages * sum(a.kv_item_lens)
            if aux:
                total += sum(a.aux_item_lens)
            for c, idx in enumerate(state_indices or []):
                if idx is not None and len(idx):
                    total += len(idx) * sum(a.state_item_lens[c])
            return total

        # ------------------------------------------------------------ teardown

        def teardown(self):
            """Stop the thread, close the segments and agents (the segments
            are unpublished at once).  The engine's buffers stay its own."""
            if self._stopped:
                return
            self._stopped = True
            for t in self._threads:
                t.join(timeout=5)
            with self._lock:
                peers = list(getattr(self, "decode_peers", {}).values()) + \
                    list(getattr(self, "prefill_peers", {}).values())
                batches = [b for bs in getattr(self, "room_batches", {}).values() for b in bs]
            for b in batches:
                b.close()
            for peer in peers:
                for seg in list(peer.get("segments", {}).values()) + [peer.get("segment")]:
                    if seg is not None:
                        seg.close()
            for part in self.parts.values():
                part.agent.close()
            try:
                self.server_socket.close(linger=0)
            except Exception:  # noqa: BLE001
                pass

        close = teardown

    def _failure_exception(self):
        """Both sides: Failed, local state cleared, KVTransferError with the
        recorded reason (as mooncake/conn.py MooncakeFailureExceptionMixin)."""
        if self.conclude_state is None:
            self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        propagated = reason is None
        raise api.KVTransferError(self.bootstrap_room, reason or
                                  "Failed due to an unknown reason from another rank",
                                  is_from_another_rank=propagated)

    class SegxferKVSender(api.CommonKVSender):
        def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank,
                     req_has_disagg_prefill_dp_rank=False):
            super().__init__(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank,
                             req_has_disagg_prefill_dp_rank)
            self.conclude_state = None
            self.init_time = time.time()
            # The destination may have arrived before this sender existed.
            mgr._room_ready(bootstrap_room)

        def send(self, kv_indices, state_indices=None, *args, **kwargs):
            kv_indices, index_slice, is_last, skip = self._prepare_send_indices(
                kv_indices, state_indices)
            if skip or self.conclude_state is not None:
                return
            room = self.bootstrap_room
            if self.kv_mgr.request_status.get(room) == KVPoll.Failed:
                return
            try:
                self.kv_mgr.submit(room, kv_indices, index_slice, is_last,
                                   self.aux_index if is_last else None,
                                   state_indices if is_last else None)
                self.kv_mgr.advance(room, KVPoll.Transferring)
            except (ValueError, SegxferError) as e:
                reason = "segxfer: the write for room %d was refused: %s" % (room, e)
                self.kv_mgr.record_failure(room, reason)
                self.kv_mgr.update_status(room, KVPoll.Failed)
                self.kv_mgr.tell_decode_failed(room, reason)

        def poll(self):
            if self.conclude_state is not None:
                return self.conclude_state
            room = self.bootstrap_room
            status = self.kv_mgr.check_status(room)
            if status == KVPoll.Transferring:
                state = self.kv_mgr.room_state(room)
                if state == KVPoll.Success:
                    self.kv_mgr.advance(room, KVPoll.Success)
                    status = self.kv_mgr.check_status(room)   # Failed if aborted meanwhile
                elif state != KVPoll.Transferring:
                    reason = "segxfer: write batch for room %d ended %s: %s %s" % (
                        room, state.state, state.error_name, state.message)
                    self.kv_mgr.record_failure(room, reason)
                    self.kv_mgr.update_status(room, KVPoll.Failed)
                    self.kv_mgr.tell_decode_failed(room, reason)
                    status = KVPoll.Failed
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
                # Ended: its batches are closed (a cancelled one waited for)
                # and its destination forgotten, as Mooncake's worker pops
                # transfer_infos once a room is done.
                self.kv_mgr.forget_room(room)
                with self.kv_mgr._lock:
                    self.kv_mgr.transfer_infos.pop(room, None)
            elif status == KVPoll.Bootstrapping:
                timed_out = self._check_bootstrap_timeout()
                if timed_out is not None:
                    return timed_out
            return status

        def failure_exception(self):
            _failure_exception(self)

        def get_transfer_metric(self):
            metric = getattr(super(), "get_transfer_metric", None)
            return metric() if metric is not None else None

        def clear(self):
            super().clear()
            self.kv_mgr.forget_room(self.bootstrap_room)

        def abort(self):
            """Failed at once; batches in flight are cancelled (nothing more
            is read from the prefill's pages once this returns) and the
            decode is told."""
            super().abort()
            room = self.bootstrap_room
            with self.kv_mgr._lock:
                batches = list(self.kv_mgr.room_batches.get(room, ()))
            for b in batches:
                cancel(b)
                b.wait(self.kv_mgr.transfer_timeout)
            self.kv_mgr.tell_decode_failed(room, "the prefill aborted the request")

    class SegxferKVReceiver(api.CommonKVReceiver):
        def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, *args, **kwargs):
            self.init_time = None
            self.transports = []    # what the room's notices came over, once concluded
            super().__init__(mgr, bootstrap_addr, bootstrap_room)
            self.conclude_state = None

        def init(self, prefill_dp_rank):
            info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
            if info is not None:
                try:
                    self.kv_mgr._tp_plan(info.attn_tp_size, "the prefill at %s"
                                         % self.bootstrap_addr)
                except ValueError as e:
                    self.kv_mgr.record_failure(self.bootstrap_room, str(e))
                    self.conclude_state = KVPoll.Failed
                    self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                    return
            super().init(prefill_dp_rank)

        def _register_kv_args(self):
            """Once per prefill rank (CommonKVReceiver caches the rank's
            bootstrap info): our segments' names instead of Mooncake's buffer
            pointers and session id, and the TP to check."""
            m = self.kv_mgr
            body = json.dumps({"segment": m.parts["kv"].name, "parts": m.segment_names(),
                               "ip": m.local_ip, "port": m.rank_port,
                               "attn_tp_size": m.attn_tp_size,
                               "tp_rank": m.kv_args.engine_rank,
                               # What the prefill plans head slices from.
                               "attn_tp_rank": m.attn_tp_rank,
                               "kv_head_num": int(m.kv_args.kv_head_num),
                               "kv_item_len": int(m.kv_args.kv_item_lens[0]),
                               "page_size": int(m.kv_args.page_size)}).encode()
            for info in self.bootstrap_infos:
                try:
                    send(self._connect_to_bootstrap_server(info), [_REGISTER, body])
                except wire_errors as e:
                    m.record_failure(self.bootstrap_room, "registering with prefill %s:%s "
                                     "failed: %s" % (info.get("rank_ip"),
                                                     info.get("rank_port"), e))
                    self.conclude_state = KVPoll.Failed
                    m.update_status(self.bootstrap_room, KVPoll.Failed)
                    return False
            return True

        def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                          decode_prefix_len=None, *args, **kwargs):
            m, room = self.kv_mgr, self.bootstrap_room
            if getattr(self, "bootstrap_infos", None) is None:
                m.record_failure(room, "Could not fetch prefill parallel info from "
                                 "bootstrap_addr: %s" % self.bootstrap_addr)
                m.update_status(room, KVPoll.Failed)
                return
            if self.conclude_state is not None:
                return
            kv = _ids(kv_indices, "kv_indices").astype(np.int32)
            states = [None if s is None else _ids(s, "state_indices").tolist()
                      for s in (state_indices or [])]
            endpoints = [(i["rank_ip"], int(i["rank_port"])) for i in self.bootstrap_infos]
            # A prefill that refused this decode fails the room here; the
            # destination still goes to it, so that its sender fails too
            # instead of waiting in Bootstrapping for its deadline.
            refused = not m.register_decode_room(room, endpoints, m.expected_bytes(
                len(kv), aux_index is not None, states))
            body = json.dumps({"dst_aux_index": aux_index, "dst_state_indices": states,
                               "required_dst_info_num": self.required_dst_info_num,
                               "decode_prefix_len": int(decode_prefix_len or 0)}).encode()
            for info in self.bootstrap_infos:
                try:
                    send(self._connect_to_bootstrap_server(info),
                         [_ROOM, str(room).encode("ascii"), m.parts["kv"].name.encode(),
                          kv.tobytes(), body])
                except wire_errors as e:
                    m.record_failure(room, "send_metadata to prefill %s:%s failed: %s"
                                     % (info.get("rank_ip"), info.get("rank_port"), e))
                    self.conclude_state = KVPoll.Failed
                    m.update_status(room, KVPoll.Failed)
                    return
            if refused:
                self.conclude_state = KVPoll.Failed
            self.init_time = time.time()

        def poll(self):
            if self.conclude_state is not None:
                return self.conclude_state
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
                with self.kv_mgr._lock:     # later notices of the room are ignored
                    r = self.kv_mgr.rooms.pop(self.bootstrap_room, None) or {}
                self.transports = sorted(r.get("transports", ()))
            elif status in (KVPoll.WaitingForInput, KVPoll.Transferring):
                timed_out = self._check_waiting_timeout()
                if timed_out is not None:
                    return timed_out
            return status

        def failure_exception(self):
            _failure_exception(self)

        def clear(self):
            super().clear()
            with self.kv_mgr._lock:
                self.kv_mgr.rooms.pop(self.bootstrap_room, None)

    class SegxferKVBootstrapServer(api.CommonKVBootstrapServer):
        pass

    return {"KVArgs": api.KVArgs, "KVPoll": KVPoll, "KVTransferError": api.KVTransferError,
            "DisaggregationMode": Mode, "SegxferKVManager": SegxferKVManager,
            "SegxferKVSender": SegxferKVSender, "SegxferKVReceiver": SegxferKVReceiver,
            "SegxferKVBootstrapServer": SegxferKVBootstrapServer, "using_sglang": api.real}


_classes = None
_classes_lock = threading.Lock()


def classes():
    """The backend's classes (built once, on SGLang's or the stand-in's)."""
    global _classes
    with _classes_lock:
        if _classes is None:
            _classes = _build(_sglang_compat.load())
        return _classes


def get_kv_class(class_type):
    """What SGLang's get_kv_class returns for this backend, by KVClassType
    (or its value: "kvargs", "manager", "sender", "receiver",
    "bootstrap_server")."""
    c = classes()
    key = getattr(class_type, "value", class_type)
    return {"kvargs": c["KVArgs"], "manager": c["SegxferKVManager"],
            "sender": c["SegxferKVSender"], "receiver": c["SegxferKVReceiver"],
            "bootstrap_server": c["SegxferKVBootstrapServer"]}.get(key)


def __getattr__(name):
    c = classes()
    if name in c:
        return c[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


__all__ = ["classes", "get_kv_class", "SegxferKVManager", "SegxferKVSender",
           "SegxferKVReceiver", "SegxferKVBootstrapServer", "KVPoll", "KVArgs",
           "KVTransferError", "DisaggregationMode"]
