"""Stand-in: lmdeploy/pytorch/disagg/conn/protocol.py's messages (field
lists as LMDeploy's)."""
import enum
from typing import List, Optional

from pydantic import BaseModel

from lmdeploy.pytorch.disagg.config import (DistServeEngineConfig, DistServeNVLinkConfig,
                                            DistServeRDMAConfig, DistServeTCPConfig)


class MigrationProtocol(enum.Enum):
    TCP = enum.auto()
    RDMA = enum.auto()
    NVLINK = enum.auto()


class DistServeInitRequest(BaseModel):
    local_engine_id: str
    local_engine_config: DistServeEngineConfig
    remote_engine_id: str
    remote_engine_config: DistServeEngineConfig
    protocol: MigrationProtocol
    rank: Optional[int] = None
    tcp_config: Optional[DistServeTCPConfig] = None
    rdma_config: Optional[DistServeRDMAConfig] = None
    nvlink_config: Optional[DistServeNVLinkConfig] = None


class DistServeEngineEndpointInfo(BaseModel):
    zmq_address: str


class DistServeKVTransferEndpointInfo(BaseModel):
    protocol: MigrationProtocol
    endpoint_info: str


class DistServeConnectionRequest(BaseModel):
    protocol: MigrationProtocol
    remote_engine_id: str
    remote_engine_endpoint_info: DistServeEngineEndpointInfo
    remote_kvtransfer_endpoint_info: List[DistServeKVTransferEndpointInfo]
