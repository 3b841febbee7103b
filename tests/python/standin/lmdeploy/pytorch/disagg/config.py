"""Stand-in: lmdeploy/pytorch/disagg/config.py's enums and models (field lists
as LMDeploy's)."""
import enum
from typing import Optional

from pydantic import BaseModel


class MigrationBackend(enum.Enum):
    DLSlime = enum.auto()
    Mooncake = enum.auto()


class RDMALinkType(enum.Enum):
    IB = enum.auto()
    RoCE = enum.auto()


class DistServeRDMAConfig(BaseModel):
    with_gdr: bool = True
    link_type: RDMALinkType = RDMALinkType.RoCE


class DistServeTCPConfig(BaseModel):
    pass


class DistServeNVLinkConfig(BaseModel):
    pass


class DistServeEngineConfig(BaseModel):
    tp_size: int
    ep_size: int
    dp_size: int
    pp_size: Optional[int]
    dp_rank: int
    block_size: int
    num_cpu_blocks: int
    num_gpu_blocks: int
