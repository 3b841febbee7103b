"""The prefill side of segxfer's SGLang backend: a mixin of
SegxferKVManager (segxfer.sglang) with the side channel's thread (decode
registrations, destinations, grants, aborts) and the write batches of
send().  KVPoll's values are SGLang's (base/conn.py)."""
import json
import logging

import numpy as np

from . import _sglang_compat, _sglang_slices
from ._sglang_compat import KVPoll
from ._sglang_proto import (_ABORT, _GRANTED, _PEER, _REFUSED, _REGISTER, _ROOM, _FAILED,
                            GROUP_AUX, GROUP_KV, GROUP_STATE, _RUNS_PER_BATCH, _ids, cancel,
                            send)
from .errors import SegxferError

logger = logging.getLogger("segxfer.sglang")


def _runs(dst):
    """The number of runs of consecutive destination ids in dst (a notice
    merges a run into one entry)."""
    if len(dst) == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(dst) != 1))


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


class PrefillSide:
    """SegxferKVManager's prefill methods (state: decode_peers,
    room_batches, room_last_sent, SGLang's transfer_infos)."""

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
                cancel(b)
        else:
            logger.warning("segxfer sglang: unknown side-channel message %r", kind[:32])

    def _on_register(self, msg):
        """A decode rank's registration: open its segments, check the
        layout against ours (with other attention TP: plan the head slices
        we write into its pages instead), then tell it our segments to
        grant."""
        d = json.loads(msg[1].decode())
        name, endpoint = d["segment"], (d["ip"], int(d["port"]))
        peer = {"state": "refused", "endpoint": endpoint, "segments": {}, "reason": None}
        try:
            het = self._tp_plan(d["attn_tp_size"], name) is not None
            if het:
                peer["slice"] = _sglang_slices.plan_slice(self._slice_side(), {
                    "tp_size": d.get("attn_tp_size"), "tp_rank": d.get("attn_tp_rank"),
                    "heads": d.get("kv_head_num"), "item": d.get("kv_item_len"),
                    "page_size": d.get("page_size")})
                peer["whole_rows"] = _sglang_slices.sends_whole_rows(
                    self.attn_tp_size, int(d["attn_tp_size"]), self.attn_tp_rank)
            if sorted(d["parts"]) != sorted(self.parts):
                raise ValueError(
                    "the decode's buffers form the segments %s, this prefill's %s (aux "
                    "rows and KV must lie in the same kinds of memory on both sides)"
                    % (sorted(d["parts"]), sorted(self.parts)))
            for key, seg_name in d["parts"].items():
                seg = self.parts[key].agent.open(seg_name, timeout=self.open_timeout)
                peer["segments"][key] = seg
                if het and key == "kv":
                    # Pages differ in size (the heads held differ): the
                    # decode's KV regions must be pages of the heads it
                    # stated; the rest must match ours as usual.
                    peer["kv_regions"] = self._slice_regions(seg, d["kv_item_len"])
                else:
                    seg.check()      # IncompatibleLayout: before any write
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
                if peer.get("slice") is not None:
                    entries = self._slice_writes(peer, info, src, index_slice, entries,
                                                 room, batches)
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

    def _slice_side(self):
        """This rank's statement for plan_slice (what the decode states in
        its registration)."""
        a = self.kv_args
        return {"tp_size": self.attn_tp_size, "tp_rank": self.attn_tp_rank,
                "heads": int(a.kv_head_num), "item": int(a.kv_item_lens[0]),
                "page_size": int(a.page_size)}

    def _slice_regions(self, seg, dst_item):
        """The decode's region id for each of our KV buffers (K of every
        layer, then V), checked to be pages of dst_item bytes; the other
        groups' regions are checked against ours by block size."""
        if self.is_mla_backend or len(set(self.kv_args.kv_item_lens)) != 1:
            raise ValueError("head slices need MHA buffers of one page size")
        theirs = {(r["group"], r["layer_first"], r["slot"]): r for r in seg.regions()}
        from .agent import slot_number
        ids = []
        half = len(self.kv_args.kv_data_ptrs) // 2
        for i in range(2 * half):
            key = (GROUP_KV, i % half, slot_number("K" if i < half else "V"))
            r = theirs.get(key)
            if r is None or r["block_bytes"] != dst_item or not r["writable"]:
                raise ValueError("the decode has no writable KV region of %d-byte pages for "
                                 "layer %d %s" % (dst_item, i % half, "K" if i < half else "V"))
            ids.append(r["id"])
        for group, items in ((GROUP_AUX, self.kv_args.aux_item_lens),):
            for j, item in enumerate(items):
                r = theirs.get((group, j, slot_number("K")))
                if "aux" not in self.parts and (r is None or r["block_bytes"] != item):
                    raise ValueError("the decode's aux buffer %d differs from ours" % j)
        return ids

    def _slice_writes(self, peer, info, src, index_slice, entries, room, batches):
        """Submit this chunk's KV as head-slice range writes into the decode
        rank of peer; returns the entries still to write (aux row, state
        slots: only from the first prefill rank of the decode's group)."""
        rest = [e for e in entries if e.group != GROUP_KV]
        if any(e.group >= GROUP_STATE for e in rest):
            raise ValueError("state slots (mamba) across different attention TP are not "
                             "supported")
        sl, a = peer["slice"], self.kv_args
        dst = info["dst_kv_indices"][index_slice].astype(np.int64)
        rng = _sglang_slices.ranges(sl, a.kv_data_ptrs, int(a.kv_item_lens[0]),
                                    peer["kv_regions"], sl.dst_token * sl.page_size,
                                    src, dst)
        seg = peer["segments"]["kv"]
        for chunk in _sglang_slices.chunks(rng):
            b = seg.batch(timeout=self.transfer_timeout, write=True, tag=room)
            batches.append(b)
            b.add_range_writes(chunk)
            b.submit()
        return rest if peer["whole_rows"] else []

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
            except self._wire_errors as e:
                logger.warning("segxfer sglang: could not tell %s that room %d failed: "
                               "%s", peer["endpoint"], room, e)

    def forget_room(self, room):
        with self._lock:
            batches = self.room_batches.pop(room, [])
            self.room_last_sent.discard(room)
        for b in batches:
            b.close()       # cancels and waits for one still running
