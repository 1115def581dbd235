"""The agent's side of the two-machine set-up, run by test_remote_client.py in a virtualenv without torch.

    python remote_client.py first  URL BASE_MODEL GROUPS_FILE   rollouts, step 1, then step 2 (killed during it)
    python remote_client.py resume URL BASE_MODEL GROUPS_FILE   a new process: register, send step 2 again

Prints one ``RESULT {json}`` line per finished step and ``ACCEPTED <state>`` when the server takes a train
call (the test kills the first run on the second of these).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import random
import sys

from art_core import RemoteBackend, TrainableModel, TrainConfig, read_groups_jsonl, write_groups_jsonl
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner

from remote_agents import REACT_QUESTION, SDK_QUESTION, calculator, react_graph

CONFIG = TrainConfig(learning_rate=1e-3)


class _Accepted(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("train call %s: %s"):
            print(f"ACCEPTED {record.args[1]}", flush=True)  # type: ignore[index]


def reward(trajectory, state) -> float:  # noqa: ANN001
    # Varied on purpose: GRPO learns nothing from a group of equal rewards (and writes no checkpoint).
    return random.random()


async def gather(model: TrainableModel) -> list:
    graph = trainable(react_graph(), model)
    runner = TrainableRunner(model)
    lg = await graph.group({"messages": [("user", REACT_QUESTION)]}, n=4, reward=reward)
    sdk = await runner.group(calculator(), SDK_QUESTION, n=4, reward=reward)
    for name, group in (("langgraph", lg), ("openai-agents", sdk)):
        assert len(group) == 4 and not group.exceptions, (name, group.exceptions)
        calls = [len(t.calls) + sum(len(h.calls) for h in t.additional_histories) for t in group]
        print(f"GROUP {name} {json.dumps({'calls': calls, 'tools': [t.tools[0]['function']['name'] for t in group]})}",
              flush=True)
    return [lg, sdk]


async def main(phase: str, url: str, base_model: str, groups_file: str) -> None:
    assert importlib.util.find_spec("torch") is None, "the client venv must not have torch"
    logging.getLogger("art_core.backends.remote").addHandler(_Accepted())
    logging.getLogger("art_core.backends.remote").setLevel(logging.INFO)
    model = TrainableModel(name="agent", project="remote", base_model=base_model)
    async with RemoteBackend(url, token=os.environ["ART_SERVER_TOKEN"], show_progress=False) as backend:
        await model.register(backend)
        print(f"REGISTERED {model.step}", flush=True)
        if phase == "first":
            metrics = await model.train(await gather(model), config=CONFIG)
            print(f"RESULT {json.dumps({'step': model.step, 'trained': metrics['trained']})}", flush=True)
            groups = await gather(model)
            # Step 2 learns from many copies of the groups, so that it runs long enough to be killed during it.
            groups = [g.model_copy(update={"trajectories": [t.model_copy(update={"id": f"{t.id}-{k}"})
                                                            for t in g.trajectories for k in range(12)]})
                      for g in groups]
            write_groups_jsonl(groups_file, groups)  # what this agent would keep to resume after a crash
        else:
            groups = read_groups_jsonl(groups_file)
        metrics = await model.train(groups, config=CONFIG)
        print(f"RESULT {json.dumps({'step': model.step, 'trained': metrics['trained']})}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
