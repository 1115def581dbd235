"""Data for supervised fine-tuning: chat files in OpenAI's fine-tuning format, and the winners of scored groups.

``read_chat_file`` checks a whole JSONL file before any work and returns trajectories; ``select_for_sft`` keeps
the best rollouts of each group (rejection-sampling fine-tuning); ``write_chat_file`` writes trajectories
(demonstrations, say) in the format ``read_chat_file`` reads. Both give plain :class:`Trajectory` objects,
the currency every step takes.
"""

from .chat_export import write_chat_file
from .chat_file import MAX_PROBLEMS, ChatFileError, read_chat_file
from .selection import select_for_sft

__all__ = ["MAX_PROBLEMS", "ChatFileError", "read_chat_file", "select_for_sft", "write_chat_file"]
