"""`art-core serve --backend ray`: the server's API and gateways over a RayBackend, a client on RemoteBackend.

The server is a real second process that starts a local Ray cluster (its files under the server's path),
with one engine replica and one trainer rank (this machine has 2 cores, Ray reserves one for each). The
client, in this process, runs two groups of chat rollouts through the server's gateway and trains a step.
"""

from __future__ import annotations

import random
import re
import uuid
from pathlib import Path

import httpx
import pytest
from server_process import TOKEN, running_server

pytest.importorskip("ray", reason="needs art-core[distributed]")

from art_core import RemoteBackend, TrainableModel, TrainConfig, TrajectoryGroup  # noqa: E402
from art_core.wire import API_PREFIX  # noqa: E402


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backend": "k8s"}, "--backend 'k8s' is not one of local, ray"),
    ({"backend": "ray", "inference": "sglang"}, "--inference 'sglang' is not one of transformers, vllm"),
    ({"backend": "ray", "trainer": "unsloth"}, "not available with --backend ray"),
    ({"trainer_workers": 2}, "need --backend ray"),
])
def test_serve_settings_name_what_is_wrong_with_the_ray_options(kwargs: dict, message: str) -> None:
    from art_core import ConfigError
    from art_core.server.run import ServerSettings

    with pytest.raises(ConfigError, match=re.escape(message)):
        ServerSettings(**kwargs)


async def _group(model: TrainableModel, question: str, n: int) -> TrajectoryGroup:
    import openai

    trajectories = []
    for _ in range(n):
        rid = uuid.uuid4().hex
        client = openai.AsyncOpenAI(base_url=model.rollout_base_url(rid), api_key=model.api_key)
        await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": question}],
                                             max_tokens=6, temperature=1.0)
        await client.close()
        trajectories.append(model.rollout_trajectory(rid, reward=random.random()))
    return TrajectoryGroup(trajectories)


async def test_remote_client_trains_a_step_on_a_ray_served_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--backend", "ray", "--replicas", "1", "--trainer-workers", "1")
    with running_server(tmp_path / "server", args=args) as server:
        model = TrainableModel(name="agent", project="scaled", base_model=str(tiny_model_dir))
        async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
            await model.register(backend)
            assert model.step == 0
            groups = [await _group(model, q, 3) for q in ("Name a colour.", "Count to three.")]
            assert all(len(t.calls) == 1 and t.calls[0].completion_token_ids for g in groups for t in g)
            metrics = await model.train(groups, config=TrainConfig(learning_rate=1e-3))
            assert metrics["trained"] == 1.0 and model.step == 1
            assert await model.checkpoints() == [1]
            history = await model.history()
            assert [row["step"] for row in history] == [1] and history[0]["ranks"] == 1.0  # the trainer group's
            # The gateway behind the server now serves step 1 (every replica confirmed it).
            again = await _group(model, "Name a colour.", 1)
            assert again.trajectories[0].calls[0].adapter_step == 1

        headers = {"Authorization": f"Bearer {TOKEN}"}
        health = httpx.get(f"{server.url}{API_PREFIX}/health", headers=headers, timeout=30).json()
        assert [m["name"] for m in health["models"]] == ["agent"]
        assert (server.path / "ray").is_dir(), "the local Ray cluster keeps its files under the server's path"
        model_dir = server.path / "scaled" / "models" / "agent"
        assert (model_dir / "trajectories").is_dir(), f"the step's groups are on the server's disk\n{server.log()}"
