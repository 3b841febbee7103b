"""A small decoder-only transformer with a paged KV cache, and the three
roles of the end-to-end test (test_e2e_prefill_decode.py), each its own OS
process:

  prefill    run the prompt, fill the paged cache at the block ids its block
             manager hands out, register the cache, publish it as a segment,
             report {segment, block_ids, prompt_len, first_token}, serve
             until told "done" on stdin, then report what it served
  decode     resolve the prefill segment by name, check the layout, pull the
             request's blocks into other block ids of its own cache, decode
             N tokens greedily; write tokens and logits
  reference  prefill and decode in one process, no segxfer

Different layouts (the read plans of docs/architecture.md): a prefill
process may hold one tensor-parallel rank's share of the KV heads
(--tp-rank/--tp-size: it runs the whole model, as a TP rank's attention
output after the all-reduce is the whole model's, and registers only its
heads), and the decode role with --plan opens the prefill ranks as one set
(--peer-tp) and reads through the plan; with --tp-size N it runs N decode
ranks, each an agent of its own with a cache of its own heads and its own
plan, and the model then runs on their caches put side by side (what the
all-reduce of a TP attention computes).  --block-size and --kv-layout
(NHD or HND) set the paged cache's shape on each side.

Random weights from a fixed seed (made on the CPU, then moved, so every
device gets the same ones), RMSNorm, rotary embeddings, grouped-query
attention over the paged cache gathered through the block table, SwiGLU.
Written for torch 1.13 (Debian) and 2.x alike.

    python3 e2e_model.py prefill --url URL --name NAME [--device cuda:0]
    python3 e2e_model.py decode --url URL --peer NAME --remote-blocks 5,2,9 ...
"""
import argparse
import asyncio
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

VOCAB, DIM, LAYERS, HEADS, HEAD_DIM, FFN, BLOCK_SIZE = 97, 64, 4, 4, 16, 128, 4
NUM_BLOCKS = {"prefill": 40, "decode": 24}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def prompt_tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


class TinyLM:
    def __init__(self, seed, kv_heads, device, dtype, block_size=BLOCK_SIZE, kv_layout="NHD"):
        self.kv_heads, self.device, self.dtype = kv_heads, device, dtype
        self.block_size, self.kv_layout = block_size, kv_layout
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

        self.embed = w(VOCAB, DIM, scale=1.0)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(dict(
                norm1=1.0 + w(DIM, scale=0.1), norm2=1.0 + w(DIM, scale=0.1),
                wq=w(DIM, HEADS * HEAD_DIM, scale=DIM ** -0.5),
                wk=w(DIM, kv_heads * HEAD_DIM, scale=DIM ** -0.5),
                wv=w(DIM, kv_heads * HEAD_DIM, scale=DIM ** -0.5),
                wo=w(HEADS * HEAD_DIM, DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
                w1=w(DIM, FFN, scale=DIM ** -0.5), w3=w(DIM, FFN, scale=DIM ** -0.5),
                w2=w(FFN, DIM, scale=FFN ** -0.5)))
        self.norm = 1.0 + w(DIM, scale=0.1)
        self.head = w(DIM, VOCAB, scale=DIM ** -0.5)
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.inv_freq = inv.to(device)

    def new_cache(self, num_blocks, heads=None):
        """K and V: [layers, num_blocks, block_size, heads, head_dim] (NHD) or
        [layers, num_blocks, heads, block_size, head_dim] (HND)."""
        heads = self.kv_heads if heads is None else heads
        if self.kv_layout == "HND":
            shape = (LAYERS, num_blocks, heads, self.block_size, HEAD_DIM)
        else:
            shape = (LAYERS, num_blocks, self.block_size, heads, HEAD_DIM)
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

    def head_axis(self):
        return 2 if self.kv_layout == "HND" else 3

    def _at(self, li, blocks, offs):
        """The cache index of (layer, blocks, offsets): rows [S, heads, hd]."""
        if self.kv_layout == "HND":
            return (li, blocks, slice(None), offs)
        return (li, blocks, offs)

    @staticmethod
    def _rms(x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def _rope(self, x, pos):
        ang = pos.float()[:, None] * self.inv_freq[None, :]          # [T, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]       # [T, 1, hd/2]
        xf = x.float()
        a, b = xf[..., :HEAD_DIM // 2], xf[..., HEAD_DIM // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)

    def forward(self, tokens, pos, cache, table):
        """Run tokens at positions pos (the cache already holds every earlier
        position of the request); write their K/V through the block table
        and return the logits of the last one (float32)."""
        k_cache, v_cache = cache
        tokens = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(pos, device=self.device)
        table = torch.tensor(table, device=self.device)
        t = tokens.numel()
        total = int(pos[-1]) + 1
        all_pos = torch.arange(total, device=self.device)
        rep = HEADS // self.kv_heads
        mask = all_pos[None, :] > pos[:, None]                        # [T, S] future
        x = self.embed[tokens]
        for li, p in enumerate(self.layers):
            h = self._rms(x, p["norm1"])
            q = self._rope((h @ p["wq"]).view(t, HEADS, HEAD_DIM), pos)
            k = self._rope((h @ p["wk"]).view(t, self.kv_heads, HEAD_DIM), pos)
            v = (h @ p["wv"]).view(t, self.kv_heads, HEAD_DIM)
            bs = self.block_size
            k_cache[self._at(li, table[pos // bs], pos % bs)] = k
            v_cache[self._at(li, table[pos // bs], pos % bs)] = v
            at = self._at(li, table[all_pos // bs], all_pos % bs)
            keys = k_cache[at].repeat_interleave(rep, dim=1)   # [S, H, hd]
            vals = v_cache[at].repeat_interleave(rep, dim=1)
            scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(mask[None], float("-inf"))
            att = torch.einsum("hts,shd->thd", scores.softmax(-1), vals.float()).to(x.dtype)
            x = x + att.reshape(t, HEADS * HEAD_DIM) @ p["wo"]
            h = self._rms(x, p["norm2"])
            gate = h @ p["w1"]
            x = x + (gate * torch.sigmoid(gate) * (h @ p["w3"])) @ p["w2"]
        return (self._rms(x[-1:], self.norm) @ self.head).float()[0]


class BlockManager:
    """Hands out block ids in a seeded shuffled order, as a real block
    manager's free list ends up after some traffic."""

    def __init__(self, num_blocks, seed):
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def alloc(self, n):
        if n > len(self.free):
            raise RuntimeError("out of KV blocks")
        out, self.free = self.free[:n], self.free[n:]
        return out


def blocks_for(n_tokens, block_size=BLOCK_SIZE):
    return (n_tokens + block_size - 1) // block_size


def decode_steps(model, cache, table, manager, first_token, start, steps):
    """Greedy decoding: (tokens after first_token, their logits [steps, V])."""
    tokens, logits = [], []
    tok = first_token
    for i in range(steps):
        pos = start + i
        if pos // model.block_size >= len(table):
            table.extend(manager.alloc(1))
        out = model.forward([tok], [pos], cache, table)
        logits.append(out.cpu())
        tok = int(out.argmax())
        tokens.append(tok)
    return tokens, torch.stack(logits)


def setup(args):
    torch.manual_seed(0)
    torch.set_num_threads(1)     # one CPU kernel path in every process
    dtype = DTYPES[args.dtype]
    return TinyLM(args.seed, args.kv_heads, args.device, dtype, args.block_size, args.kv_layout)


def rank_heads(kv_heads, rank, size):
    """(first, count) of the KV heads a TP rank holds; with more ranks than
    heads, size // kv_heads ranks hold each head (GQA replication)."""
    if size > kv_heads:
        return rank // (size // kv_heads), 1
    return rank * (kv_heads // size), kv_heads // size


def agent_layout(args):
    import segxfer
    # The fingerprint names the model; the heads per rank show in the
    # block size, the dtype in the layout: both are checked.
    return dict(fingerprint="tiny-llama/seed%d" % args.seed, tag="NHD",
                dtype=segxfer.dtype_name(DTYPES[args.dtype]))


def say(obj):
    print(json.dumps(obj), flush=True)


def say_error(e):
    """Report a segxfer error (a layout mismatch with its kind and values);
    the decode role's exit status for it."""
    say({"error": type(e).__name__, "message": str(e), "kind": getattr(e, "kind", None),
         "local": getattr(e, "local", None), "remote": getattr(e, "remote", None)})
    return 3


def run_prefill(args):
    import segxfer
    model = setup(args)
    prompt = prompt_tokens(args.prompt_seed, args.prompt_len)
    cache = model.new_cache(NUM_BLOCKS["prefill"])
    table = BlockManager(NUM_BLOCKS["prefill"], 11).alloc(blocks_for(len(prompt),
                                                                     model.block_size))
    logits = model.forward(prompt, list(range(len(prompt))), cache, table)
    torch.save(logits.cpu(), args.out)
    layout = agent_layout(args)
    if args.tp_size:
        # This rank keeps its share of the KV heads, in a cache of its own.
        first, count = rank_heads(args.kv_heads, args.tp_rank, args.tp_size)
        ax = model.head_axis()
        cache = tuple(c.narrow(ax, first, count).contiguous() for c in cache)
        layout.update(tp_rank=args.tp_rank, tp_size=args.tp_size,
                      kv_heads=(first, count, args.kv_heads))
    if args.plan:
        layout.update(kv_layout=args.kv_layout, kv_cache=cache[0])
    # cuda_ipc hands its handles out over the TCP listener: a target that
    # serves it must run TCP too (the reader is the one that forces it).
    serve = "tcp,cuda_ipc" if args.transport == "cuda_ipc" else args.transport
    with segxfer.Agent(args.name, args.url, transports=serve, lease_ms=args.lease_ms,
                       log_level="warn", **layout) as agent:
        agent.register_blocks(cache[0], "K")
        agent.register_blocks(cache[1], "V")
        agent.publish()
        say({"segment": args.name, "block_ids": table, "prompt_len": len(prompt),
             "first_token": int(logits.argmax())})
        sys.stdin.readline()       # the test says when the decode side is done
        say({"served_reads": agent.status()["served_reads"]})


def run_decode_plan(args):
    """Decode through read plans: --tp-size ranks (default 1), each an agent
    with a cache of its heads, reading one set of prefill segments."""
    import segxfer
    model = setup(args)
    manager = BlockManager(NUM_BLOCKS["decode"], 23)
    remote = [int(b) for b in args.remote_blocks.split(",")]
    ranks = args.tp_size or 1
    local = manager.alloc(blocks_for(args.prompt_len, model.block_size))
    if args.peer_tp:
        peers = dict(engine=args.peer, tp_size=args.peer_tp)
    else:
        peers = dict(names=[args.peer])
    caches, plans, served = [], [], 0
    for r in range(ranks):
        first, count = rank_heads(args.kv_heads, r, ranks)
        cache = model.new_cache(NUM_BLOCKS["decode"], count)
        layout = agent_layout(args)
        layout.update(tp_rank=r, tp_size=args.tp_size, kv_heads=(first, count, args.kv_heads),
                      kv_layout=args.kv_layout, kv_cache=cache[0])
        with segxfer.Agent(None, args.url, transports=args.transport, log_level="error",
                           **layout) as agent:
            agent.register_blocks(cache[0], "K")
            agent.register_blocks(cache[1], "V")
            try:
                with agent.open_group(timeout=args.open_timeout, **peers) as g:
                    plans.append(g.plan())
                    result = asyncio.run(g.read_blocks_async(remote, local, timeout=10))
                    transport = g.transport
            except segxfer.SegxferError as e:
                return say_error(e)
            if not result.ok:
                say({"error": result.state, "message": result.message,
                     "failed": result.failed})
                return 3
            served += result.bytes
        caches.append(cache)
    # The ranks' caches side by side: every head, as the all-reduce sees it.
    ax = model.head_axis()
    cache = tuple(torch.cat([c[i] for c in caches], dim=ax) for i in range(2))
    tokens, logits = decode_steps(model, cache, list(local), manager, args.first_token,
                                  args.prompt_len, args.steps)
    torch.save({"tokens": tokens, "logits": logits}, args.out)
    say({"local_blocks": local, "tokens": tokens, "transport": transport, "plans": plans,
         "bytes": served})
    return 0


def run_decode(args):
    import segxfer
    if args.plan:
        return run_decode_plan(args)
    model = setup(args)
    cache = model.new_cache(NUM_BLOCKS["decode"])
    manager = BlockManager(NUM_BLOCKS["decode"], 23)
    remote = [int(b) for b in args.remote_blocks.split(",")]
    with segxfer.Agent(None, args.url, transports=args.transport, log_level="error",
                       **agent_layout(args)) as agent:
        agent.register_blocks(cache[0], "K")
        agent.register_blocks(cache[1], "V")
        if args.go_on_stdin:       # ready: the test starts the clock now
            say({"ready": True})
            sys.stdin.readline()
        try:
            with agent.open(args.peer, timeout=args.open_timeout) as seg:
                seg.check()
                local = manager.alloc(len(remote))
                if not args.skip_pull:
                    asyncio.run(pull(seg, remote, local))
                transport = seg.transport
        except segxfer.SegxferError as e:
            return say_error(e)
    tokens, logits = decode_steps(model, cache, list(local), manager, args.first_token,
                                  args.prompt_len, args.steps)
    torch.save({"tokens": tokens, "logits": logits}, args.out)
    say({"local_blocks": local, "tokens": tokens, "transport": transport})
    return 0


async def pull(seg, remote, local):
    """Read the request's blocks; the loop is free while they move (a real
    engine keeps scheduling other requests here)."""
    batch = seg.read_blocks(remote, local, timeout=10)
    ticks = 0
    while not batch.done():
        await asyncio.sleep(0)
        ticks += 1
        if ticks > 5:
            break
    result = await batch
    batch.close()
    return result


def run_reference(args):
    model = setup(args)
    prompt = prompt_tokens(args.prompt_seed, args.prompt_len)
    cache = model.new_cache(NUM_BLOCKS["prefill"])
    manager = BlockManager(NUM_BLOCKS["prefill"], 5)
    table = manager.alloc(blocks_for(len(prompt), model.block_size))
    prefill_logits = model.forward(prompt, list(range(len(prompt))), cache, table)
    first = int(prefill_logits.argmax())
    tokens, logits = decode_steps(model, cache, table, manager, first, len(prompt),
                                  args.steps)
    torch.save({"tokens": [first] + tokens, "prefill_logits": prefill_logits.cpu(),
                "decode_logits": logits}, args.out)
    say({"tokens": [first] + tokens})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode", "reference"])
    ap.add_argument("--url")
    ap.add_argument("--name", default="e2e/prefill-0")
    ap.add_argument("--peer", default="e2e/prefill-0")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompt-seed", type=int, default=99)
    ap.add_argument("--prompt-len", type=int, default=13)
    ap.add_argument("--first-token", type=int, default=0)
    ap.add_argument("--remote-blocks", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lease-ms", type=int, default=2000)
    ap.add_argument("--open-timeout", type=float, default=5.0)
    ap.add_argument("--skip-pull", action="store_true")
    ap.add_argument("--go-on-stdin", action="store_true",
                    help="decode: set up, print ready, open the peer after a line on stdin")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--kv-layout", default="NHD", choices=["NHD", "HND"])
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=0,
                    help="prefill: this rank's share of the KV heads; decode (--plan): "
                         "this many ranks")
    ap.add_argument("--plan", action="store_true",
                    help="describe the blocks; decode: read through a plan from a set")
    ap.add_argument("--peer-tp", type=int, default=0,
                    help="decode --plan: the prefill set is PEER/tp0..tp<N-1>")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    return {"prefill": run_prefill, "decode": run_decode,
            "reference": run_reference}[args.role](args) or 0


if __name__ == "__main__":
    sys.exit(main())
