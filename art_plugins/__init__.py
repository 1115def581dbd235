"""art-plugins: train the LLM inside an existing agent with GRPO, without changing the agent's code.

The framework adapters (``art_plugins.langgraph``, ``art_plugins.openai_agents``) land in later releases;
this package re-exports the pieces of ``art_core`` a user needs to write a training loop.
"""

from art_core import TrainableModel, LocalBackend, TrainConfig, Trajectory, TrajectoryGroup

__all__ = ["LocalBackend", "TrainConfig", "TrainableModel", "Trajectory", "TrajectoryGroup"]
