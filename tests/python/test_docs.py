"""The five lines docs/python.md (and the README) show in place of
P2PHANDSHAKE run as written and move the blocks they say."""
import asyncio
import os

import torch

import segxfer
from conftest import ROOT


def five_lines():
    with open(os.path.join(ROOT, "docs", "python.md")) as f:
        text = f.read()
    after = text.split("An engine that calls the package directly", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_docs_five_lines_replace_p2phandshake(url, monkeypatch):
    code = five_lines()
    assert len(code.strip().splitlines()) == 5
    monkeypatch.setenv("SX_METADATA_URL", url)
    pk = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    pv = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    with segxfer.Agent("prefill/tp0", url, dtype="bf16", tag="NHD", log_level="warn") as pre:
        pre.register_blocks(pk, "K")
        pre.register_blocks(pv, "V")
        pre.publish()
        scope = dict(segxfer=segxfer, os=os, engine_id="decode", rank=0,
                     k_cache=torch.zeros(2, 4, 4, dtype=torch.bfloat16),
                     v_cache=torch.zeros(2, 4, 4, dtype=torch.bfloat16),
                     peer_segment_name="prefill/tp0", remote_block_ids=[5, 1],
                     local_block_ids=[0, 3])
        body = "".join("    " + line + "\n" for line in code.strip().splitlines())
        exec("async def engine():\n" + body + "    return agent\n", scope)
        agent = asyncio.run(scope["engine"]())
        agent.close()
    assert torch.equal(scope["k_cache"][:, [0, 3]], pk[:, [5, 1]])
    assert torch.equal(scope["v_cache"][:, [0, 3]], pv[:, [5, 1]])
