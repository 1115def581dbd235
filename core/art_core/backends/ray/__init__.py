"""Art-core on a Ray cluster (``pip install 'art-core[distributed]'``): ``RayBackend`` and its parts.

Importing this package does not import Ray; ``RayBackend`` does when it starts or joins a cluster.
"""

from .backend import RayBackend

__all__ = ["RayBackend"]
