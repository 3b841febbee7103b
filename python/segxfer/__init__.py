"""segxfer for Python: named, leased, layout-checked KV-cache segments and
batched block reads between serving engines, and writes with completion
notices (push mode), over libsegxfer (ctypes).

    import segxfer
    agent = segxfer.Agent("prefill-0/tp0", "redis://127.0.0.1:6379?namespace=prod",
                          dtype="bf16", tag="NHD", fingerprint="llama-3-8b/v1")
    agent.register_blocks(k_cache, slot="K")
    agent.register_blocks(v_cache, slot="V")
    agent.publish()

See docs/python.md.
"""
from . import _lib
from .agent import Agent, Region, Segment
from .batch import Batch, BatchResult
from .group import Group, GroupResult, block_desc
from .errors import CODES, IncompatibleLayout, SegxferError
from .errors import *  # noqa: F401,F403  (SX_EINVAL, SX_ENOENT, ...: one class per code)
from .memory import pointer_location
from .push import Notice, NoticeBlocks, NoticeRange

__version__ = _lib.text(_lib.lib.sx_version())
library_path = _lib.lib_path

SLOT_K, SLOT_V, SLOT_INDEX, SLOT_STATE = (_lib.SLOT_K, _lib.SLOT_V, _lib.SLOT_INDEX,
                                          _lib.SLOT_STATE)

_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8",
           "uint8": "uint8"}


def dtype_name(dtype):
    """The layout dtype text for a torch or numpy dtype (torch.bfloat16 ->
    "bf16"), so both sides of a transfer spell it the same way."""
    name = str(dtype).replace("torch.", "")
    return _DTYPES.get(name, name)


__all__ = ["Agent", "Region", "Segment", "Batch", "BatchResult", "Group", "GroupResult",
           "block_desc", "Notice", "NoticeBlocks",
           "NoticeRange", "SegxferError",
           "IncompatibleLayout", "CODES", "dtype_name", "pointer_location", "library_path",
           "SLOT_K", "SLOT_V", "SLOT_INDEX", "SLOT_STATE"] + [c.__name__ for c in CODES.values()]
