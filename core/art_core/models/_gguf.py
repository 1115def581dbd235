"""Turn a GGUF checkpoint into a Hugging Face transformers folder that training can load.

transformers reads GGUF files (``from_pretrained(folder, gguf_file=...)``) and dequantises them to
fp32, but refuses to ``save_pretrained`` such a model ("quantized with gguf ... not serializable").
So the weights are moved into a fresh model built from the same config without the quantisation
entry, and that one is saved as safetensors. Loading the saved folder then takes a fraction of a
second instead of ~12 s, and PEFT can wrap it like any other checkpoint.

torch and transformers are imported inside ``convert_gguf`` only: importing ``art_core.models``
must stay cheap and must work without the ``train`` extra.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import BaseModelNotFoundError
from .templates import ORIGINAL_CHAT_TEMPLATE_FILE

__all__ = ["convert_gguf"]

_NEEDED_MODULES = {"torch": "art-core[train]", "transformers": "art-core[train]", "gguf": "gguf"}


def convert_gguf(gguf_file: Path, out_dir: Path, *, chat_template: str | None = None) -> None:
    """Dequantise ``gguf_file`` into ``out_dir`` as an fp32 safetensors model plus its tokenizer.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer files.
    The GGUF's own chat template is kept in ``original_chat_template.jinja`` when it has one.

    Args:
        gguf_file (Path): the ``.gguf`` checkpoint.
        out_dir (Path): an existing, empty folder to write into.
        chat_template (str | None): the Jinja chat template to install in the tokenizer.
            Default: None, keep the GGUF's own.

    Raises:
        BaseModelNotFoundError: torch, transformers or gguf is not installed (the message names the
            pip command).
    """
    missing = [name for name in _NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        extras = " ".join(sorted({f"'{_NEEDED_MODULES[name]}'" for name in missing}))
        raise BaseModelNotFoundError(
            f"converting {gguf_file.name} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: pip install {extras}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    # Without the quantisation entry the config describes a plain fp32 model, which save_pretrained accepts.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())  # strict: every tensor must find its place
    model.generation_config = gguf_model.generation_config  # keeps eos/bos/pad ids as the GGUF set them
    model.save_pretrained(out_dir)

    original_template = tokenizer.chat_template
    if isinstance(original_template, str):
        (out_dir / ORIGINAL_CHAT_TEMPLATE_FILE).write_text(original_template)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    # The GGUF tokenizer does not carry the context length; without it transformers assumes "infinite".
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
