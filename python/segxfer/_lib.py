"""The C library: finding libsegxfer.so, the struct mirrors, the prototypes.

ctypes over the shared library, not a compiled extension: the same files work
with any CPython 3 (Debian's 3.11 here, 3.12 on the GPU machine) without a
compiler or Python headers where they run.  The cost of the binding is a few
microseconds per call, and the hot path makes a handful of calls per batch
(block lists go down as arrays), never one per block.

The structures below mirror include/segxfer/*.h field by field; the test
tests/python/test_abi.py compares every size and offset with what the C
compiler says, so a header change cannot silently shift memory.  Structures
handed to the library are allocated with zeroed slack behind them (new_struct)
so a library whose struct grew (fields are only appended) writes into the slack
rather than past the object.
"""
import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_size_t,
                    c_int32, c_uint, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)

# Limits from include/segxfer/descriptor.h.
NAME_MAX = 200
FINGERPRINT_MAX = 127
TAG_MAX = 31
HOST_ID_LEN = 36
HOSTNAME_MAX = 64
LABEL_KEY_MAX = 63
LABEL_VALUE_MAX = 255
ADDR_MAX = 63
MAX_DEVICES = 8
MAX_SLOTS = 64
INCARNATION_LEN = 16
TOKEN_LEN = 16
GID_LEN = 16
HOST_ID_LEN = 36
HOSTNAME_MAX = 64

SLOT_K, SLOT_V, SLOT_INDEX, SLOT_STATE = 0, 1, 2, 3
ACCESS_REMOTE_READ = 1
ACCESS_REMOTE_WRITE = 2
BATCH_WRITE = 1          # sx_batch_params.flags (segxfer/push.h)
BATCH_NOTIFY = 2         # a read batch that ends with a read notice
NOTICE_KINDS = {0: "write", 1: "read"}   # sx_notice_kind
NOTICE_MAX_ENTRIES = 1024
PUBLISH_TAKEOVER = 1
CHECK_IGNORE_FINGERPRINT = 1

# sx_transport_kind; SX_TRANSPORTS_* is 1 << kind.  cuda_ipc is the kind the
# GPU work adds (SX_TRANSPORT_CUDA_IPC = 3); a library without it refuses an
# agent that asks for it alone, and ignores it in a list with others.
TRANSPORT_KINDS = {"tcp": 1, "rdma": 2, "cuda_ipc": 3}
TRANSPORT_NAMES = {0: "none", 1: "tcp", 2: "rdma", 3: "cuda_ipc"}

BATCH_STATES = {0: "NEW", 1: "RUNNING", 2: "COMPLETED", 3: "FAILED", 4: "TIMEOUT",
                5: "CANCELLED"}
AGENT_STATES = {0: "UNPUBLISHED", 1: "PUBLISHED", 2: "RECLAIMING", 3: "FENCED"}
LOG_LEVELS = {"error": 0, "warn": 1, "info": 2, "debug": 3}
MISMATCH_KINDS = {0: "none", 1: "fingerprint", 2: "layout_tag", 3: "dtype",
                  4: "missing_key", 5: "extra_key", 6: "block_bytes", 7: "block_desc",
                  8: "heads_total", 9: "head_dim", 10: "block_tokens", 11: "order",
                  12: "heads_missing", 13: "heads_overlap", 14: "tp"}


MAX_BLOCK_DESCS = 8
KV_ORDERS = {"NHD": 1, "HND": 2, "MLA": 3}


class BlockDesc(Structure):
    _fields_ = [("group", c_uint32), ("order", c_int), ("tokens", c_uint32),
                ("head_first", c_uint32), ("head_count", c_uint32),
                ("heads_total", c_uint32), ("head_dim", c_uint32),
                ("dtype", c_char * (TAG_MAX + 1)), ("slots", c_uint64)]


class Layout(Structure):
    _fields_ = [("fingerprint", c_char * (FINGERPRINT_MAX + 1)),
                ("tag", c_char * (TAG_MAX + 1)),
                ("dtype", c_char * (TAG_MAX + 1)),
                ("tp_rank", c_uint32), ("tp_size", c_uint32),
                ("pp_rank", c_uint32), ("pp_size", c_uint32),
                ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("n_blocks", c_uint32), ("blocks", BlockDesc * MAX_BLOCK_DESCS)]


class Label(Structure):
    _fields_ = [("key", c_char * (LABEL_KEY_MAX + 1)),
                ("value", c_char * (LABEL_VALUE_MAX + 1))]


LOG_FN = CFUNCTYPE(None, c_void_p, c_int, c_char_p)


class AgentParams(Structure):
    _fields_ = [("name", c_char_p), ("metadata_url", c_char_p), ("ns", c_char_p),
                ("listen", c_char_p), ("advertise", c_char_p),
                ("transports", c_uint), ("lease_ms", c_uint32), ("renew_ms", c_uint32),
                ("conns_per_peer", c_uint32), ("rdma_devices", c_char_p),
                ("rdma_gid_index", c_int), ("rdma_slice_bytes", c_uint32),
                ("slice_bytes", c_uint32), ("cache_ttl_ms", c_uint32),
                ("layout", Layout), ("labels", POINTER(Label)), ("n_labels", c_uint32),
                ("log", LOG_FN), ("log_arg", c_void_p), ("log_level", c_int),
                ("staging_bytes", c_uint64), ("rdma_gpu", c_uint32),
                ("tcp_threads", c_int32), ("tcp_thread_bytes", c_uint32)]


class RegionParams(Structure):
    _fields_ = [("addr", c_void_p), ("length", c_uint64), ("group", c_uint32),
                ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("layer_stride", c_uint64), ("slot", c_uint32), ("block_bytes", c_uint64),
                ("block_stride", c_uint64), ("num_blocks", c_uint64),
                ("location", c_char_p), ("access", c_uint32)]


class Endpoint(Structure):
    _fields_ = [("kind", c_int), ("addr", c_char * (ADDR_MAX + 1)), ("port", c_uint16),
                ("device", c_char * (TAG_MAX + 1)), ("gid", c_uint8 * GID_LEN),
                ("port_num", c_uint8), ("mtu", c_uint32)]


class Region(Structure):
    _fields_ = [("id", c_uint32), ("group", c_uint32), ("layer_first", c_uint32),
                ("layer_count", c_uint32), ("layer_stride", c_uint64), ("slot", c_uint32),
                ("access", c_uint32), ("addr", c_uint64), ("length", c_uint64),
                ("block_bytes", c_uint64), ("block_stride", c_uint64),
                ("num_blocks", c_uint64), ("location", c_char * (TAG_MAX + 1)),
                ("n_rkeys", c_uint32), ("rkeys", c_uint32 * MAX_DEVICES),
                ("n_wkeys", c_uint32), ("wkeys", c_uint32 * MAX_DEVICES),
                ("nic", c_uint32)]


class Desc(Structure):
    _fields_ = [("schema_version", c_uint32), ("name", c_char * (NAME_MAX + 1)),
                ("incarnation", c_uint8 * INCARNATION_LEN), ("generation", c_uint64),
                ("published_at_ms", c_uint64), ("lease_ms", c_uint32),
                ("token", c_uint8 * TOKEN_LEN), ("layout", Layout),
                ("endpoints", POINTER(Endpoint)), ("n_endpoints", c_uint32),
                ("regions", POINTER(Region)), ("n_regions", c_uint32),
                ("labels", POINTER(Label)), ("n_labels", c_uint32),
                ("host_id", c_char * (HOST_ID_LEN + 1)),
                ("hostname", c_char * (HOSTNAME_MAX + 1)), ("process", c_uint64)]


class Mismatch(Structure):
    _fields_ = [("kind", c_int), ("field", c_char_p), ("group", c_uint32),
                ("layer", c_uint32), ("slot", c_uint32),
                ("local", c_char * (FINGERPRINT_MAX + 1)),
                ("remote", c_char * (FINGERPRINT_MAX + 1)), ("message", c_char * 512)]


class BlockRead(Structure):
    _fields_ = [("group", c_uint32), ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("slots", c_uint64), ("remote_block", c_uint64), ("local_block", c_uint64),
                ("count", c_uint64)]


class BlockIds(Structure):
    _fields_ = [("group", c_uint32), ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("slots", c_uint64), ("local", c_void_p), ("n_local", c_size_t),
                ("remote", c_void_p), ("n_remote", c_size_t)]


class RangeRead(Structure):
    _fields_ = [("local", c_void_p), ("remote_region", c_uint32), ("offset", c_uint64),
                ("length", c_uint64)]


# Push mode (include/segxfer/push.h).  sx_range_write has sx_range_read's
# layout (the ABI test checks it), so both are packed by one function.
class BlockWrite(Structure):
    _fields_ = [("group", c_uint32), ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("slots", c_uint64), ("local_block", c_uint64), ("remote_block", c_uint64),
                ("count", c_uint64)]


class RangeWrite(Structure):
    _fields_ = [("local", c_void_p), ("remote_region", c_uint32), ("offset", c_uint64),
                ("length", c_uint64)]


class NoticeBlocks(Structure):
    _fields_ = [("group", c_uint32), ("layer_first", c_uint32), ("layer_count", c_uint32),
                ("slots", c_uint64), ("block", c_uint64), ("count", c_uint64)]


class NoticeRange(Structure):
    _fields_ = [("region", c_uint32), ("offset", c_uint64), ("length", c_uint64)]


class Notice(Structure):
    _fields_ = [("producer", c_char * (NAME_MAX + 1)),
                ("incarnation", c_uint8 * INCARNATION_LEN), ("tag", c_uint64),
                ("bytes", c_uint64), ("transport", c_int), ("n_blocks", c_uint32),
                ("n_ranges", c_uint32), ("kind", c_uint32),
                ("blocks", POINTER(NoticeBlocks)),
                ("ranges", POINTER(NoticeRange))]


class BatchParams(Structure):
    _fields_ = [("timeout_ms", c_uint32), ("cb", c_void_p), ("cb_arg", c_void_p),
                ("flags", c_uint), ("tag", c_uint64)]  # flags 0: a read batch


class BatchResult(Structure):
    _fields_ = [("state", c_int), ("error", c_int), ("message", c_char * 256),
                ("bytes", c_uint64), ("n_entries", c_uint32), ("n_ranges", c_uint32),
                ("n_failed", c_uint32), ("failed", POINTER(c_uint32)),
                ("transport", c_int), ("post_ns", c_uint64), ("transfer_ns", c_uint64)]


class GroupParams(Structure):
    _fields_ = [("names", POINTER(c_char_p)), ("n_names", c_uint32), ("engine", c_char_p),
                ("tp_size", c_uint32), ("timeout_ms", c_uint32), ("flags", c_uint),
                ("pattern", c_char_p)]


class GroupResult(Structure):
    _fields_ = [("state", c_int), ("error", c_int), ("message", c_char * 256),
                ("bytes", c_uint64), ("n_ranges", c_uint32), ("members", c_uint32),
                ("n_failed", c_uint32), ("failed", POINTER(c_uint64)),
                ("transfer_ns", c_uint64)]


class PlanInfo(Structure):
    _fields_ = [("members", c_uint32), ("used", c_uint32), ("groups", c_uint32),
                ("pieces", c_uint32), ("whole", c_uint32)]


class AgentStatus(Structure):
    _fields_ = [("state", c_int), ("generation", c_uint64), ("renewals", c_uint64),
                ("renew_failures", c_uint64), ("republishes", c_uint64),
                ("store_reconnects", c_uint64), ("last_error", c_int), ("store_up", c_int),
                ("served_reads", c_uint64), ("served_bytes", c_uint64),
                ("served_errors", c_uint64)]


# Every mirrored struct, by its C name (the ABI test walks this).
STRUCTS = {"sx_layout": Layout, "sx_block_desc": BlockDesc,
           "sx_group_params": GroupParams, "sx_group_result": GroupResult,
           "sx_plan_info": PlanInfo, "sx_label": Label, "sx_agent_params": AgentParams,
           "sx_region_params": RegionParams, "sx_endpoint": Endpoint, "sx_region": Region,
           "sx_desc": Desc, "sx_mismatch": Mismatch, "sx_block_read": BlockRead,
           "sx_block_ids": BlockIds,
           "sx_range_read": RangeRead, "sx_batch_params": BatchParams,
           "sx_batch_result": BatchResult, "sx_agent_status": AgentStatus,
           "sx_block_write": BlockWrite, "sx_range_write": RangeWrite,
           "sx_notice_blocks": NoticeBlocks, "sx_notice_range": NoticeRange,
           "sx_notice": Notice}

_SLACK = 512


def new_struct(cls):
    """A zeroed instance of cls with _SLACK zeroed bytes behind it."""
    return cls.from_buffer(bytearray(ctypes.sizeof(cls) + _SLACK))


def _candidates():
    env = os.environ.get("SEGXFER_LIB")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    return [os.path.join(here, "libsegxfer.so.0"), os.path.join(here, "libsegxfer.so"),
            os.path.join(root, "build", "lib", "libsegxfer.so"), "libsegxfer.so.0"]


def _load():
    """SEGXFER_LIB (a path) if set, else beside the package, else the build
    tree this package sits in (build/lib), else the system loader."""
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append("%s: no such file" % path)
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(str(e))
    raise ImportError("segxfer: cannot load libsegxfer.so (set SEGXFER_LIB to its path, "
                      "or build it with make, or install it with make install): " +
                      "; ".join(errors))


lib, lib_path = _load()

_P = c_void_p
_PROTOS = {
    "sx_version": (c_char_p, []),
    "sx_err_name": (c_char_p, [c_int]),
    "sx_strerror": (c_char_p, [c_int]),
    "sx_errmsg": (c_char_p, []),
    "sx_agent_params_init": (None, [POINTER(AgentParams)]),
    "sx_agent_create": (c_int, [POINTER(AgentParams), POINTER(_P)]),
    "sx_agent_destroy": (None, [_P]),
    "sx_agent_incarnation": (None, [_P, POINTER(c_uint8 * INCARNATION_LEN)]),
    "sx_agent_register": (c_int, [_P, POINTER(RegionParams), POINTER(c_uint32)]),
    "sx_agent_unregister": (c_int, [_P, c_uint32]),
    "sx_agent_publish": (c_int, [_P, c_uint]),
    "sx_agent_unpublish": (c_int, [_P]),
    "sx_agent_status_get": (c_int, [_P, POINTER(AgentStatus)]),
    "sx_agent_metrics_text": (c_int, [_P, POINTER(c_void_p), POINTER(c_size_t)]),
    "sx_agent_descriptor": (c_int, [_P, POINTER(Desc)]),
    "sx_desc_free": (None, [POINTER(Desc)]),
    "sx_desc_to_json": (c_int, [POINTER(Desc), c_int, POINTER(c_void_p)]),
    "sx_segment_open": (c_int, [_P, c_char_p, c_uint32, POINTER(_P)]),
    "sx_segment_close": (None, [_P]),
    "sx_segment_desc": (POINTER(Desc), [_P]),
    "sx_segment_check": (c_int, [_P, c_uint, POINTER(Mismatch)]),
    "sx_segment_transport": (c_int, [_P]),
    "sx_segment_ping": (c_int, [_P, c_uint32, POINTER(c_uint64), POINTER(c_int)]),
    "sx_batch_params_init": (None, [POINTER(BatchParams)]),
    "sx_batch_create": (c_int, [_P, POINTER(BatchParams), POINTER(_P)]),
    "sx_batch_add_blocks": (c_int, [_P, POINTER(BlockRead), c_size_t]),
    "sx_batch_add_ranges": (c_int, [_P, c_void_p, c_size_t]),
    "sx_batch_add_block_ids": (c_int, [_P, POINTER(BlockIds)]),
    "sx_batch_submit": (c_int, [_P]),
    "sx_batch_wait": (c_int, [_P, c_int]),
    "sx_batch_poll": (c_int, [_P]),
    "sx_batch_fd": (c_int, [_P]),
    "sx_batch_cancel": (c_int, [_P]),
    "sx_batch_result_get": (c_int, [_P, POINTER(BatchResult)]),
    "sx_batch_destroy": (None, [_P]),
    "sx_mem_location": (c_int, [c_void_p, c_uint64, c_char_p, c_size_t]),
    "sx_batch_add_block_writes": (c_int, [_P, POINTER(BlockWrite), c_size_t]),
    "sx_batch_add_range_writes": (c_int, [_P, c_void_p, c_size_t]),
    "sx_agent_grant_write": (c_int, [_P, c_char_p, c_void_p]),
    "sx_agent_revoke_write": (c_int, [_P, c_char_p, c_void_p]),
    "sx_agent_notice_next": (c_int, [_P, c_int, POINTER(POINTER(Notice))]),
    "sx_agent_notice_fd": (c_int, [_P]),
    "sx_notice_free": (None, [POINTER(Notice)]),
    "sx_group_params_init": (None, [POINTER(GroupParams)]),
    "sx_group_open": (c_int, [_P, POINTER(GroupParams), POINTER(_P), POINTER(Mismatch)]),
    "sx_group_close": (None, [_P]),
    "sx_group_size": (c_uint32, [_P]),
    "sx_group_segment": (_P, [_P, c_uint32]),
    "sx_group_plan": (_P, [_P]),
    "sx_group_read": (c_int, [_P, POINTER(c_uint64), c_size_t, POINTER(c_uint64), c_size_t,
                              c_uint32, POINTER(GroupResult)]),
    "sx_group_read_notify": (c_int, [_P, POINTER(c_uint64), c_size_t, POINTER(c_uint64),
                                     c_size_t, c_uint32, c_uint64, POINTER(GroupResult)]),
    "sx_segment_plan": (c_int, [_P, c_uint, POINTER(_P), POINTER(Mismatch)]),
    "sx_plan_free": (None, [_P]),
    "sx_plan_text": (c_int, [_P, POINTER(c_void_p)]),
    "sx_plan_info_get": (c_int, [_P, POINTER(PlanInfo)]),
}
for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args

# free() for the buffers sx_agent_metrics_text and sx_desc_to_json return.
_libc = ctypes.CDLL(None)
_libc.free.argtypes = [c_void_p]
_libc.free.restype = None


def take_string(ptr):
    """Copy a malloc()ed C string and free it."""
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        _libc.free(ptr)


def text(raw):
    """A char array or char * from C as str."""
    return raw.decode("utf-8", "replace") if raw else ""
