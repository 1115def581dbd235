"""Data for supervised fine-tuning: chat files in OpenAI's fine-tuning format, and the winners of scored groups.

``read_chat_file`` checks a whole JSONL file before any work and returns trajectories; ``select_for_sft`` keeps
the best rollouts of each group (rejection-sampling fine-tuning). Both give plain :class:`Trajectory` objects,
the currency every step takes.
"""

from .chat_file import MAX_PROBLEMS, ChatFileError, read_chat_file
from .selection import select_for_sft

__all__ = ["MAX_PROBLEMS", "ChatFileError", "read_chat_file", "select_for_sft"]
