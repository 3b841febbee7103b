"""segxfer's SGLang backend (python/segxfer/sglang.py) in SGLang's call
order, with a prefill and a decode process (tests/python/sglang_engine.py
replays prefill.py and decode.py of sgl-project/sglang; the order is cited
there), a real redis-server, and SGLang's bootstrap server and side channel
(SGLang itself is not installed here: the stand-in in
segxfer/_sglang_compat.py takes its place, and says what it keeps).

Asserted: the pages written equal the prefill's pages, and the aux row and
state slots arrive, over two chunks (chunked prefill), with nothing else
touched; a prefill killed after the handshake turns the decode's poll to
Failed with a reason within seconds; a batch the decode refuses fails the
prefill from the batch and the decode from the prefill's message; an abort
on either side ends both
sides Failed with the reason, both processes exit cleanly; different TP, a
different layout and segments that do not pair are refused with a clear
reason before any write; garbage on the side channel is survived; a Failed
room is never lifted by a late step.  With a
CUDA device (torch.cuda.is_available(), the GPU machine), the same with KV
and state on cuda:0 and aux rows in host memory, over cuda_ipc and staged
TCP.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from harness import free_port

ENGINE = os.path.join(ROOT, "tests", "python", "sglang_engine.py")


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


CUDA = _cuda()


def _has_zmq():
    try:
        import zmq  # noqa: F401
        return True
    except ImportError:
        return False


ROOMS = [
    # Scattered destination pages (runs of 1..3), one aux row, two state slots.
    dict(room=7001, src_pages=[0, 1, 2, 3, 9, 10, 11, 5], dst_pages=[20, 3, 4, 5, 12, 13, 0, 8],
         aux_src=2, aux_dst=6, state_src=[1, 4], state_dst=[3, 0]),
    dict(room=2**62 + 17, src_pages=[12, 13, 14, 15, 16], dst_pages=[14, 15, 16, 17, 18],
         aux_src=5, aux_dst=1, state_src=[2], state_dst=[5]),
]


class Engine:
    """A sglang_engine.py process: commands in, JSON answers out."""

    def __init__(self, role, url, bport, env=None, **cfg):
        cfg.update(role=role, bport=bport, seed=cfg.get("seed", 11))
        cfg.setdefault("rooms", ROOMS)
        e = dict(os.environ, SX_METADATA_URL=url, SEGXFER_SGLANG_STANDIN="1",
                 SEGXFER_SGLANG_LIVENESS_S="0.3", PYTHONUNBUFFERED="1")
        e.update(env or {})
        self.role = role
        self.proc = subprocess.Popen([sys.executable, ENGINE, json.dumps(cfg)], env=e,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def cmd(self, *words, timeout=30):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout)
            raise AssertionError("%s exited (rc %s): %s" % (self.role, self.proc.returncode,
                                                             self.proc.stderr.read()[-3000:]))
        ans = json.loads(line)
        assert ans.get("ok"), (self.role, words, ans)
        return ans

    def quit(self):
        """quit: teardown and a clean exit (rc 0)."""
        ans = self.cmd("quit")
        assert ans.get("bye")
        assert self.proc.wait(20) == 0, self.proc.stderr.read()[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def engines(url):
    made = []

    def start(role, bport, **kw):
        e = Engine(role, url, bport, **kw)
        made.append(e)
        return e
    yield start
    for e in made:
        e.kill()


def handshake(prefill, decode, rooms=ROOMS):
    """Both managers up; per room, SGLang's bootstrap: sender made, receiver
    through init and send_metadata, sender to WaitingForInput and init."""
    p, d = prefill.cmd("start"), decode.cmd("start")
    assert p["sglang"] is False and d["sglang"] is False   # the stand-in, here
    for r in rooms:
        assert prefill.cmd("open", r["room"])["state"] == "Bootstrapping"
        assert decode.cmd("open", r["room"])["state"] == "WaitingForInput"
    for r in rooms:
        assert prefill.cmd("ready", r["room"])["state"] == "WaitingForInput"
    return p["segments"], d["segments"]


def pair(engines, shake=True, decode_kw=None, **kw):
    """A prefill and a decode process on a fresh bootstrap port (after
    handshake() when shake); decode_kw: the decode's own settings."""
    bport = free_port()
    prefill = engines("prefill", bport, **kw)
    decode = engines("decode", bport, **dict(kw, **(decode_kw or {})))
    segs = handshake(prefill, decode) if shake else None
    return prefill, decode, segs


def opened_with(engines, **decode_kw):
    """Both managers up, the decode with decode_kw, one room opened on both
    sides: (prefill, decode, room, the decode's open answer)."""
    prefill, decode, _ = pair(engines, shake=False, decode_kw=decode_kw)
    prefill.cmd("start")
    decode.cmd("start")
    room = ROOMS[0]["room"]
    prefill.cmd("open", room)
    return prefill, decode, room, decode.cmd("open", room)


def run_transfer(engines, device="cpu", env=None):
    prefill, decode, (psegs, dsegs) = pair(engines, device=device, env=env)
    for r in ROOMS:
        assert prefill.cmd("send", r["room"])["state"] in ("Transferring", "Success")
    results = {}
    for r in ROOMS:
        pr = prefill.cmd("poll", r["room"], 20)
        dr = decode.cmd("poll", r["room"], 20)
        assert pr["state"] == "Success", pr
        assert dr["state"] == "Success", dr
        assert decode.cmd("verify", r["room"])["problems"] == []
        results[r["room"]] = dr
    prefill.quit()
    decode.quit()
    return psegs, dsegs, results


@pytest.mark.parametrize("wire", ["zmq", "socket"])
def test_sglang_pages_aux_and_state_arrive(engines, wire):
    if wire == "zmq" and not _has_zmq():
        pytest.skip("pyzmq is not installed (make deps installs python3-zmq)")
    psegs, dsegs, results = run_transfer(engines, env={"SEGXFER_SGLANG_WIRE": wire})
    # Host memory only: one segment per rank, named, not addressed.
    assert list(psegs) == ["kv"] and list(dsegs) == ["kv"]
    assert psegs["kv"].startswith("sglang/prefill/") and dsegs["kv"].startswith("sglang/decode/")
    for res in results.values():
        assert res["transports"] == ["tcp"]
        assert res["seen"][-1] == "Success"


def test_sglang_aux_in_a_segment_of_its_own(engines):
    """The layout a GPU rank has (KV segment + aux segment, two batches per
    request, one notice each), forced on host memory."""
    psegs, dsegs, results = run_transfer(engines, env={"SEGXFER_SGLANG_AUX_SEGMENT": "yes"})
    assert sorted(psegs) == ["aux", "kv"] and dsegs["aux"] == dsegs["kv"] + "/aux"
    for res in results.values():
        assert res["transports"] == ["tcp"] and res["seen"][-1] == "Success"


def test_sglang_segments_that_do_not_pair_are_refused(engines):
    prefill, decode, room, _ = opened_with(engines, env={"SEGXFER_SGLANG_AUX_SEGMENT": "yes"})
    for end in (prefill, decode):
        res = end.cmd("poll", room, 10)
        assert res["state"] == "Failed" and "form the segments ['aux', 'kv']" in \
            res["reason"], res
    prefill.quit()
    decode.quit()


def test_sglang_bad_side_channel_messages_do_not_stop_the_prefill(engines):
    zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (make deps installs "
                              "python3-zmq)")
    prefill, decode, _ = pair(engines, shake=False)
    port = prefill.cmd("start")["port"]
    decode.cmd("start")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect("tcp://127.0.0.1:%d" % port)
    for frames in ([b"SEGXFER_ROOM", b"not a number"], [b"SEGXFER_REGISTER", b"{bad json"],
                   [b"SEGXFER_ROOM", b"5", b"x", b"\x01\x02\x03", b"[]"], [b"\xff" * 40],
                   [b"ABORT", b"-"], [b"SEGXFER_GRANTED", b"nobody"]):
        sock.send_multipart(frames)
    sock.close()
    ctx.term()
    r = ROOMS[0]
    prefill.cmd("open", r["room"])
    assert decode.cmd("open", r["room"])["state"] == "WaitingForInput"
    assert prefill.cmd("ready", r["room"])["state"] == "WaitingForInput"
    prefill.cmd("send", r["room"])
    assert prefill.cmd("poll", r["room"], 20)["state"] == "Success"
    assert decode.cmd("poll", r["room"], 20)["state"] == "Success"
    assert decode.cmd("verify", r["room"])["problems"] == []
    prefill.quit()
    decode.quit()


def test_sglang_split_keeps_runs_under_the_notice_limit():
    import numpy as np
    from segxfer import _sglang_prefill as pre
    dst = np.array([0, 1, 2, 10, 11, 20, 30, 31, 32, 33, 40], np.int64)
    src = np.arange(len(dst), dtype=np.int64) + 100
    e = pre._Entry("kv", 0, 4, ["K"], src, dst)
    chunks = pre._split([e, pre._Entry("kv", 1, 3, ["K"], src[:1], dst[:1])], limit=2)
    assert [sum(pre._runs(x.dst) for x in c) for c in chunks] == [2, 2, 2]
    got = [x for c in chunks for x in c]
    assert np.array_equal(np.concatenate([x.dst for x in got[:-1]]), dst)
    assert np.array_equal(np.concatenate([x.src for x in got[:-1]]), src)
    assert got[-1].group == 1 and list(got[-1].dst) == [0]
    assert pre._split([e])[0][0].dst is not None and len(pre._split([e])) == 1


@pytest.mark.parametrize("aux_segment", ["auto", "yes"])
def test_sglang_killed_prefill_fails_decode_with_reason(engines, aux_segment):
    prefill, decode, _ = pair(engines, env={"SEGXFER_SGLANG_AUX_SEGMENT": aux_segment})
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait()
    t0 = time.monotonic()
    res = decode.cmd("poll", ROOMS[0]["room"], 15)
    assert res["state"] == "Failed", res
    assert time.monotonic() - t0 < 10
    assert "stopped answering" in res["reason"] and "KVTransferError" in res["reason"], res
    decode.quit()


def test_sglang_decode_abort_is_clean_on_both_sides(engines):
    prefill, decode, _ = pair(engines)
    room, other = ROOMS[0]["room"], ROOMS[1]["room"]
    assert decode.cmd("abort", room)["state"] == "Failed"
    res = prefill.cmd("poll", room, 10)
    assert res["state"] == "Failed" and "decode aborted" in res["reason"], res
    res = decode.cmd("poll", room, 1)
    assert res["state"] == "Failed" and "Aborted by AbortReq" in res["reason"], res
    # The other request of the same pair still goes through.
    prefill.cmd("send", other)
    assert prefill.cmd("poll", other, 20)["state"] == "Success"
    assert decode.cmd("poll", other, 20)["state"] == "Success"
    assert decode.cmd("verify", other)["problems"] == []
    prefill.quit()
    decode.quit()


def test_sglang_refused_batch_fails_prefill_then_decode(engines):
    """The prefill learns of a failure from its batch and tells the decode."""
    prefill, decode, _ = pair(engines)
    room = ROOMS[0]["room"]
    decode.cmd("revoke")
    prefill.cmd("send", room)
    res = prefill.cmd("poll", room, 20)
    assert res["state"] == "Failed" and "write batch for room" in res["reason"], res
    assert "SX_E" in res["reason"], res
    res = decode.cmd("poll", room, 10)
    assert res["state"] == "Failed" and "prefill: segxfer: write batch" in res["reason"], res
    assert decode.cmd("verify", room)["problems"]    # nothing landed
    prefill.quit()
    decode.quit()


def test_sglang_prefill_abort_fails_decode_with_reason(engines):
    prefill, decode, _ = pair(engines)
    room = ROOMS[1]["room"]
    assert prefill.cmd("abort", room)["state"] == "Failed"
    res = prefill.cmd("poll", room, 1)
    assert res["state"] == "Failed" and "Aborted by AbortReq" in res["reason"], res
    res = decode.cmd("poll", room, 10)
    assert res["state"] == "Failed" and "prefill aborted" in res["reason"], res
    prefill.quit()
    decode.quit()


# Heterogeneous TP: rooms without state slots (mamba state across different
# TP is refused), pages of 2 tokens so that head slices are pieces of tokens.
HET_ROOMS = [dict(r, state_src=[], state_dst=[]) for r in ROOMS]


def het_ranks(engines, prefill_tp, decode_tp):
    """prefill_tp prefill processes and decode_tp decode processes (one per
    attention TP rank, each holding its share of the 4 KV heads), through
    SGLang's bootstrap for every room: (prefills, decodes)."""
    bport = free_port()
    kw = dict(rooms=HET_ROOMS, page_size=2)
    prefills = [engines("prefill", bport, tp_size=prefill_tp, tp_rank=r, **kw)
                for r in range(prefill_tp)]
    decodes = [engines("decode", bport, tp_size=decode_tp, tp_rank=r, **kw)
               for r in range(decode_tp)]
    for e in prefills + decodes:        # prefill rank 0 first: the bootstrap server
        e.cmd("start")
    for r in HET_ROOMS:
        for e in prefills:
            assert e.cmd("open", r["room"])["state"] == "Bootstrapping"
        for e in decodes:
            assert e.cmd("open", r["room"])["state"] == "WaitingForInput"
    for r in HET_ROOMS:
        for e in prefills:
            assert e.cmd("ready", r["room"])["state"] == "WaitingForInput"
    return prefills, decodes


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_sglang_different_tp_writes_head_slices(engines, prefill_tp, decode_tp):
    """Each decode rank's pages end up holding exactly its heads of the
    model's pages (the reference verify computes: what an equal-TP run
    writes), its aux row once, nothing else; Success on every rank."""
    prefills, decodes = het_ranks(engines, prefill_tp, decode_tp)
    for r in HET_ROOMS:
        for e in prefills:
            assert e.cmd("send", r["room"])["state"] in ("Transferring", "Success")
    for r in HET_ROOMS:
        for e in prefills:
            assert e.cmd("poll", r["room"], 20)["state"] == "Success"
        for e in decodes:
            res = e.cmd("poll", r["room"], 20)
            assert res["state"] == "Success", res
            assert e.cmd("verify", r["room"])["problems"] == []
    for e in prefills + decodes:
        e.quit()


def test_sglang_different_tp_killed_prefill_rank_fails_decode(engines):
    prefills, decodes = het_ranks(engines, 2, 1)
    prefills[1].proc.send_signal(signal.SIGKILL)
    prefills[1].proc.wait()
    prefills[0].cmd("send", HET_ROOMS[0]["room"])     # half the heads arrive
    res = decodes[0].cmd("poll", HET_ROOMS[0]["room"], 15)
    assert res["state"] == "Failed", res
    assert "stopped answering" in res["reason"] and "KVTransferError" in res["reason"], res
    decodes[0].quit()


def test_sglang_impossible_tp_ratio_is_refused_clearly(engines):
    """4 KV heads cannot split over decode TP 3: the prefill refuses the
    decode's registration, and the room fails on both sides before any
    write."""
    prefill, decode, room, res = opened_with(engines, tp_size=3)
    res = decode.cmd("poll", room, 10)
    assert res["state"] == "Failed", res
    assert "cannot take this prefill's KV" in res["reason"] and \
        "do not split evenly over attention TP 3" in res["reason"], res
    assert decode.cmd("verify", room)["problems"]   # nothing was written
    prefill.quit()
    decode.quit()


def _plan_agent(url, name, tp, rank, page_size=2, head_bytes=64, heads=4):
    """An agent whose KV (2 layers, K and V, 6 pages) is described as an
    SGLang rank's pool is: NHD pages of page_size tokens of its heads, a
    head of a token head_bytes bytes (uint8 elements)."""
    import numpy as np
    import segxfer
    h = heads // tp
    buf = np.zeros((6, page_size * h * head_bytes), np.uint8)
    a = segxfer.Agent(name, url, transports="tcp", listen="127.0.0.1:0", dtype="uint8",
                      tp_rank=rank, tp_size=tp, kv_layout="NHD", block_tokens=page_size,
                      kv_heads=(rank * h, h, heads), head_dim=head_bytes, log_level="error")
    for layer in range(2):
        for slot in "KV":
            a.register(addr=buf.ctypes.data, length=buf.nbytes, group=0,
                       layer_first=layer, layers=1, slot=slot, block_bytes=buf.shape[1],
                       num_blocks=6)
    return a, buf


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_sglang_head_slices_agree_with_the_read_plan(url, prefill_tp, decode_tp):
    """The head slices each prefill rank writes (plan_slice, ranges) are the
    pieces segxfer's planner (sx_layout_plan through Agent.open_group and
    Group.plan) reads for the decode rank from the set of prefill ranks:
    the same ranks, heads, piece count and piece size per page."""
    import re
    from segxfer import _sglang_slices as sl
    hb, ps, heads = 64, 2, 4
    names = ["pf/tp%d" % r for r in range(prefill_tp)]
    pf = [_plan_agent(url, n, prefill_tp, r) for r, n in enumerate(names)]
    try:
        for a, _ in pf:
            a.publish()
        for dr in range(decode_tp):
            d, _ = _plan_agent(url, None, decode_tp, dr)
            with d, d.open_group(names) as g:
                text = g.plan()
            planned = {}
            for m in re.finditer(r"reads heads? (\d+)(?:-(\d+))?.*? of (\S+): (\d+) "
                                 r"pieces? of (\d+) B per", text):
                planned[m.group(3)] = (int(m.group(1)), int(m.group(2) or m.group(1)),
                                       int(m.group(4)), int(m.group(5)))
            assert planned, text
            mine = {}
            dec = dict(tp_size=decode_tp, tp_rank=dr, heads=heads // decode_tp,
                       item=ps * heads // decode_tp * hb, page_size=ps)
            for r, n in enumerate(names):
                pre = dict(tp_size=prefill_tp, tp_rank=r, heads=heads // prefill_tp,
                           item=ps * heads // prefill_tp * hb, page_size=ps)
                try:
                    s = sl.plan_slice(pre, dec)
                except ValueError as e:
                    assert "shares no KV head" in str(e)
                    continue
                first = dr * dec["heads"] + s.dst_off // hb
                one_page = sl.ranges(s, [0], pre["item"], [0], dec["item"], [0], [1])
                mine[n] = (first, first + s.length // hb - 1, len(one_page),
                           one_page[0][3])
            assert mine == planned, (text, mine)
    finally:
        for a, _ in pf:
            a.close()


def test_sglang_head_slices_merge_and_refuse():
    from segxfer import _sglang_slices as sl
    p = dict(tp_size=2, tp_rank=1, heads=2, item=2 * 2 * 64, page_size=2)
    d = dict(tp_size=1, tp_rank=0, heads=4, item=2 * 4 * 64, page_size=2)
    s = sl.plan_slice(p, d)
    assert (s.src_off, s.dst_off, s.length) == (0, 128, 128)
    # Two tokens a page, src rows contiguous, dst strided: a range a token.
    rng = sl.ranges(s, [1000], p["item"], [7], d["item"], [0, 1], [5, 6])
    assert rng == [(1000, 7, 5 * 512 + 128, 128), (1128, 7, 5 * 512 + 256 + 128, 128),
                   (1256, 7, 6 * 512 + 128, 128), (1384, 7, 6 * 512 + 256 + 128, 128)]
    # Equal heads: consecutive pages merge into one range.
    e = sl.plan_slice(dict(d), dict(d))
    assert sl.ranges(e, [0], 512, [3], 512, [4, 5, 6], [1, 2, 3]) == [(2048, 3, 512, 1536)]
    for bad, why in ((dict(d, tp_size=3), "not a multiple"),
                     (dict(d, page_size=1, item=256), "page sizes differ"),
                     (dict(d, item=2 * 4 * 32), "head of a token"),
                     (dict(d, heads=2, item=256), "KV heads in all")):
        with pytest.raises(ValueError, match=why):
            sl.plan_slice(p, bad)


def test_sglang_layout_mismatch_is_refused_before_any_write(engines):
    prefill, decode, room, _ = opened_with(engines, env={"SEGXFER_FINGERPRINT": "another-model"})
    res = prefill.cmd("poll", room, 10)
    assert res["state"] == "Failed" and "fingerprint" in res["reason"], res
    res = decode.cmd("poll", room, 10)
    assert res["state"] == "Failed" and "cannot take this prefill's KV" in res["reason"], res
    assert decode.cmd("verify", room)["problems"]   # nothing was written
    prefill.quit()
    decode.quit()


@pytest.mark.skipif(not CUDA, reason="no CUDA device here (torch.cuda.is_available() is "
                    "False); the GPU machine runs this")
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_sglang_gpu_kv_over_cuda_ipc_and_staged_tcp(engines, transport):
    psegs, dsegs, results = run_transfer(engines, device="cuda:0",
                                         env={"SEGXFER_TRANSPORTS": transport})
    # KV and state on the GPU, aux rows in host memory: two segments per rank.
    assert sorted(psegs) == ["aux", "kv"] and sorted(dsegs) == ["aux", "kv"]
    for res in results.values():
        want = ["cuda_ipc", "tcp"] if transport == "auto" else ["tcp"]
        assert res["transports"] == want, res


def test_sglang_a_failed_room_is_never_lifted_again(url, monkeypatch):
    """A room aborted while its grant was on the way stays Failed: SGLang's
    update_status keeps the larger state, and Failed is the smallest."""
    monkeypatch.setenv("SX_METADATA_URL", url)
    monkeypatch.setenv("SEGXFER_SGLANG_STANDIN", "1")
    import sglang_engine as eng
    from segxfer import sglang
    c = sglang.classes()
    KVPoll = c["KVPoll"]
    bport = free_port()
    server = c["SegxferKVBootstrapServer"]("127.0.0.1", bport)
    bufs = eng.Buffers("cpu", 3)
    mgr = c["SegxferKVManager"](bufs.kv_args(c["KVArgs"], 0),
                                c["DisaggregationMode"].PREFILL, eng.ServerArgs({"bport": bport}),
                                False)
    try:
        sender = c["SegxferKVSender"](mgr, "127.0.0.1:%d" % bport, 42, [0], 0)
        sender.abort()
        mgr.decode_peers["decode-x"] = {"state": "ready", "endpoint": ("127.0.0.1", 1),
                                        "segments": {}, "reason": None}
        mgr.transfer_infos[42] = {"decode-x": {"required_dst_info_num": 1}}
        mgr._room_ready(42)                     # the grant arrives after the abort
        assert mgr.check_status(42) == KVPoll.Failed
        mgr.advance(42, KVPoll.Transferring)
        assert mgr.check_status(42) == KVPoll.Failed
    finally:
        mgr.teardown()
        server.close()


def _bad(a, **kw):
    for k, v in kw.items():
        setattr(a, k, v)
    return a


BAD_KV_ARGS = [
    (lambda a: _bad(a, kv_data_lens=a.kv_data_lens[:-1]),
     r"kv_data_ptrs, kv_data_lens and kv_item_lens differ in length \(8, 7, 8\)"),
    (lambda a: _bad(a, kv_item_lens=a.kv_item_lens[1:]), r"differ in length \(8, 8, 7\)"),
    (lambda a: _bad(a, aux_item_lens=[]),
     r"aux_data_ptrs, aux_data_lens and aux_item_lens differ"),
    (lambda a: _bad(a, state_item_lens=[[]]),
     r"state_data_ptrs\[0\], state_data_lens\[0\] and state_item_lens\[0\] differ"),
    (lambda a: _bad(a, state_data_lens=[]),
     r"state_data_ptrs, state_data_lens and state_item_lens differ in length \(1, 0, 1\)"),
    (lambda a: _bad(a, kv_data_lens=[-1] + a.kv_data_lens[1:]),
     r"kv_data_lens\[0\] must be a non-negative integer"),
    (lambda a: _bad(a, kv_item_lens=[4096.0] + a.kv_item_lens[1:]),
     r"kv_item_lens\[0\] must be a non-negative integer"),
    (lambda a: _bad(a, kv_data_ptrs=None), r"kv_data_ptrs must be a list"),
    (lambda a: _bad(a, page_size=0), r"page_size must be a positive integer"),
    (lambda a: _bad(a, page_size=True), r"page_size must be a positive"),
]


def test_sglang_bad_kv_args_are_refused(url, monkeypatch):
    """KVArgs whose lists do not pair up (zip used to drop the buffers past
    the shortest list and publish the rest), sizes that are not integers, a
    page size of 0: ValueError naming the field, on either side, before
    anything is bound or published; a good manager starts after them."""
    monkeypatch.setenv("SX_METADATA_URL", url)
    monkeypatch.setenv("SEGXFER_SGLANG_STANDIN", "1")
    import sglang_engine as eng
    from segxfer import sglang
    c = sglang.classes()
    bport = free_port()
    server = c["SegxferKVBootstrapServer"]("127.0.0.1", bport)
    try:
        for role in ("PREFILL", "DECODE"):
            mode = c["DisaggregationMode"][role]
            for change, message in BAD_KV_ARGS:
                args = change(eng.Buffers("cpu", 3).kv_args(c["KVArgs"], 0))
                with pytest.raises(ValueError, match=message):
                    c["SegxferKVManager"](args, mode, eng.ServerArgs({"bport": bport}), False)
            mgr = c["SegxferKVManager"](eng.Buffers("cpu", 3).kv_args(c["KVArgs"], 0), mode,
                                        eng.ServerArgs({"bport": bport}), False)
            assert set(mgr.segment_names()) == {"kv"}
            mgr.teardown()
    finally:
        server.close()


def test_sglang_decode_counts_write_notices_only(url, monkeypatch):
    """A room turns Success on write notices, which the data plane
    authenticated (WAUTH, the decode's grant).  A read notice names its
    reader as the reader says, and any reader of the store can read the
    decode's (readable) pages: one that calls itself the prefill's segment
    and reads exactly the room's bytes with notify_tag=room must not end
    the room before the prefill wrote anything."""
    monkeypatch.setenv("SX_METADATA_URL", url)
    monkeypatch.setenv("SEGXFER_SGLANG_STANDIN", "1")
    monkeypatch.setenv("SEGXFER_SGLANG_LIVENESS_S", "600")   # no pings of the fake prefill
    import segxfer
    import sglang_engine as eng
    from segxfer import sglang
    c = sglang.classes()
    KVPoll = c["KVPoll"]
    bport = free_port()
    server = c["SegxferKVBootstrapServer"]("127.0.0.1", bport)
    # KVArgs hold raw pointers, as SGLang's do: the pool they point into
    # must outlive the manager (a temporary here was freed while the
    # decode's agent still served it: AddressSanitizer saw the read).
    bufs = eng.Buffers("cpu", 3)
    mgr = c["SegxferKVManager"](bufs.kv_args(c["KVArgs"], 0),
                                c["DisaggregationMode"].DECODE, eng.ServerArgs({"bport": bport}),
                                False)
    forger = None
    try:
        prefill = "sglang/prefill/elsewhere/1/r0/pp0"
        ep = ("127.0.0.1", 1)
        mgr.prefill_peers[ep] = {"parts": {"kv": prefill}, "failed": None, "misses": 0,
                                 "segment": None}
        room, size = 4242, 4096
        mgr.update_status(room, KVPoll.WaitingForInput)
        assert mgr.register_decode_room(room, [ep], size)
        forger = segxfer.Agent(prefill, url, log_level="error")
        buf = bytearray(size)
        forger.register(buf, block_bytes=size)
        seg = forger.open(mgr.segment_names()["kv"])
        region = seg.regions()[0]["id"]
        with seg.read_ranges([(buf, region, 0, size)], notify_tag=room) as b:
            assert b.wait(10) and b.result().ok
        seg.close()
        time.sleep(0.5)    # the decode's thread takes notices every 20 ms
        assert mgr.check_status(room) == KVPoll.WaitingForInput
    finally:
        if forger is not None:
            forger.close()
        mgr.teardown()
        server.close()
        del bufs
