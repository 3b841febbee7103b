"""The shape of sgl-project/sglang python/sglang/srt/disaggregation/utils.py
(000eaffa) that segxfer's hook patches: the TransferBackend enum, the
KVClassType enum and get_kv_class, a closed if/elif over the backends.  The
classes it returns here are placeholders that name their backend."""
from enum import Enum


class TransferBackend(Enum):
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"


class KVClassType(Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


def _placeholder(backend, class_type):
    return type("%s_%s" % (backend.value, class_type.value), (), {})


def get_kv_class(transfer_backend, class_type):
    if transfer_backend == TransferBackend.MOONCAKE:
        return _placeholder(transfer_backend, class_type)
    elif transfer_backend == TransferBackend.NIXL:
        return _placeholder(transfer_backend, class_type)
    raise ValueError("Unsupported transfer backend: %s" % transfer_backend)
