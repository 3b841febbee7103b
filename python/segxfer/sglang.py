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

Equal TP only: see _tp_plan, the one place where the read/write plans of
heterogeneous TP (segxfer issue 23) plug in.  docs/engines-sglang.md has the
settings and how SGLang loads this backend (segxfer's .pth hook).

The classes derive from SGLang's CommonKVManager/Sender/Receiver when SGLang
is importable, else from the stand-in in segxfer._sglang_compat; they are
built on first use (module __getattr__), so importing this module imports
neither.
"""
import json
import logging
import os
import socket
import threading
import time

import numpy as np

from . import _sglang_compat
from .agent import Agent
from .errors import SegxferError

logger = logging.getLogger("segxfer.sglang")

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


def _runs(dst):
    """The number of runs of consecutive destination ids in dst (a notice
    merges a run into one entry)."""
    if len(dst) == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(dst) != 1))


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


class _Part:
    """One agent (segment) of an engine rank.  A rank whose buffers all lie
    in one kind of memory has one part ("kv": KV, aux, state).  A rank with
    its KV on a GPU and its aux rows in host memory (SGLang's MetadataBuffers
    are host memory) has two, "kv" and "aux": a segment that is all GPU
    memory can take cuda_ipc writes on one host, which a mixed one cannot."""

    __slots__ = ("key", "agent", "name", "groups")

    def __init__(self, key, agent, name):
        self.key, self.agent, self.name, self.groups = key, agent, name, set()


class _Entry:
    """Writes of one group: src[i] -> dst[i] in layers (0, layers), slots."""

    __slots__ = ("part", "group", "layers", "slots", "src", "dst")

    def __init__(self, part, group, layers, slots, src, dst):
        self.part, self.group, self.layers, self.slots = part, group, layers, slots
        self.src, self.dst = src, dst


def _split(entries, limit=_RUNS_PER_BATCH):
    """entries as lists of entries of at most `limit` destination runs each
    (an entry longer than that is cut at run boundaries)."""
    out, cur, runs = [], [], 0
    for e in entries:
        start = 0
        breaks = np.flatnonzero(np.diff(e.dst) != 1) + 1 if len(e.dst) else []
        bounds = list(breaks) + [len(e.dst)]
        i = 0
        while start < len(e.dst):
            room = limit - runs
            if room == 0:
                out.append(cur)
                cur, runs = [], 0
                continue
            j = min(i + room, len(bounds)) - 1
            end = bounds[j]
            cur.append(_Entry(e.part, e.group, e.layers, e.slots, e.src[start:end],
                              e.dst[start:end]))
            runs += j - i + 1
            i, start = j + 1, end
    if cur:
        out.append(cur)
    return out


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

    send_lock = threading.Lock()

    def send(sock_lock, frames):
        """Send on a side-channel socket: a manager's (from its thread and
        the scheduler's; sockets are not thread-safe) or a receiver's with
        its lock (CommonKVReceiver._connect_to_bootstrap_server)."""
        sock, lock = sock_lock if isinstance(sock_lock, tuple) else (sock_lock, send_lock)
        with lock:
            sock.send_multipart(frames)

    class SegxferKVManager(api.CommonKVManager):
        """One per engine rank (SGLang makes it in the scheduler process of
        each rank).  Publishes the rank's buffers, runs the side channel's
        thread, and on decode takes the notices."""

        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            self._stopped = False
            self._lock = threading.RLock()
            self.is_prefill = disaggregation_mode == Mode.PREFILL
            self.transfer_timeout = _env_seconds("SEGXFER_SGLANG_TRANSFER_TIMEOUT", 60.0)
            self.open_timeout = _env_seconds("SEGXFER_SGLANG_OPEN_TIMEOUT", 10.0)
            self.liveness_interval = _env_seconds("SEGXFER_SGLANG_LIVENESS_S", 1.0)
            self.parts = self._publish(args, is_mla_backend)
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
            transports = _env("SEGXFER_TRANSPORTS", "auto")
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
            """PLAN HOOK (segxfer issue 23, read/write plans for different TP).
            Returns None where prefill and decode shard heads alike (equal
            attention TP): pages then map one to one, block for block.  Where
            they differ, SGLang's Mooncake backend writes head slices of each
            page (mooncake/conn.py, send_kvcache_slice); here the layouts
            helper's plans (which byte pieces of each block go to which peer)
            will plug in, and until then the pair is refused."""
            if int(remote_tp_size) == self.attn_tp_size:
                return None
            raise ValueError(
                "segxfer's SGLang backend transfers between equal attention TP only: this "
                "%s has attn_tp_size %d, %s has %s (heterogeneous TP needs segxfer's read/"
                "write plans, issue 23; run prefill and decode with the same --tp-size)"
                % ("prefill" if self.is_prefill else "decode", self.attn_tp_size,
                   remote_segment, remote_tp_size))

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

        # ------------------------------------------------------------ prefill

        def _prefill_loop(self):
            while not self._stopped:
                try:
                    if not self.server_socket.poll(100):
                        continue
                    msg = self.server_socket.recv_multipart()
                except Exception as e:  # noqa: BLE001  (closed at teardown)
                    if self._stopped:
                        return
                    logger.error("segxfer sglang: side channel: %s", e)
                    continue
                try:
                    self._prefill_message(msg)
                except Exception as e:  # noqa: BLE001  (bad input must not stop the thread)
                    logger.error("segxfer sglang: bad side-channel message %r: %s",
                                 msg[:1], e)

        def _prefill_message(self, msg):
            kind = msg[0]
            if kind == _REGISTER:
                self._on_register(msg)
            elif kind == _GRANTED:
                name = msg[1].decode()
                with self._lock:
                    peer = self.decode_peers.get(name)
                    if peer is None or peer["state"] != "granting":
                        return
                    peer["state"] = "ready"
                    rooms = [r for r, infos in self.transfer_infos.items() if name in infos]
                for room in rooms:
                    self._room_ready(room)
            elif kind == _ROOM:
                room = int(msg[1].decode("ascii"))
                name = msg[2].decode()
                info = json.loads(msg[4].decode())
                info["dst_kv_indices"] = np.frombuffer(msg[3], dtype=np.int32)
                with self._lock:
                    self.transfer_infos.setdefault(room, {})[name] = info
                    # What SGLang's finalize_bootstrap reads through
                    # pop_decode_prefix_len: the decode holds that much already.
                    self.req_to_decode_prefix_len[room] = int(info.get("decode_prefix_len")
                                                              or 0)
                self._room_ready(room)
            elif kind == _ABORT:
                room = int(msg[1].decode("ascii"))
                with self._lock:
                    active = room in self.request_status and \
                        self.check_status(room) != KVPoll.Success
                    if active:
                        self.record_failure(room, "The decode aborted the request (AbortReq).")
                        self.update_status(room, KVPoll.Failed)
                    batches = list(self.room_batches.get(room, ()))
                for b in batches:
                    _cancel(b)
            else:
                logger.warning("segxfer sglang: unknown side-channel message %r", kind[:32])

        def _on_register(self, msg):
            """A decode rank's registration: open its segments, check the
            layout against ours, refuse other TP, then tell it our segments
            to grant."""
            d = json.loads(msg[1].decode())
            name, endpoint = d["segment"], (d["ip"], int(d["port"]))
            peer = {"state": "refused", "endpoint": endpoint, "segments": {}, "reason": None}
            try:
                self._tp_plan(d["attn_tp_size"], name)
                if sorted(d["parts"]) != sorted(self.parts):
                    raise ValueError(
                        "the decode's buffers form the segments %s, this prefill's %s (aux "
                        "rows and KV must lie in the same kinds of memory on both sides)"
                        % (sorted(d["parts"]), sorted(self.parts)))
                for key, seg_name in d["parts"].items():
                    seg = self.parts[key].agent.open(seg_name, timeout=self.open_timeout)
                    peer["segments"][key] = seg
                    seg.check()          # IncompatibleLayout: before any write
                peer["state"] = "granting"
            except (ValueError, SegxferError) as e:
                peer["reason"] = "segxfer: %s cannot take this prefill's KV: %s" % (name, e)
                logger.error("%s", peer["reason"])
                for seg in peer["segments"].values():
                    seg.close()
                peer["segments"] = {}
            with self._lock:
                old = self.decode_peers.get(name)
                self.decode_peers[name] = peer
            if old is not None:
                for seg in old["segments"].values():
                    seg.close()
            sock = self._connect(_sglang_compat.tcp_endpoint(*endpoint))
            if peer["state"] == "refused":
                send(sock, [_REFUSED, json.dumps({"ip": self.local_ip, "port": self.rank_port,
                                                  "reason": peer["reason"]}).encode()])
                with self._lock:
                    rooms = [r for r, i in self.transfer_infos.items() if name in i]
                for room in rooms:
                    self._room_ready(room)
                return
            send(sock, [_PEER, json.dumps({
                "ip": self.local_ip, "port": self.rank_port, "decode": name,
                "parts": {k: [p.name, p.agent.incarnation] for k, p in self.parts.items()},
            }).encode()])

        def _room_ready(self, room):
            """WaitingForInput once the room's destination arrived from every
            decode rank it needs and each of them granted us; Failed if one
            refused."""
            with self._lock:
                infos = self.transfer_infos.get(room, {})
                if room not in self.request_status or not infos:
                    return
                need = min(int(i.get("required_dst_info_num", 1)) for i in infos.values())
                for name in infos:
                    peer = self.decode_peers.get(name)
                    if peer is not None and peer["state"] == "refused":
                        self.record_failure(room, peer["reason"])
                        self.update_status(room, KVPoll.Failed)
                        return
                if len(infos) < need or any(
                        self.decode_peers.get(n, {}).get("state") != "ready" for n in infos):
                    return
                self.advance(room, KVPoll.WaitingForInput)

        def advance(self, room, status):
            """update_status for a forward step only: SGLang's update_status
            takes the larger state, which would lift a Failed room (0) back
            to WaitingForInput or Transferring."""
            with self._lock:
                if self.request_status.get(room) not in (None, KVPoll.Failed):
                    self.update_status(room, status)

        def submit(self, room, kv_indices, index_slice, is_last, aux_index, state_indices):
            """The write batches of one send(): the pages of this chunk, and on
            the last chunk the aux row and state slots; one batch per decode
            rank and part (more only past 1024 runs), tagged with room."""
            with self._lock:
                infos = dict(self.transfer_infos.get(room, {}))
                peers = {n: self.decode_peers.get(n) for n in infos}
            if not infos:
                raise ValueError("no destination for room %d from the decode (send before "
                                 "the request left Bootstrapping)" % room)
            src = _ids(kv_indices, "kv_indices")
            batches = []
            try:
                for name, info in infos.items():
                    peer = peers[name]
                    if peer is None or peer["state"] != "ready":
                        raise ValueError("decode %s has not granted this prefill" % name)
                    entries = self._entries(info, src, index_slice, is_last, aux_index,
                                            state_indices)
                    for key in self.parts:
                        mine = [e for e in entries if e.part == key]
                        if not mine:
                            continue
                        seg = peer["segments"][key]
                        for chunk in _split(mine):
                            b = seg.batch(timeout=self.transfer_timeout, write=True, tag=room)
                            batches.append(b)
                            for e in chunk:
                                b.add_block_ids(e.dst, e.src, group=e.group,
                                                layers=(0, e.layers), slots=e.slots)
                            b.submit()
            except BaseException:
                for b in batches:
                    b.close()
                raise
            with self._lock:
                self.room_batches.setdefault(room, []).extend(batches)
                if is_last:
                    self.room_last_sent.add(room)

        def _entries(self, info, src, index_slice, is_last, aux_index, state_indices):
            layers = {}
            for part in self.parts.values():
                for g in part.groups:
                    layers[g] = part.key
            kv_layers = len(self.kv_args.kv_data_ptrs)
            mha = not self.is_mla_backend and kv_layers % 2 == 0
            dst = info["dst_kv_indices"][index_slice].astype(np.int64)
            if len(dst) != len(src):
                raise ValueError("the decode gave %d pages for pages %d..%d of the request, "
                                 "this chunk has %d" % (len(dst), index_slice.start,
                                                        index_slice.stop, len(src)))
            out = []
            if len(src):
                out.append(_Entry(layers[GROUP_KV], GROUP_KV,
                                  kv_layers // 2 if mha else kv_layers,
                                  ["K", "V"] if mha else ["K"], src, dst))
            if not is_last:
                return out
            if aux_index is not None and self.kv_args.aux_data_ptrs:
                if info.get("dst_aux_index") is None:
                    raise ValueError("the decode sent no aux index")
                out.append(_Entry(layers[GROUP_AUX], GROUP_AUX, len(self.kv_args.aux_data_ptrs),
                                  ["K"], np.array([aux_index], np.int64),
                                  np.array([info["dst_aux_index"]], np.int64)))
            dst_states = info.get("dst_state_indices") or []
            for c, idx in enumerate(state_indices or []):
                if idx is None or len(idx) == 0:
                    continue
                s = _ids(idx, "state_indices[%d]" % c)
                if c >= len(dst_states) or len(dst_states[c]) != len(s):
                    raise ValueError("state component %d: the decode gave %s slots, the "
                                     "prefill sends %d" % (c, len(dst_states[c]) if c < len(
                                         dst_states) else "no", len(s)))
                out.append(_Entry(layers[GROUP_STATE + c], GROUP_STATE + c,
                                  len(self.kv_args.state_data_ptrs[c]), ["state"], s,
                                  np.asarray(dst_states[c], np.int64)))
            return out

        def room_state(self, room):
            """Success once the last chunk's batches all completed, Failed with
            the first batch's error, else Transferring (prefill side)."""
            with self._lock:
                batches = list(self.room_batches.get(room, ()))
                last = room in self.room_last_sent
            for b in batches:
                if not b.done():
                    return KVPoll.Transferring
                r = b.result()
                if not r.ok:
                    return r
            return KVPoll.Success if last else KVPoll.Transferring

        def tell_decode_failed(self, room, reason):
            with self._lock:
                infos = dict(self.transfer_infos.get(room, {}))
                peers = [self.decode_peers.get(n) for n in infos]
            for peer in peers:
                if peer is None:
                    continue
                try:
                    send(self._connect(_sglang_compat.tcp_endpoint(*peer["endpoint"])),
                         [_FAILED, str(room).encode("ascii"), reason.encode()])
                except wire_errors as e:
                    logger.warning("segxfer sglang: could not tell %s that room %d failed: "
                                   "%s", peer["endpoint"], room, e)

        def forget_room(self, room):
            with self._lock:
                batches = self.room_batches.pop(room, [])
                self.room_last_sent.discard(room)
            for b in batches:
                b.close()       # cancels and waits for one still running

        # ------------------------------------------------------------ decode

        def _decode_loop(self):
            next_check = time.monotonic() + self.liveness_interval
            while not self._stopped:
                try:
                    if self.server_socket.poll(20):
                        self._decode_message(self.server_socket.recv_multipart())
                except Exception as e:  # noqa: BLE001
                    if self._stopped:
                        return
                    logger.error("segxfer sglang: side channel: %s", e)
                for part in self.parts.values():
                    try:
                        for n in part.agent.notices():
                            self._on_notice(n)
                    except SegxferError as e:
                        if self._stopped:
                            return
                        logger.error("segxfer sglang: notices: %s", e)
                if time.monotonic() >= next_check:
                    self._check_prefills()
                    next_check = time.monotonic() + self.liveness_interval

        def _decode_message(self, msg):
            kind = msg[0]
            if kind == _PEER:
                d = json.loads(msg[1].decode())
                endpoint = (d["ip"], int(d["port"]))
                for key, (name, inc) in d["parts"].items():
                    if key not in self.parts:
                        raise ValueError("prefill part %r unknown here" % key)
                    self.parts[key].agent.grant_write(name, inc)
                peer = {"parts": {k: v[0] for k, v in d["parts"].items()}, "failed": None,
                        "misses": 0, "segment": None}
                with self._lock:
                    old = self.prefill_peers.get(endpoint)
                    self.prefill_peers[endpoint] = peer
                if old is not None and old["segment"] is not None:
                    old["segment"].close()
                send(self._connect(_sglang_compat.tcp_endpoint(*endpoint)),
                     [_GRANTED, d["decode"].encode()])
            elif kind == _REFUSED:
                d = json.loads(msg[1].decode())
                endpoint = (d["ip"], int(d["port"]))
                with self._lock:
                    self.prefill_peers[endpoint] = {"parts": {}, "failed": d["reason"],
                                                    "misses": 0, "segment": None}
                self._fail_endpoint(endpoint, d["reason"])
            elif kind == _FAILED:
                room = int(msg[1].decode("ascii"))
                with self._lock:
                    if room in self.rooms and self.request_status.get(room) not in (
                            KVPoll.Success, KVPoll.Failed, None):
                        self.record_failure(room, "prefill: %s" % msg[2].decode(
                            errors="replace"))
                        self.update_status(room, KVPoll.Failed)

        def _on_notice(self, n):
            with self._lock:
                r = self.rooms.get(n.tag)
                if r is None or self.request_status.get(n.tag) in (None, KVPoll.Failed,
                                                                   KVPoll.Success):
                    return   # a request cleared, aborted or failed: bytes it no longer wants
                allowed = set()
                for ep in r["endpoints"]:
                    allowed.update(self.prefill_peers.get(ep, {}).get("parts", {}).values())
                if n.producer not in allowed:
                    logger.warning("segxfer sglang: notice for room %d from %s, which is not "
                                   "its prefill", n.tag, n.producer)
                    return
                r["got"] += n.bytes
                r.setdefault("transports", set()).add(n.transport)
                if r["got"] == r["expected"]:
                    self.update_status(n.tag, KVPoll.Success)
                elif r["got"] > r["expected"]:
                    self.record_failure(n.tag, "%d bytes arrived for a request of %d"
                                        % (r["got"], r["expected"]))
                    self.update_status(n.tag, KVPoll.Failed)
                else:
                    self.advance(n.tag, KVPoll.Transferring)

        def _fail_endpoint(self, endpoint, reason):
            with self._lock:
                for room, r in self.rooms.items():
                    if endpoint in r["endpoints"] and self.request_status.get(room) in (
                            KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                            KVPoll.Transferring):
                        self.record_failure(room, reason)
                        self.update_status(room, KVPoll.Failed)

        def _check_prefills(self):
            """Ping the segment of every prefill rank a request waits on; one
            that does not answer twice in a row (killed, hung, or its segment
            gone from the store when its lease ran out) fails its requests."""
            with self._lock:
                waiting = {ep for room, r in self.rooms.items() for ep in r["endpoints"]
                           if self.request_status.get(room) in (KVPoll.WaitingForInput,
                                                                KVPoll.Transferring)}
                peers = [(ep, self.prefill_peers[ep]) for ep in waiting
                         if ep in self.prefill_peers and self.prefill_peers[ep]["parts"]]
            # The aux segment where there is one: host memory, read over TCP,
            # where a ping of a GPU segment on one host would map its memory.
            key = "aux" if "aux" in self.parts else "kv"
            agent = self.parts[key].agent
            for ep, peer in peers:
                name = peer["parts"][key]
                try:
                    if peer["segment"] is None:
                        peer["segment"] = agent.open(name, timeout=self.liveness_interval)
                    peer["segment"].ping(timeout=self.liveness_interval)
                    peer["misses"] = 0
                except SegxferError as e:
                    if peer["segment"] is not None:
                        peer["segment"].close()
                        peer["segment"] = None
                    peer["misses"] += 1
                    if peer["misses"] >= 2:
                        self._fail_endpoint(ep, "segxfer: the prefill's segment %s stopped "
                                            "answering (%s); its KV will not come" % (name, e))

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

        def register_decode_room(self, room, endpoints, expected):
            with self._lock:
                self.rooms[room] = {"endpoints": endpoints, "expected": expected, "got": 0}
                refused = [self.prefill_peers[ep]["failed"] for ep in endpoints
                           if ep in self.prefill_peers and self.prefill_peers[ep]["failed"]]
            if refused:
                self.record_failure(room, refused[0])
                self.update_status(room, KVPoll.Failed)
            return not refused

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
                _cancel(b)
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
                               "tp_rank": m.kv_args.engine_rank}).encode()
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


def _cancel(batch):
    try:
        batch.cancel()
    except SegxferError:
        pass    # it ended already


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
