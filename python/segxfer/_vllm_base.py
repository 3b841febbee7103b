"""vLLM's V1 connector base classes, or stand-ins with the same names where
vLLM is not installed.

segxfer.vllm subclasses KVConnectorBase_V1.  Inside vLLM that is vLLM's own
class (vllm/distributed/kv_transfer/kv_connector/v1/base.py); elsewhere (a
machine without vLLM, the package's tests) it is the stand-in below, which
has the methods and the constructor of vLLM's class as read at commit
13f4ad0f55b08ca1d37d1459f50ce950feaeb547, with the same defaults, so the
connector behaves alike under both.  VLLM_METHODS lists those names (the
tests check the stand-in against it).
"""
import enum

try:  # vLLM present: its classes, nothing of ours.
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as _vllm
    HAVE_VLLM = True
except ImportError:
    _vllm = None
    HAVE_VLLM = False

# Every method and property of vLLM's KVConnectorBase_V1 at the cited commit.
VLLM_METHODS = (
    "prefer_cross_layer_blocks", "role", "bind_connector_metadata",
    "clear_connector_metadata", "_get_connector_metadata", "has_connector_metadata",
    "register_kv_caches", "register_cross_layers_kv_cache", "set_host_xfer_buffer_ops",
    "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "shutdown",
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "get_handshake_metadata",
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "take_events",
    "get_required_kvcache_layout", "get_finished_count", "build_kv_connector_stats",
    "set_xfer_handshake_metadata", "build_prom_metrics", "reset_cache")

if HAVE_VLLM:
    KVConnectorBase_V1 = _vllm.KVConnectorBase_V1
    KVConnectorMetadata = _vllm.KVConnectorMetadata
    KVConnectorRole = _vllm.KVConnectorRole
else:
    class KVConnectorRole(enum.Enum):
        """Stand-in: where a connector instance runs."""
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        """Stand-in: what the scheduler-side connector hands the workers."""

    class KVConnectorBase_V1:
        """Stand-in for vLLM's KVConnectorBase_V1 (same constructor, same
        methods and defaults; abstract methods raise NotImplementedError)."""

        @property
        def prefer_cross_layer_blocks(self):
            return False

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        # Worker side.
        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches):
            return

        def register_cross_layers_kv_cache(self, kv_cache, attn_backend):
            return

        def set_host_xfer_buffer_ops(self, copy_operation):
            return

        def handle_preemptions(self, preempted_req_ids):
            return

        def start_load_kv(self, forward_context, **kwargs):
            raise NotImplementedError

        def wait_for_layer_load(self, layer_name):
            raise NotImplementedError

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise NotImplementedError

        def wait_for_save(self):
            raise NotImplementedError

        def get_finished(self, finished_req_ids):
            return None, None

        def get_block_ids_with_load_errors(self):
            return set()

        def shutdown(self):
            return None

        def get_kv_connector_stats(self):
            return None

        def get_kv_connector_kv_cache_events(self):
            return None

        def get_handshake_metadata(self):
            return None

        # Scheduler side.
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            raise NotImplementedError

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            raise NotImplementedError

        def build_connector_meta(self, scheduler_output):
            raise NotImplementedError

        def update_connector_output(self, connector_output):
            return

        def request_finished(self, request, block_ids):
            return False, None

        def take_events(self):
            return ()

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            if cls is KVConnectorBase_V1:
                raise TypeError("get_required_kvcache_layout should not be called on the "
                                "abstract base class")
            return None

        def get_finished_count(self):
            return None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return None

        def set_xfer_handshake_metadata(self, metadata):
            return None

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                               per_engine_labelvalues):
            return None

        def reset_cache(self):
            return None
