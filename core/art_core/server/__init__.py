"""``art-core serve``: the training API and every model's gateway in one process (``RemoteBackend`` is its client).

``wire`` (the bodies, events and errors both ends share) imports with pydantic only; the server itself needs
``art-core[serve]`` and the training extras.
"""

from __future__ import annotations

__all__: list[str] = []
