"""One SGLang engine rank (prefill or decode) driving segxfer's SGLang
backend in the order SGLang's scheduler calls it, for test_sglang.py.

The call order, read from sgl-project/sglang python/sglang/srt/disaggregation/:
- prefill.py (0bd35246): the prefill process starts the bootstrap server
  (kv_bootstrap_server_class(host, port)); each rank makes its manager
  (kv_manager_class(kv_args, DisaggregationMode.PREFILL, server_args,
  is_mla_backend)) with kv_args from the KV pool's get_contiguous_buf_infos
  and MetadataBuffers.get_buf_infos; PrefillBootstrapQueue.add makes
  kv_sender_class(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks,
  pp_rank); pop_bootstrapped polls until WaitingForInput, then
  sender.init(num_pages, metadata_buffer_index); after the forward,
  send_kv_chunk sends page chunks with sender.send(page_indices) and the last
  chunk, after MetadataBuffers.set_buf, with send(page_indices,
  state_indices); the inflight queue polls until Success or Failed, and on
  Failed calls failure_exception().
- decode.py (278e503a): DecodePreallocQueue makes kv_receiver_class(mgr,
  bootstrap_addr, bootstrap_room), calls
  kv_manager.try_ensure_parallel_info(bootstrap_addr) until it holds, then
  receiver.init(prefill_dp_rank), polls until WaitingForInput, allocates
  pages, an aux row and state slots and calls send_metadata(page_indices,
  metadata_buffer_index, state_indices); DecodeTransferQueue.pop_transferred
  polls until Success (then reads the aux row) or Failed (then
  failure_exception()).  An aborted request calls abort().

Usage: sglang_engine.py CONFIG_JSON, then commands on stdin, one JSON
answer per line on stdout:
  start                     make the bootstrap server (prefill) and manager
  open ROOM                 prefill: a sender; decode: a receiver, through
                            init, to WaitingForInput, then send_metadata
  ready ROOM                prefill: poll until WaitingForInput, then init
  send ROOM                 prefill: set the aux row, send the pages in
                            two chunks, the last one with the state slots
  poll ROOM SECONDS         poll until Success/Failed; failure_exception's
                            text on Failed
  abort ROOM                sender/receiver abort()
  revoke                    decode: revoke every grant given to a prefill
  verify ROOM               decode: the destination pages, aux row and
                            state slots hold the prefill's bytes, and
                            nothing else changed
  quit                      teardown, exit
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "python"))

from segxfer import sglang as sx_sglang  # noqa: E402

LAYERS, PAGES, ITEM = 4, 24, 512          # KV: 4 layers of K and V, 24 pages of 512 B
HEADS = 4                                 # KV heads of the model: a page of every head
                                          # is ITEM bytes, page_size tokens of HEADS heads
AUX_ROWS, AUX_ITEMS = 8, (64, 64, 128)   # MetadataBuffers-like rows (output_ids, ...)
STATE_SLOTS, STATE_ITEMS = 6, (256, 96)  # one state component (mamba: conv, temporal)


def pattern(seed, buf, rows, item):
    """Recognisable bytes of buffer buf of one side: row r is a function of
    (seed, buf, r)."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(item, dtype=np.int64)[None, :]
    return ((seed * 131 + buf * 31 + r * 7 + c) % 251).astype(np.uint8)


def heads_of(a, page_size, tp_size, tp_rank):
    """The rows of a (pages of every KV head, [rows, ITEM]) that attention
    TP rank tp_rank of tp_size holds: its heads of each token, as SGLang's
    token-major pool [pages * page_size, heads, head_dim] shards them."""
    h = HEADS // tp_size
    per = a.reshape(a.shape[0], page_size, HEADS, -1)
    return np.ascontiguousarray(per[:, :, tp_rank * h:(tp_rank + 1) * h, :]).reshape(
        a.shape[0], -1)


class Buffers:
    """An engine rank's KV (2 * LAYERS buffers), aux and state buffers, as
    SGLang lays them out, on `device` (aux always in host memory, as
    MetadataBuffers is); filled with pattern(seed) or zeros.  The KV of
    attention TP rank tp_rank of tp_size is its heads of the model's pages
    (heads_of)."""

    def __init__(self, device, seed=None, page_size=1, tp_size=1, tp_rank=0):
        self.device = device
        self.page_size, self.tp_size, self.tp_rank = page_size, tp_size, tp_rank
        self.item = ITEM // tp_size
        if device != "cpu":
            import torch
            self.torch = torch

        def make(buf, rows, item, on_device):
            a = pattern(seed, buf, rows, item) if seed is not None else \
                np.zeros((rows, item), np.uint8)
            if on_device and item == ITEM and tp_size > 1:
                a = heads_of(a, page_size, tp_size, tp_rank) if seed is not None else \
                    np.zeros((rows, self.item), np.uint8)
            if on_device and device != "cpu":
                return self.torch.from_numpy(a).to(device)
            return a

        self.kv = [make(i, PAGES, ITEM, True) for i in range(2 * LAYERS)]
        self.aux = [make(100 + j, AUX_ROWS, n, False) for j, n in enumerate(AUX_ITEMS)]
        self.state = [make(200 + t, STATE_SLOTS, n, True) for t, n in enumerate(STATE_ITEMS)]

    @staticmethod
    def ptr(a):
        return a.data_ptr() if hasattr(a, "data_ptr") else a.ctypes.data

    @staticmethod
    def nbytes(a):
        return a.numel() * a.element_size() if hasattr(a, "numel") else a.nbytes

    def host(self, a):
        return a.cpu().numpy() if hasattr(a, "cpu") else a

    def kv_args(self, cls, engine_rank):
        a = cls()
        a.engine_rank = engine_rank
        a.kv_data_ptrs = [self.ptr(t) for t in self.kv]
        a.kv_data_lens = [self.nbytes(t) for t in self.kv]
        a.kv_item_lens = [self.item] * len(self.kv)
        a.kv_head_num = HEADS // self.tp_size
        a.aux_data_ptrs = [self.ptr(t) for t in self.aux]
        a.aux_data_lens = [self.nbytes(t) for t in self.aux]
        a.aux_item_lens = list(AUX_ITEMS)
        a.state_types = ["mamba"]
        a.state_data_ptrs = [[self.ptr(t) for t in self.state]]
        a.state_data_lens = [[self.nbytes(t) for t in self.state]]
        a.state_item_lens = [list(STATE_ITEMS)]
        a.page_size = self.page_size
        a.gpu_id = 0
        a.system_dp_rank = 0
        a.pp_rank = 0
        a.prefill_start_layer = 0
        return a


class ServerArgs:
    def __init__(self, cfg):
        self.host = "127.0.0.1"
        self.disaggregation_bootstrap_port = cfg["bport"]
        self.dist_init_addr = None
        self.tp_size = cfg.get("tp_size", 1)
        self.dp_size = 1
        self.pp_size = 1
        self.enable_dp_attention = False
        self.kv_cache_dtype = "auto"
        self.load_balance_method = "round_robin"
        self.model_path = "/models/test-llama"
        self.port = 0


def main():
    cfg = json.loads(sys.argv[1])
    role, rooms = cfg["role"], {r["room"]: r for r in cfg["rooms"]}
    c = sx_sglang.classes()
    KVPoll = c["KVPoll"]
    names = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}
    bufs = Buffers(cfg.get("device", "cpu"), cfg["seed"] if role == "prefill" else None,
                   cfg.get("page_size", 1), cfg.get("tp_size", 1), cfg.get("tp_rank", 0))
    addr = "127.0.0.1:%d" % cfg["bport"]
    server = mgr = None
    ends = {}

    def out(**kw):
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    concluded = {}

    def conclude(room, seconds):
        """Poll until Success/Failed (as SGLang's queues do), then, once per
        room as SGLang does, failure_exception() on Failed; later calls
        answer the same."""
        if room in concluded:
            return concluded[room]
        end = ends[room]
        deadline = time.monotonic() + seconds
        seen = []
        while True:
            st = end.poll()
            if not seen or seen[-1] != names[st]:
                seen.append(names[st])
            if st in (KVPoll.Success, KVPoll.Failed) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        reason = None
        if st == KVPoll.Failed:
            try:
                end.failure_exception()
            except Exception as e:  # noqa: BLE001  (what SGLang catches)
                reason = "%s: %s" % (type(e).__name__, e)
        res = dict(state=names[st], seen=seen, reason=reason)
        if st in (KVPoll.Success, KVPoll.Failed):
            concluded[room] = res
        return res

    def bootstrapped(room, then):
        """Poll room's end until it leaves Bootstrapping (20 s at most) and, at
        WaitingForInput, call then() (the receiver's send_metadata, the
        sender's init), as SGLang's queues do; the state, with the reason
        when Failed."""
        end, deadline = ends[room], time.monotonic() + 20
        st = end.poll()
        while st == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
            st = end.poll()
        if st == KVPoll.WaitingForInput:
            then()
            st = end.poll()
        res = dict(ok=True, state=names[st])
        if st == KVPoll.Failed:
            res.update(conclude(room, 0))
        return res

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        t0 = time.monotonic()
        try:
            if cmd[0] == "start":
                mode = c["DisaggregationMode"].PREFILL if role == "prefill" else \
                    c["DisaggregationMode"].DECODE
                if role == "prefill" and cfg.get("tp_rank", 0) == 0:
                    server = c["SegxferKVBootstrapServer"]("127.0.0.1", cfg["bport"])
                mgr = c["SegxferKVManager"](bufs.kv_args(c["KVArgs"], cfg.get("tp_rank", 0)),
                                            mode,
                                            ServerArgs(cfg), False)
                out(ok=True, segments=mgr.segment_names(), sglang=c["using_sglang"],
                    port=mgr.rank_port)
            elif cmd[0] == "open":
                room = int(cmd[1])
                r = rooms[room]
                if role == "prefill":
                    ends[room] = c["SegxferKVSender"](mgr, addr, room,
                                                      [cfg.get("tp_rank", 0)], 0)
                    out(ok=True, state=names[ends[room].poll()])
                    continue
                while not mgr.try_ensure_parallel_info(addr):
                    if time.monotonic() - t0 > 20:
                        raise TimeoutError("no prefill parallel info from %s" % addr)
                    time.sleep(0.05)
                recv = ends[room] = c["SegxferKVReceiver"](mgr, addr, room)
                recv.init(0)
                out(**bootstrapped(room, lambda: recv.send_metadata(
                    np.array(r["dst_pages"], np.int32), r["aux_dst"],
                    [np.array(r["state_dst"], np.int64)])))
            elif cmd[0] == "ready":
                room = int(cmd[1])
                r = rooms[room]
                out(**bootstrapped(room, lambda: ends[room].init(len(r["src_pages"]),
                                                                 r["aux_src"])))
            elif cmd[0] == "send":
                room = int(cmd[1])
                sender, r = ends[room], rooms[room]
                pages = np.array(r["src_pages"], np.int32)
                half = len(pages) // 2
                sender.send(pages[:half])                       # a chunk
                sender.send(pages[half:], [np.array(r["state_src"], np.int64)])  # the last
                out(ok=True, state=names[sender.poll()])
            elif cmd[0] == "poll":
                room = int(cmd[1])
                res = conclude(room, float(cmd[2]))
                if role == "decode":
                    res["transports"] = ends[room].transports
                out(ok=True, seconds=round(time.monotonic() - t0, 3), **res)
            elif cmd[0] == "abort":
                ends[int(cmd[1])].abort()
                out(ok=True, state=names[ends[int(cmd[1])].poll()])
            elif cmd[0] == "revoke":
                # The decode takes back every grant it gave (as an operator
                # could): the prefill's next batch is refused by the data plane.
                for peer in list(mgr.prefill_peers.values()):
                    for key, name in peer["parts"].items():
                        mgr.parts[key].agent.revoke_write(name)
                out(ok=True)
            elif cmd[0] == "verify":
                room = int(cmd[1])
                out(ok=True, problems=verify(bufs, rooms[room], list(rooms.values()),
                                             cfg["seed"]))
            elif cmd[0] == "quit":
                break
            else:
                out(ok=False, error="unknown command %r" % cmd[0])
        except Exception as e:  # noqa: BLE001  (the test reads it)
            out(ok=False, error="%s: %s" % (type(e).__name__, e))
    if mgr is not None:
        mgr.teardown()
    if server is not None:
        server.close()
    out(ok=True, bye=True)


def verify(bufs, r, every, seed):
    """Every destination page of room r, its aux row and its state slots
    hold the prefill's bytes of their sources; rows that are no room's
    destination (of `every` room) are still zero."""
    problems = []

    def check(kind, idx, dst_buf, want_buf, src_rows, dst_rows, key):
        got = bufs.host(dst_buf)
        rows = got.shape[0]
        if kind == "kv":
            # The reference: this rank's heads of the model's pages (what a
            # prefill of the same TP holds and an equal-TP run writes).
            want = heads_of(pattern(seed, want_buf, rows, ITEM), bufs.page_size,
                            bufs.tp_size, bufs.tp_rank)
        else:
            want = pattern(seed, want_buf, rows, got.shape[1])
        for s, d in zip(src_rows, dst_rows):
            if not np.array_equal(got[d], want[s]):
                problems.append("%s %d: row %d does not hold source row %d" % (kind, idx, d, s))
        used = set()
        for other in every:
            used.update(other[key] if isinstance(other[key], list) else [other[key]])
        others = sorted(set(range(rows)) - used)
        if others and np.any(got[others]):
            problems.append("%s %d: rows outside the destinations changed" % (kind, idx))

    for i, t in enumerate(bufs.kv):
        check("kv", i, t, i, r["src_pages"], r["dst_pages"], "dst_pages")
    for j, t in enumerate(bufs.aux):
        check("aux", j, t, 100 + j, [r["aux_src"]], [r["aux_dst"]], "aux_dst")
    for k, t in enumerate(bufs.state):
        check("state", k, t, 200 + k, r["state_src"], r["state_dst"], "state_dst")
    return problems


if __name__ == "__main__":
    main()
