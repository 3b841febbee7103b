"""Stand-in for LMDeploy's Mooncake backend: registered under "Mooncake" when
the package is imported; building a link needs Mooncake's TransferEngine,
which is not installed (as on a machine without Mooncake)."""
from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS
from lmdeploy.pytorch.disagg.config import MigrationBackend


@MIGRATION_BACKENDS.register_module(MigrationBackend.Mooncake.name)
class MooncakeBackend:
    def __init__(self):
        self.links = {}

    def p2p_initialize(self, init_request):
        raise ImportError("Please install mooncake to run LMDeploy with MooncakeBackend.")
