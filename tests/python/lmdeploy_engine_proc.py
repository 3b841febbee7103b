"""One LMDeploy engine process for test_lmdeploy_engine.py, started with
multiprocessing's 'spawn' like LMDeploy's engine and Ray workers: a fresh
interpreter that knows only its environment.  It imports the stand-in
LMDeploy (tests/python/standin) and builds its CacheEngine; the backend
comes from MIGRATION_BACKENDS by name, so it is segxfer's only if the
segxfer.pth hook registered it at start-up (SEGXFER_LMDEPLOY).

The test process plays LMDeploy's proxy: it sends pydantic messages as JSON
(as the proxy posts them to /distserve/p2p_initialize and p2p_connect) and
gets the engine's answers back over a pipe.
"""
import asyncio

from engine_proc import serve


def dump(model):
    """A pydantic model as JSON (pydantic 2 or Debian's 1.10)."""
    return model.model_dump_json() if hasattr(model, "model_dump_json") else model.json()


def load(cls, text):
    return cls.model_validate_json(text) if hasattr(cls, "model_validate_json") \
        else cls.parse_raw(text)


def registered():
    """MIGRATION_BACKENDS' names and what each builds, as module.qualname."""
    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
    return {k: "%s.%s" % (v.__module__, v.__qualname__)
            for k, v in MIGRATION_BACKENDS.module_dict.items()}


def main(conn, num_layers, num_blocks, block_bytes, device, seed):
    """Serve the proxy's requests on conn until "exit"."""
    import torch
    from lmdeploy.pytorch.disagg.config import MigrationBackend
    from lmdeploy.pytorch.disagg.conn.protocol import (DistServeConnectionRequest,
                                                       DistServeInitRequest)
    from lmdeploy.pytorch.disagg.messages import MigrationExecutionBatch
    from lmdeploy.pytorch.engine.cache_engine import CacheEngine

    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    engine = CacheEngine(Config(num_gpu_blocks=num_blocks,
                                migration_backend=MigrationBackend.Mooncake),
                         Config(num_layers=num_layers), block_bytes, device=device)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        engine.full_gpu_cache.copy_(torch.randint(0, 256, engine.full_gpu_cache.shape,
                                                  generator=g, dtype=torch.uint8))

    def link(remote):
        link = engine.migration_backend_impl.links[remote]
        return {"type": "%s.%s" % (type(link).__module__, type(link).__qualname__),
                "remote_num_gpu_blocks": link.remote_engine_config.num_gpu_blocks,
                "rank": link.rank,
                "transport": link.segment.transport if link.segment else None}

    def connect(text):
        # lmdeploy/pytorch/disagg/conn/engine_conn.py, p2p_connect.
        req = load(DistServeConnectionRequest, text)
        engine.p2p_connect(req.remote_engine_id, req.remote_kvtransfer_endpoint_info)

    def close():
        if engine.migration_backend_impl is not None:
            engine.migration_backend_impl.close()

    serve(conn, {
        "registered": registered,
        "init": lambda text: dump(engine.p2p_initialize(load(DistServeInitRequest, text))),
        "link": link,
        "connect": connect,
        "migrate": lambda text: asyncio.run(engine.migrate(load(MigrationExecutionBatch,
                                                                text))),
        "cache": lambda: engine.full_gpu_cache.cpu().numpy().tobytes(),
    }, close)
