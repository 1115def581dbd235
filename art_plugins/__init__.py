"""art-plugins: train the LLM inside an existing agent with GRPO, without changing the agent's code.

Adapters: ``art_plugins.langgraph`` (``trainable(graph, model)``) and ``art_plugins.openai_agents``
(``TrainableRunner(model)``). Each is imported on its own, so neither framework is needed for the other.
``art_plugins.langfuse`` (``langfuse=True`` on either adapter) sends rollouts, rewards and steps to Langfuse.
``Teacher`` answers an agent's calls in demonstration mode (``demonstrations(teacher)`` on either adapter; see
``art_plugins.demonstrations``). This package also re-exports the pieces of ``art_core`` a training loop needs.
"""

from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

from .demonstrations import Teacher, TeacherError

__all__ = ["LocalBackend", "Teacher", "TeacherError", "TrainConfig", "TrainableModel", "Trajectory", "TrajectoryGroup"]
