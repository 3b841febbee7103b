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
    def __init__(self, seed, kv_heads, device, dtype):
        self.kv_heads, self.device, self.dtype = kv_heads, device, dtype
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

    def new_cache(self, num_blocks):
        """K and V: [layers, num_blocks, block_size, kv_heads, head_dim] (NHD)."""
        shape = (LAYERS, num_blocks, BLOCK_SIZE, self.kv_heads, HEAD_DIM)
        return (torch.zeros(shape, device=self.device, dtype=self.dtype),
                torch.zeros(shape, device=self.device, dtype=self.dtype))

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
            k_cache[li, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k
            v_cache[li, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v
            blocks, offs = table[all_pos // BLOCK_SIZE], all_pos % BLOCK_SIZE
            keys = k_cache[li, blocks, offs].repeat_interleave(rep, dim=1)   # [S, H, hd]
            vals = v_cache[li, blocks, offs].repeat_interleave(rep, dim=1)
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


def blocks_for(n_tokens):
    return (n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE


def decode_steps(model, cache, table, manager, first_token, start, steps):
    """Greedy decoding: (tokens after first_token, their logits [steps, V])."""
    tokens, logits = [], []
    tok = first_token
    for i in range(steps):
        pos = start + i
        if pos // BLOCK_SIZE >= len(table):
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
    return TinyLM(args.seed, args.kv_heads, args.device, dtype)


def agent_layout(args):
    import segxfer
    # The fingerprint names the model; the heads per rank show in the
    # block size, the dtype in the layout: both are checked.
    return dict(fingerprint="tiny-llama/seed%d" % args.seed, tag="NHD",
                dtype=segxfer.dtype_name(DTYPES[args.dtype]))


def say(obj):
    print(json.dumps(obj), flush=True)


def run_prefill(args):
    import segxfer
    model = setup(args)
    prompt = prompt_tokens(args.prompt_seed, args.prompt_len)
    cache = model.new_cache(NUM_BLOCKS["prefill"])
    table = BlockManager(NUM_BLOCKS["prefill"], 11).alloc(blocks_for(len(prompt)))
    logits = model.forward(prompt, list(range(len(prompt))), cache, table)
    torch.save(logits.cpu(), args.out)
    # cuda_ipc hands its handles out over the TCP listener: a target that
    # serves it must run TCP too (the reader is the one that forces it).
    serve = "tcp,cuda_ipc" if args.transport == "cuda_ipc" else args.transport
    with segxfer.Agent(args.name, args.url, transports=serve, lease_ms=args.lease_ms,
                       log_level="warn", **agent_layout(args)) as agent:
        agent.register_blocks(cache[0], "K")
        agent.register_blocks(cache[1], "V")
        agent.publish()
        say({"segment": args.name, "block_ids": table, "prompt_len": len(prompt),
             "first_token": int(logits.argmax())})
        sys.stdin.readline()       # the test says when the decode side is done
        say({"served_reads": agent.status()["served_reads"]})


def run_decode(args):
    import segxfer
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
            say({"error": type(e).__name__, "message": str(e),
                 "kind": getattr(e, "kind", None), "local": getattr(e, "local", None),
                 "remote": getattr(e, "remote", None)})
            return 3
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
    table = manager.alloc(blocks_for(len(prompt)))
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
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    return {"prefill": run_prefill, "decode": run_decode,
            "reference": run_reference}[args.role](args) or 0


if __name__ == "__main__":
    sys.exit(main())
