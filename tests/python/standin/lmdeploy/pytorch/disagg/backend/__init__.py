"""Stand-in: as LMDeploy's, importing the package registers its backends."""
from .mooncake import MooncakeBackend

__all__ = ["MooncakeBackend"]
