"""Base models: turn a name or a path into a local Hugging Face-format folder.

    >>> from art_core.models import EMBEDDED_MODEL, resolve_base_model
    >>> folder = resolve_base_model(EMBEDDED_MODEL)  # first call converts the bundled GGUF (~15 s)
    >>> folder = resolve_base_model("/models/Qwen2.5-0.5B-Instruct")  # any folder with config.json

Registered names are built on first use into ``cache_dir()`` (``$ART_CACHE_DIR``, else the user
cache folder); nothing is downloaded. ``art_core.models.templates`` holds the tool-calling chat
template that the embedded model's tokenizer carries. Importing this package does not import torch.
"""

from ._cache import cache_dir
from ._registry import EMBEDDED_MODEL, known_base_models, register_base_model, resolve_base_model

__all__ = [
    "EMBEDDED_MODEL",
    "cache_dir",
    "known_base_models",
    "register_base_model",
    "resolve_base_model",
]
