"""Stand-in for LMDeploy's CacheEngine (lmdeploy/pytorch/engine/cache_engine.py
at 1263d5cd889b7ad500e85b8eb20401327a4516ab), reduced to what a migration
backend sees.  The cache is one pool, as allocate_caches makes it for a
standard model: torch.zeros((num_layers, num_blocks, pool bytes per block),
uint8), kept as full_gpu_cache.  p2p_initialize, p2p_connect and migrate do
what LMDeploy's do, step for step:

- p2p_initialize builds the backend from the registry by the configured
  backend's name, sets the request's rank, registers every non-empty cache
  of [full_gpu_cache] with mr_key = its index (0), addr = data_ptr(),
  offset = storage_offset(), length = numel() * itemsize, and returns the
  endpoint info as json.dumps(backend.endpoint_info(remote, protocol)).
- p2p_connect passes the backend conn_req[tp_rank].
- migrate takes the block size in bytes from the pool's last dimension, the
  local layer stride from num_gpu_blocks and the peer's from
  backend.links[remote_engine_id].remote_engine_config.num_gpu_blocks, builds
  one AssignmentInstruct per layer per (remote, local) block pair, and awaits
  backend.p2p_migrate(MigrationAssignment(...)).
"""
import json

import torch

from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
from lmdeploy.pytorch.disagg.conn.protocol import (DistServeInitRequest,
                                                   DistServeKVTransferEndpointInfo)
from lmdeploy.pytorch.disagg.messages import (AssignmentInstruct, DistServeRegisterMRMessage,
                                              MigrationAssignment, MigrationExecutionBatch)


class CacheEngine:
    """cache_config: num_gpu_blocks, migration_backend (a MigrationBackend);
    model_config: num_layers; block_bytes: the pool's bytes per block."""

    def __init__(self, cache_config, model_config, block_bytes, rank=0, tp_rank=0,
                 device="cuda"):
        self.cache_config, self.model_config = cache_config, model_config
        self.rank, self.tp_rank = rank, tp_rank
        self.full_gpu_cache = torch.zeros(
            (model_config.num_layers, cache_config.num_gpu_blocks, block_bytes),
            dtype=torch.uint8, device=device)
        self.migration_backend_impl = None

    def p2p_initialize(self, migration_init_request: DistServeInitRequest):
        if not self.migration_backend_impl:
            self.migration_backend_impl = \
                MIGRATION_BACKENDS.module_dict[self.cache_config.migration_backend.name]()
        migration_init_request.rank = self.rank
        self.migration_backend_impl.p2p_initialize(migration_init_request)
        for key, t in enumerate([self.full_gpu_cache]):
            if t.numel() == 0:
                continue
            self.migration_backend_impl.register_memory_region(DistServeRegisterMRMessage(
                protocol=migration_init_request.protocol,
                remote_engine_id=migration_init_request.remote_engine_id,
                mr_key=key, addr=t.data_ptr(), offset=t.storage_offset(),
                length=t.numel() * t.element_size()))  # itemsize: torch >= 2.1
        info = self.migration_backend_impl.endpoint_info(migration_init_request.remote_engine_id,
                                                         migration_init_request.protocol)
        return DistServeKVTransferEndpointInfo(protocol=migration_init_request.protocol,
                                               endpoint_info=json.dumps(info))

    def p2p_connect(self, remote_engine_id, migration_conn_request):
        self.migration_backend_impl.p2p_connect(remote_engine_id,
                                                migration_conn_request[self.tp_rank])

    async def migrate(self, migration_execution_inputs: MigrationExecutionBatch):
        unit = self.full_gpu_cache.element_size() * self.full_gpu_cache.size(-1)
        layer_stride = self.cache_config.num_gpu_blocks * unit
        layers = self.model_config.num_layers
        batch = []
        for remote_engine_id, block_ids in migration_execution_inputs.requests:
            link = self.migration_backend_impl.links[remote_engine_id]
            remote_layer_stride = link.remote_engine_config.num_gpu_blocks * unit
            for key, t in enumerate([self.full_gpu_cache]):
                if t.numel() == 0:
                    continue
                batch.extend(AssignmentInstruct(
                    mr_key=key, target_offset=remote * unit + layer * remote_layer_stride,
                    source_offset=local * unit + layer * layer_stride, length=unit)
                    for layer in range(layers) for remote, local in block_ids)
        await self.migration_backend_impl.p2p_migrate(MigrationAssignment(
            protocol=migration_execution_inputs.protocol, remote_engine_id=remote_engine_id,
            batch=batch))
