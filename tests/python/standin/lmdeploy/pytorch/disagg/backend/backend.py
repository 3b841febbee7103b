"""Stand-in: LMDeploy's registry of migration backends."""
from mmengine.registry import Registry

MIGRATION_BACKENDS = Registry("migration_backend",
                              locations=["lmdeploy.pytorch.disagg.backend.backend"])
