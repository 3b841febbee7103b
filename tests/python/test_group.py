"""Block descriptions and segment sets from Python, in one process over
loopback TCP and a real redis-server: the description derived from a cache
tensor's shape, a TP=2 prefill read as one set into a TP=1 reader (bytes
compared with a reference), plans in words, and refusals before any byte
moves."""
import pytest
import torch

import segxfer

LAYERS, BLOCKS, TOKENS, HEADS, HEAD_DIM = 2, 8, 4, 4, 8


def test_block_desc_from_the_cache_shape():
    nhd = torch.zeros(LAYERS, BLOCKS, TOKENS, 2, HEAD_DIM, dtype=torch.bfloat16)
    assert segxfer.block_desc(nhd, kv_layout="NHD", tp_rank=1, tp_size=2) == dict(
        group=0, kv_layout="NHD", tokens=TOKENS, head_first=2, head_count=2, heads_total=4,
        head_dim=HEAD_DIM, dtype="bf16", slots=None)
    hnd = torch.zeros(LAYERS, BLOCKS, 1, TOKENS, HEAD_DIM)
    # GQA replication: 4 ranks over 2 heads, rank 3 holds head 1.
    d = segxfer.block_desc(hnd, kv_layout="HND", tp_rank=3, tp_size=4, heads_total=2)
    assert (d["head_first"], d["head_count"], d["tokens"], d["dtype"]) == (1, 1, TOKENS,
                                                                           "fp32")
    mla = segxfer.block_desc(torch.zeros(LAYERS, BLOCKS, TOKENS, 64), kv_layout="MLA")
    assert (mla["head_count"], mla["heads_total"], mla["head_dim"]) == (1, 1, 64)
    with pytest.raises(segxfer.SX_EINVAL):
        segxfer.block_desc(nhd, kv_layout="HDN")
    with pytest.raises(segxfer.SX_EINVAL, match="shaped"):
        segxfer.block_desc(torch.zeros(4, 4), kv_layout="NHD")
    with pytest.raises(segxfer.SX_EINVAL, match="needed"):
        segxfer.block_desc(kv_layout="NHD", tokens=4)


def fill(cache, first, n_heads, table, tokens):
    """Element (layer, slot, position, head, e) holds a code of all five."""
    for s in range(2):
        for layer in range(LAYERS):
            for p in range(tokens):
                for h in range(first, first + n_heads):
                    v = torch.arange(HEAD_DIM, dtype=torch.float32) + \
                        ((((layer * 2 + s) * 64 + p) * HEADS + h) * HEAD_DIM + 1)
                    cache[s][layer, table[p // TOKENS], p % TOKENS, h - first] = v


class Ranks:
    def __init__(self, url, engine, ranks):
        self.agents, self.caches = [], []
        per = HEADS // ranks
        for r in range(ranks):
            cache = [torch.zeros(LAYERS, BLOCKS, TOKENS, per, HEAD_DIM) for _ in range(2)]
            a = segxfer.Agent("%s/tp%d" % (engine, r), url, transports="tcp",
                              listen="127.0.0.1:0", dtype="fp32", tp_rank=r, tp_size=ranks,
                              kv_layout="NHD", kv_cache=cache[0], log_level="error")
            a.register_blocks(cache[0], "K")
            a.register_blocks(cache[1], "V")
            a.publish()
            self.agents.append(a)
            self.caches.append((cache, r * per, per))

    def close(self):
        for a in self.agents:
            a.close()


def reader(url, heads=HEADS, rank=0, size=0):
    cache = [torch.zeros(LAYERS, BLOCKS, TOKENS, heads, HEAD_DIM) for _ in range(2)]
    a = segxfer.Agent(None, url, transports="tcp", dtype="fp32", tp_rank=rank, tp_size=size,
                      kv_layout="NHD", kv_cache=cache[0],
                      kv_heads=(rank * heads, heads, HEADS), log_level="error")
    a.register_blocks(cache[0], "K")
    a.register_blocks(cache[1], "V")
    return a, cache


def test_group_reads_a_tp2_prefill_into_one_rank(url):
    remote, local, tokens = [6, 1, 3], [2, 7, 0], 11
    ranks = Ranks(url, "pf", 2)
    try:
        for cache, first, n in ranks.caches:
            fill(cache, first, n, remote, tokens)
        agent, cache = reader(url)
        with agent:
            desc = agent.descriptor()["layout"]["blocks"][0]
            assert (desc["order"], desc["head_count"], desc["heads_total"]) == ("NHD", 4, 4)
            with agent.open_group(engine="pf", tp_size=2) as g:
                assert len(g) == 2 and g.transport == "tcp"
                words = g.plan()
                assert "reads heads 2-3 (all it holds) of each block of pf/tp1" in words
                assert g.plan_info()["used"] == 2
                res = g.read_blocks(remote, local, timeout=10)
                assert res.ok and res.failed == [] and res.members == 2, res
                ref = [torch.zeros_like(c) for c in cache]
                fill(ref, 0, HEADS, local, tokens)
                # Whole blocks arrived: positions past the request are the
                # prefill side's zeros on both.
                assert all(torch.equal(a, b) for a, b in zip(ref, cache))
            with agent.open_group(pattern="pf/tp*") as g:
                assert len(g) == 2 and g.read_blocks(remote, local).ok
                assert [a.notices() for a in ranks.agents] == [[], []]
                # With notify_tag: one read notice at each prefill rank,
                # the tag and the bytes of its memory the read took.
                for c in cache:
                    c.zero_()
                res = g.read_blocks(remote, local, timeout=10, notify_tag=2**64 - 5)
                assert res.ok and all(torch.equal(a, b) for a, b in zip(ref, cache))
                got = [a.notices() for a in ranks.agents]
                assert [len(n) for n in got] == [1, 1]
                for (n,) in got:
                    assert (n.kind, n.tag) == ("read", 2**64 - 5)
                    assert sum(r.length for r in n.ranges) == n.bytes > 0
                assert sum(n.bytes for (n,) in got) == res.bytes
                with pytest.raises(segxfer.SX_EINVAL):
                    g.read_blocks(remote, local, notify_tag=-1)
            # One rank alone: a structured refusal.
            with pytest.raises(segxfer.IncompatibleLayout) as e:
                agent.open_group(["pf/tp0"])
            assert (e.value.kind, e.value.local) == ("heads_missing", "2")
            with pytest.raises(segxfer.SX_ENOENT, match="pf/tp2"):
                agent.open_group(engine="pf", tp_size=3, timeout=0.2)
            with pytest.raises(segxfer.SX_EINVAL):
                agent.open_group()
        # A TP=2 decode rank 1 (heads 2-3) against each prefill rank: the
        # equal check passes only the one with its heads (the block sizes
        # are equal either way), and the plan says so in words.
        part, _ = reader(url, heads=2, rank=1, size=2)
        with part:
            with part.open("pf/tp1") as seg:
                seg.check()
                assert "reads heads 2-3 (all it holds) of each block of pf/tp1" in seg.plan()
            with part.open("pf/tp0") as seg:
                with pytest.raises(segxfer.IncompatibleLayout) as e:
                    seg.check()
                assert e.value.kind == "block_desc"
                with pytest.raises(segxfer.IncompatibleLayout) as e:
                    seg.plan()
                assert (e.value.kind, e.value.local) == ("heads_missing", "2")
    finally:
        ranks.close()


def test_group_read_refuses_blocks_outside_and_reports_a_member_gone(url):
    ranks = Ranks(url, "pg", 2)
    try:
        agent, _ = reader(url)
        with agent, agent.open_group(engine="pg", tp_size=2) as g:
            with pytest.raises(segxfer.SX_EBOUNDS):
                g.read_blocks([BLOCKS], [0])
            ranks.agents[1].close()
            res = g.read_blocks([1, 2], [3, 4], timeout=5)
            assert res.state == "FAILED" and "pg/tp1" in res.message
            assert res.failed == [3, 4]
    finally:
        ranks.close()
