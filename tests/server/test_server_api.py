"""`art-core serve` as its own process: the token on every route, bad payloads, RemoteBackend's contract.

The client here is this test process (with torch installed); tests/server/test_remote_client.py runs the
client side in a virtualenv without torch.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import httpx
import openai
import pytest
from server_process import TOKEN, Server, running_server

from art_core import (
    Backend,
    CallRecord,
    CheckpointError,
    ConfigError,
    LifecycleError,
    RemoteBackend,
    ServerUnavailableError,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryError,
    TrajectoryGroup,
)
from art_core.training.advantages import ZeroVarianceGroupsWarning
from art_core.wire import API_PREFIX, RolloutStatus

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _group(offset: int = 0) -> TrajectoryGroup:
    prompt = list(range(100, 120))
    return TrajectoryGroup(
        Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[200 + i + offset, 2])],
                   reward=float(i)) for i in range(4))


@pytest.fixture(scope="module")
def registered(server: Server, tiny_model_dir) -> TrainableModel:
    """A model registered on the module's server (through RemoteBackend), for the route tests."""
    model = TrainableModel(name="tiny", project="api", base_model=tiny_model_dir)

    async def register() -> None:
        async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
            await model.register(backend)

    asyncio.run(register())
    return model


def _routes(model: TrainableModel) -> list[tuple[str, str]]:
    """Every route the server has: the training API's and the gateway's (under the model's prefix)."""
    m = f"{API_PREFIX}/models/{model.project}/{model.name}"
    g = f"/gateway/{model.project}/{model.name}"
    return [
        ("GET", f"{API_PREFIX}/health"), ("POST", f"{API_PREFIX}/models"), ("POST", f"{m}/train"),
        ("GET", f"{m}/train/some-id"), ("POST", f"{m}/sample"), ("GET", f"{m}/checkpoints"),
        ("POST", f"{m}/checkpoints/delete"), ("GET", f"{m}/history"),
        ("POST", f"{g}/v1/chat/completions"), ("POST", f"{g}/v1/responses"), ("GET", f"{g}/v1/models"),
        ("GET", f"{g}/v1/models/tiny"), ("POST", f"{g}/rollouts/r1/v1/chat/completions"),
        ("POST", f"{g}/rollouts/r1/v1/responses"), ("GET", f"{g}/rollouts/r1/v1/models"),
        ("GET", f"{g}/rollouts/r1/records"), ("GET", f"{g}/metrics"), ("GET", f"{g}/health"),
        ("GET", "/no/such/route"),
    ]


async def test_every_route_wants_the_token(server: Server, registered: TrainableModel):
    routes = _routes(registered)
    async with httpx.AsyncClient(base_url=server.url) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abcdef"},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}):
            for method, path in routes:
                response = await client.request(method, path, headers=headers, json={"model": "tiny"})
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                assert "token" in response.json()["error"]["message"]
        # With the token every route is reached (whatever it then says of this body).
        for method, path in routes:
            response = await client.request(method, path, headers=AUTH, json={"model": "tiny"})
            assert response.status_code != 401, (method, path)


async def test_bad_payloads_get_4xx_naming_the_field(server: Server, registered: TrainableModel):
    train = f"{API_PREFIX}/models/{registered.project}/{registered.name}/train"
    good = {"train_id": "bad-payloads", "groups": [json.loads(_group().model_dump_json())], "config": {}}
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as client:
        cases = [
            (b"{not json", 400, None),
            (json.dumps({**good, "groups": "many"}).encode(), 400, "groups"),
            (json.dumps({**good, "config": {"learning_rate": "fast"}}).encode(), 400, "config.learning_rate"),
            (json.dumps({**good, "config": {"lr": 1}}).encode(), 400, "config.lr"),
            (json.dumps({**good, "config": {"kind": "sft", "epochs": 0}}).encode(), 400, "config.epochs"),
            (json.dumps({**good, "config": {"kind": "sft", "loss": "dapo"}}).encode(), 400, "config.loss"),
            (json.dumps({**good, "config": {"kind": "dpo"}}).encode(), 400, "config"),
            (json.dumps({**good, "train_id": "../../etc"}).encode(), 400, "train_id"),
            (json.dumps({**good, "groups": [{"trajectories": [{"reward": "high"}]}]}).encode(), 400,
             "groups.0.trajectories.0.reward"),
            (json.dumps({**good, "extra": 1}).encode(), 400, "extra"),
        ]
        for body, status, field in cases:
            response = await client.post(train, content=body)
            assert response.status_code == status, (body[:80], response.text)
            error = response.json()["error"]
            assert error["type"] == "ConfigError"
            if field:
                assert error["param"] == field and field in error["message"], error
        # Too large, declared or counted, plain or as a gzip bomb: 413 before any parsing.
        big = b"x" * (300 * 1024 * 1024)
        response = await client.post(train, content=gzip.compress(big, compresslevel=1),
                                     headers={"Content-Encoding": "gzip"})
        assert response.status_code == 413 and "once inflated" in response.json()["error"]["message"]
        response = await client.post(train, content=b"garbage", headers={"Content-Encoding": "gzip"})
        assert response.status_code == 400 and "inflate" in response.json()["error"]["message"]
        response = await client.post(train, content=b"{}", headers={"Content-Encoding": "br"})
        assert response.status_code == 415
        # Register with a wrongly typed spec.
        response = await client.post(f"{API_PREFIX}/models", json={"name": 3, "project": "p", "base_model": "x",
                                                                   "lora": {}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "name"
        # Names that would put the model's folder outside --path: refused as TrainableModel refuses them.
        for name, project in (("..", "p"), ("../../escaped", "p"), ("ok", "/abs/dir"), ("ok", "a/b")):
            response = await client.post(f"{API_PREFIX}/models", json={"name": name, "project": project,
                                                                       "base_model": "x", "lora": {}})
            assert response.status_code == 400 and "is not allowed" in response.json()["error"]["message"], name
        assert not (server.path.parent / "escaped").exists() and not Path("/abs").exists()
        # The gateway's own checks still answer, under the server.
        response = await client.post(f"/gateway/{registered.project}/{registered.name}/v1/chat/completions",
                                     json={"model": "tiny", "messages": "hi"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        # A sample call with a message no chat has: refused before the engine runs, not a 500.
        response = await client.post(f"{API_PREFIX}/models/{registered.project}/{registered.name}/sample",
                                     json={"messages": [{"role": "usr", "content": "hi"}], "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "ConfigError" and "message 0 is not a chat message (role:" in error["message"]
        # The server keeps serving.
        response = await client.get(f"{API_PREFIX}/health")
        assert response.status_code == 200 and response.json()["models"][0]["name"] == "tiny"
    assert server.process.poll() is None


async def test_oversized_body_is_413(tmp_path, tiny_model_dir):
    with running_server(tmp_path, args=("--max-body-mb", "1")) as small:
        async with httpx.AsyncClient(base_url=small.url, headers=AUTH) as client:
            response = await client.post(f"{API_PREFIX}/models", content=b"x" * (2 * 1024 * 1024))
            assert response.status_code == 413 and "--max-body-mb" in response.json()["error"]["message"]
            assert (await client.get(f"{API_PREFIX}/health")).status_code == 200


async def test_remote_backend_contract(server: Server, tiny_model_dir):
    model = TrainableModel(name="contract", project="api", base_model=tiny_model_dir)
    async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
        assert isinstance(backend, Backend)
        assert await backend.register(model.spec) == 0
        model._backend, model._step = backend, 0  # noqa: SLF001  (attach without a second register)
        assert model.base_url == f"{server.url}/gateway/api/contract/v1" and model.api_key == TOKEN
        assert model.model_dir == server.path / "api" / "models" / "contract"
        # The gateway, through the official client, on the server's one port.
        client = openai.AsyncOpenAI(base_url=model.rollout_base_url("r-1"), api_key=model.api_key)
        reply = await client.chat.completions.create(model="contract", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, logprobs=True)
        assert reply.choices[0].message is not None
        records = model.rollout_records("r-1")
        assert len(records) == 1 and records[0].request_id == reply.id and records[0].rollout_id == "r-1"
        assert model.rollout_status("r-1") == RolloutStatus(unanswered=0, gateway="serving")  # nothing in flight
        # Sampling, training, checkpoints, history.
        (sampled,) = await model.sample([{"role": "user", "content": "hi"}], max_tokens=3, seed=1)
        assert len(sampled.calls) == 1 and sampled.calls[0].logprobs is not None
        config = TrainConfig(learning_rate=1e-2)
        groups = [_group(k) for k in range(3)]
        for k in range(3):
            metrics = await model.train([groups[k]], config=config)
            assert metrics["trained"] and model.step == k + 1
        assert await model.checkpoints() == [1, 2, 3]
        assert [row["step"] for row in await model.history()] == [1, 2, 3]
        assert (model.model_dir / "trajectories" / "0003.jsonl").is_file()
        # The same groups again: answered from the first call, not trained twice.
        again = await model.train([groups[2]], config=config)
        assert again == metrics and model.step == 3 and len(await model.history()) == 3
        # On the wire: server-sent events, accepted -> progress per micro-batch -> result.
        url = f"{server.url}{API_PREFIX}/models/api/contract/train"
        body = {"train_id": "sse-1", "groups": [json.loads(_group(9).model_dump_json())], "config": {}}
        async with httpx.AsyncClient(headers=AUTH) as http, http.stream("POST", url, json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            kinds = [line[7:] async for line in response.aiter_lines() if line.startswith("event: ")]
        assert kinds[0] == "accepted" and kinds[-1] == "result" and set(kinds[1:-1]) == {"progress"}, kinds
        # Errors arrive as the server's classes with its messages.
        with pytest.raises(CheckpointError, match="0004 is the one being served"):
            await model.delete_checkpoints([1, 4])
        assert await model.delete_checkpoints([1, 2]) == [1, 2]
        with pytest.raises(TrajectoryError, match="has no assistant turn and no recorded call: nothing to train on"):
            bad = TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": "x"}], reward=1.0),
                                   Trajectory(messages=[{"role": "user", "content": "x"}], reward=0.0)])
            await model.train([bad])
        with pytest.raises(LifecycleError, match="already registered with this backend"):
            await backend.register(model.spec)
    # A second client (a restarted agent process) attaches to the model as served.
    again_model = TrainableModel(name="contract", project="api", base_model=tiny_model_dir)
    async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
        await again_model.register(backend)
        assert again_model.step == 4
    async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
        with pytest.raises(LifecycleError, match="already registered on this server with another spec"):
            await backend.register(TrainableModel(name="contract", project="api", base_model="/elsewhere").spec)


async def test_a_remote_step_that_drops_groups_warns_at_the_callers_line(server: Server, tiny_model_dir):
    model = TrainableModel(name="warned", project="api", base_model=tiny_model_dir)
    async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
        await model.register(backend)
        flat = TrajectoryGroup(t.model_copy(update={"reward": 1.0}) for t in _group(20))
        with pytest.warns(ZeroVarianceGroupsWarning, match=r"1 of 2 group\(s\) had equal rewards .*\[1\]") as caught:
            metrics = await model.train([_group(21), flat], config=TrainConfig(learning_rate=1e-2))
        assert metrics["groups_dropped"] == 1 and model.step == 1
        assert {w.filename for w in caught} == {__file__}  # this line, as with a LocalBackend, not the server's


async def test_wrong_token_and_unreachable_server(server: Server, tiny_model_dir):
    model = TrainableModel(name="nope", base_model=tiny_model_dir)
    with pytest.raises(ConfigError, match="refused the token"):
        await model.register(RemoteBackend(server.url, token="wrong-token-0123456789"))
    with pytest.raises(ServerUnavailableError, match=r"http://127\.0\.0\.1:9 cannot be reached"):
        await TrainableModel(name="nope").register(RemoteBackend("http://127.0.0.1:9", token=TOKEN))
    with pytest.raises(ConfigError, match="not an http"):
        RemoteBackend("gpu-box:7999")
    with pytest.raises(ConfigError, match=r"ends with /v1: give the server's own address .* \(http://127\.0\.0\.1:7999\)"):
        RemoteBackend("http://127.0.0.1:7999/v1/")


async def test_a_server_that_does_not_answer_in_time_is_not_called_unreachable():
    release = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # takes the connection, never answers
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(ServerUnavailableError, match=r"did not answer .*within timeout=0\.2 s \(ReadTimeout\).*"
                                                          r"RemoteBackend\(url, timeout=\.\.\.\)"):
            await TrainableModel(name="slow").register(RemoteBackend(url, token=TOKEN, timeout=0.2))
    finally:
        release.set()
        listener.close()
        await listener.wait_closed()


def test_refuses_an_exposed_host_without_a_token(tmp_path):
    import subprocess
    import sys

    from server_process import REPO, source_env

    env = source_env()
    env.pop("ART_SERVER_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "art_core.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                          "--path", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 2 and "not a loopback address" in out.stderr and "--token" in out.stderr
    out = subprocess.run([sys.executable, "-m", "art_core.cli", "serve", "--port", "0", "--inference", "sglang",
                          "--path", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 2 and "--inference 'sglang' is not one of transformers, vllm" in out.stderr


async def test_train_call_survives_a_server_restart(tmp_path, tiny_model_dir):
    """The server dies during a step and comes back on the same port: the client re-registers, sends the call
    again, and gets the step's result; the first attempt's trajectories stay on disk beside the second's."""
    model = TrainableModel(name="restart", base_model=tiny_model_dir)
    started = tmp_path / "default" / "models" / "restart" / "trajectories" / "0001.jsonl"
    with running_server(tmp_path) as first:
        backend = RemoteBackend(first.url, token=TOKEN, show_progress=False, reconnect_for=120)
        await model.register(backend)
        big = [TrajectoryGroup(Trajectory(
            calls=[CallRecord(prompt_token_ids=list(range(100 + g, 400 + g)), completion_token_ids=[500 + i, 2])],
            reward=float(i)) for i in range(32)) for g in range(4)]
        training = asyncio.create_task(model.train(big, config=TrainConfig(micro_batch_tokens=64)))
        while not started.exists():  # the server persisted the groups: the step is under way
            assert not training.done(), training
            await asyncio.sleep(0.01)
        first.process.kill()  # no graceful shutdown: as a crash
        first.process.wait()
    port = first.url.rsplit(":", 1)[1]
    with running_server(tmp_path, args=("--port", port)) as second:
        assert second.url == first.url
        metrics = await asyncio.wait_for(training, 120)
        assert metrics["trained"] and model.step == 1
        assert [row["step"] for row in await model.history()] == [1]
        assert sorted(p.name for p in started.parent.iterdir()) == ["0001-2.jsonl", "0001.jsonl"]
        await backend.aclose()


async def test_a_server_restarted_between_steps_is_used_again_without_registering_anew(tmp_path, tiny_model_dir):
    """The server restarts while the client is idle: its next call (a sample, a rollout's records, a step) finds
    the model unknown there, registers it again (it resumes from its checkpoint) and goes on."""
    model = TrainableModel(name="between", base_model=tiny_model_dir)
    messages = [{"role": "user", "content": "Hi"}]
    with running_server(tmp_path) as first:
        backend = RemoteBackend(first.url, token=TOKEN, show_progress=False)
        await model.register(backend)
        group = TrajectoryGroup(await model.sample(messages, n=2, max_tokens=3))
        for reward, trajectory in enumerate(group):
            trajectory.reward = float(reward)
        await model.train([group])
        first.process.kill()  # as a crash, between two steps
        first.process.wait()
    port = first.url.rsplit(":", 1)[1]
    with running_server(tmp_path, args=("--port", port)):
        assert await model.fetch_rollout_records("never-used") == []  # the gateway route: registered again
        group = TrajectoryGroup(await model.sample(messages, n=2, max_tokens=3))
        assert {t.calls[0].adapter_step for t in group} == {1}  # resumed from step 1's checkpoint
        for reward, trajectory in enumerate(group):
            trajectory.reward = float(reward)
        await model.train([group])
        assert model.step == 2 and [row["step"] for row in await model.history()] == [1, 2]
        await backend.aclose()


async def test_a_call_resent_after_a_crash_between_checkpoint_and_record_is_not_trained_again(tmp_path, tiny_model_dir):
    """The server wrote step 1's checkpoint and was killed before it recorded the call's result (its
    ``train_calls`` file) and the history row: the same call sent again is answered from the checkpoint, which
    names the call, and step 1 is not trained a second time. Also: a write the kill cut (``.tmp-``) is removed."""
    model = TrainableModel(name="once", base_model=tiny_model_dir)
    model_dir = tmp_path / "default" / "models" / "once"
    with running_server(tmp_path) as first:
        backend = RemoteBackend(first.url, token=TOKEN, show_progress=False)
        await model.register(backend)
        group = _group(7)
        metrics = await model.train([group])
        first.process.kill()
        first.process.wait()
    # The crash window, made by hand: the result's record and the history row never written, a write cut short.
    assert [p.unlink() for p in (model_dir / "train_calls").iterdir()]
    (model_dir / "history.jsonl").unlink()
    (model_dir / "checkpoints" / ".tmp-0002-deadbeef").mkdir()
    port = first.url.rsplit(":", 1)[1]
    with running_server(tmp_path, args=("--port", port)):
        again = TrainableModel(name="once", base_model=tiny_model_dir)
        async with RemoteBackend(first.url, token=TOKEN, show_progress=False) as backend:
            await again.register(backend)
            assert again.step == 1
            resent = await again.train([group])  # the same groups and config: the same call id
            assert again.step == 1 and resent["loss"] == metrics["loss"]
            assert [row["step"] for row in await again.history()] == [1]  # the lost row, restored
        assert sorted(p.name for p in (model_dir / "trajectories").iterdir()) == ["0001.jsonl"]
        assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["0001"]
