"""Stand-in: lmdeploy/pytorch/disagg/messages.py's messages (field lists as
LMDeploy's)."""
from typing import List, Tuple

from pydantic import BaseModel

from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol


class MigrationExecutionBatch(BaseModel):
    protocol: MigrationProtocol
    requests: List[Tuple[str, List[Tuple[int, int]]]] = []


class AssignmentInstruct(BaseModel):
    mr_key: int
    target_offset: int
    source_offset: int
    length: int


class MigrationAssignment(BaseModel):
    protocol: MigrationProtocol
    remote_engine_id: str
    batch: List[AssignmentInstruct]


class DistServeRegisterMRMessage(BaseModel):
    protocol: MigrationProtocol
    remote_engine_id: str
    mr_key: int
    addr: int
    offset: int
    length: int
