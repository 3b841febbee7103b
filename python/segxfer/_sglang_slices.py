"""Head slices between SGLang engines of different attention TP (segxfer's
SGLang backend, segxfer.sglang).

SGLang's MHA KV pool is per layer and K/V a buffer of pages, each page
[page_size tokens][kv heads of the rank][head_dim] (token-major, NHD), so a
page's item is page_size * heads * head_bytes.  Attention TP rank r of T
holds KV heads [r * h, (r + 1) * h) of h * T.  SGLang's Mooncake backend
(python/sglang/srt/disaggregation/mooncake/conn.py, send_kvcache_slice, at
d012942e) writes, for each page and each token of it, the bytes of the
heads the two ranks share; common/conn.py's _resolve_rank_mapping gives each
decode rank its prefill ranks (target_tp_ranks) and the number of decode
ranks each prefill rank waits for (required_dst_info_num).

Here the same pieces are byte ranges of a push-mode write batch: a prefill
rank writes the heads it shares with the decode rank from its pages into
the decode's pages; pieces contiguous on both sides are merged (whole pages
where the heads are all of both ranks').  Each rank states what it holds
(kv_head_num, head bytes, page_size) and the pair is refused before any
write where the heads do not partition alike.
"""
import numpy as np

from ._sglang_proto import _RUNS_PER_BATCH


class Slice:
    """What one prefill rank writes into one decode rank's pages: per
    token, `length` bytes from offset src_off of the prefill's token row
    (src_token bytes) to dst_off of the decode's (dst_token bytes)."""

    __slots__ = ("src_off", "dst_off", "length", "src_token", "dst_token", "page_size")

    def __init__(self, src_off, dst_off, length, src_token, dst_token, page_size):
        self.src_off, self.dst_off, self.length = src_off, dst_off, length
        self.src_token, self.dst_token, self.page_size = src_token, dst_token, page_size

    def __repr__(self):
        return ("Slice(src +%d, dst +%d, %d B per token; token rows %d -> %d B, %d tokens "
                "a page)" % (self.src_off, self.dst_off, self.length, self.src_token,
                             self.dst_token, self.page_size))


def ratio_reason(local_tp, remote_tp, local_heads):
    """Why local attention TP local_tp (holding local_heads KV heads a rank)
    cannot pair with remote_tp, or None.  SGLang maps ranks by integer
    ratio (_resolve_rank_mapping); heads must split evenly on both sides."""
    lo, hi = sorted((int(local_tp), int(remote_tp)))
    if lo < 1:
        return "attention TP sizes must be at least 1 (got %d and %d)" % (local_tp,
                                                                          remote_tp)
    if hi % lo:
        return ("attention TP %d and %d: the larger is not a multiple of the smaller, so "
                "ranks do not map onto each other" % (local_tp, remote_tp))
    total = int(local_heads) * int(local_tp)
    if int(local_heads) < 1 or total % int(remote_tp):
        return ("%d KV heads do not split evenly over attention TP %d (replicated KV heads, "
                "TP above the model's KV head count, are not supported across different "
                "TP)" % (total, remote_tp))
    return None


def plan_slice(prefill, decode):
    """The Slice a prefill rank writes into a decode rank, from the two
    ranks' statements: dicts of tp_size, tp_rank, heads (KV heads held),
    item (bytes of a page), page_size.  Raises ValueError with the reason
    where they cannot pair (before any write)."""
    for side, d in (("prefill", prefill), ("decode", decode)):
        for k in ("tp_size", "tp_rank", "heads", "item", "page_size"):
            if not isinstance(d.get(k), int) or d[k] < (0 if k == "tp_rank" else 1):
                raise ValueError("the %s rank states no valid %s (got %r)"
                                 % (side, k, d.get(k)))
        if d["tp_rank"] >= d["tp_size"]:
            raise ValueError("the %s rank's TP rank %d is outside TP %d"
                             % (side, d["tp_rank"], d["tp_size"]))
        if d["item"] % (d["page_size"] * d["heads"]):
            raise ValueError("the %s rank's page of %d bytes is not %d tokens of %d heads"
                             % (side, d["item"], d["page_size"], d["heads"]))
    reason = ratio_reason(prefill["tp_size"], decode["tp_size"], prefill["heads"])
    if reason:
        raise ValueError(reason)
    if prefill["page_size"] != decode["page_size"]:
        raise ValueError("page sizes differ: prefill %d tokens, decode %d"
                         % (prefill["page_size"], decode["page_size"]))
    ps = prefill["page_size"]
    hb_p = prefill["item"] // (ps * prefill["heads"])
    hb_d = decode["item"] // (ps * decode["heads"])
    if hb_p != hb_d:
        raise ValueError("a head of a token is %d bytes on the prefill, %d on the decode "
                         "(head_dim or dtype differ)" % (hb_p, hb_d))
    if prefill["heads"] * prefill["tp_size"] != decode["heads"] * decode["tp_size"]:
        raise ValueError("the prefill holds %d KV heads in all (%d x TP %d), the decode %d "
                         "(%d x TP %d)" % (prefill["heads"] * prefill["tp_size"],
                                           prefill["heads"], prefill["tp_size"],
                                           decode["heads"] * decode["tp_size"],
                                           decode["heads"], decode["tp_size"]))
    p0 = prefill["tp_rank"] * prefill["heads"]
    d0 = decode["tp_rank"] * decode["heads"]
    a, b = max(p0, d0), min(p0 + prefill["heads"], d0 + decode["heads"])
    if a >= b:
        raise ValueError("prefill rank %d (heads %d-%d) shares no KV head with decode rank "
                         "%d (heads %d-%d)" % (prefill["tp_rank"], p0, p0 + prefill["heads"]
                                               - 1, decode["tp_rank"], d0,
                                               d0 + decode["heads"] - 1))
    return Slice((a - p0) * hb_p, (a - d0) * hb_p, (b - a) * hb_p,
                 prefill["heads"] * hb_p, decode["heads"] * hb_p, ps)


def sends_whole_rows(prefill_tp, decode_tp, prefill_tp_rank):
    """Whether this prefill rank writes the aux row and state slots: where
    several prefill ranks feed one decode rank only the first of them does
    (the rows are the same on each, and the decode counts them once)."""
    if prefill_tp <= decode_tp:
        return True
    return prefill_tp_rank % (prefill_tp // decode_tp) == 0


def ranges(sl, src_ptrs, src_item, dst_regions, dst_item, src_pages, dst_pages):
    """The range writes (local address, remote region, offset, length) of
    sl for pages src_pages -> dst_pages, for each local buffer i at
    src_ptrs[i] into the decode region dst_regions[i]; pieces contiguous
    on both sides merged."""
    src_pages = np.asarray(src_pages, np.int64)
    dst_pages = np.asarray(dst_pages, np.int64)
    tok = np.arange(sl.page_size, dtype=np.int64)
    # Offsets of every (page, token) piece, in page then token order.
    src = (src_pages[:, None] * src_item + tok[None, :] * sl.src_token + sl.src_off).ravel()
    dst = (dst_pages[:, None] * dst_item + tok[None, :] * sl.dst_token + sl.dst_off).ravel()
    if len(src) == 0:
        return []
    # A piece starts a run unless it follows the previous on both sides.
    start = np.ones(len(src), bool)
    start[1:] = (src[1:] != src[:-1] + sl.length) | (dst[1:] != dst[:-1] + sl.length)
    first = np.flatnonzero(start)
    lengths = np.diff(np.append(first, len(src))) * sl.length
    out = []
    for ptr, region in zip(src_ptrs, dst_regions):
        out.extend(zip((int(ptr) + src[first]).tolist(), [region] * len(first),
                       dst[first].tolist(), lengths.tolist()))
    return out


def chunks(rng, limit=_RUNS_PER_BATCH):
    """rng in lists of at most `limit` ranges (a notice lists at most 1024
    entries)."""
    return [rng[i:i + limit] for i in range(0, len(rng), limit)]
