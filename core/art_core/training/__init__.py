"""GRPO training of LoRA adapters: advantages, losses and the trainer that composes them.

Modules are imported by path (``art_core.training.losses``) rather than re-exported here, so that
``art_core.training.advantages``, which is pure Python, can be used without torch installed.
"""

__all__: list[str] = []
