"""The decode side of segxfer's SGLang backend: a mixin of
SegxferKVManager (segxfer.sglang) with the thread that takes the side
channel's messages (a prefill's segments to grant, refusals, failures) and
the notices, and pings the prefills requests wait on.  KVPoll's values are
SGLang's (base/conn.py)."""
import json
import logging
import time

from . import _sglang_compat
from ._sglang_compat import KVPoll
from ._sglang_proto import _FAILED, _GRANTED, _PEER, _REFUSED, send
from .errors import SegxferError

logger = logging.getLogger("segxfer.sglang")


class DecodeSide:
    """SegxferKVManager's decode methods (state: prefill_peers, rooms)."""

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
        if n.kind != "write":
            # A read notice (SX_BATCH_NOTIFY) names its reader as the reader
            # says, and any reader of the store may read these pages: only
            # write notices, whose producer the data plane authenticated
            # against our grant, say the prefill's bytes landed.
            logger.warning("segxfer sglang: ignored a %s notice from %s (tag %d): rooms end on "
                           "the prefill's write notices only", n.kind, n.producer, n.tag)
            return
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


    def register_decode_room(self, room, endpoints, expected):
        with self._lock:
            self.rooms[room] = {"endpoints": endpoints, "expected": expected, "got": 0}
            refused = [self.prefill_peers[ep]["failed"] for ep in endpoints
                       if ep in self.prefill_peers and self.prefill_peers[ep]["failed"]]
        if refused:
            self.record_failure(room, refused[0])
            self.update_status(room, KVPoll.Failed)
        return not refused
