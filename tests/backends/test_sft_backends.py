"""``model.train_sft`` through the ``Backend`` contract, on Local, Remote (``art-core serve`` in a thread) and Ray.

An SFT step is a step: it shares the step counter, the checkpoints and ``history.jsonl`` with GRPO, so a GRPO
step after it is the next step on the adapter it wrote, and its checkpoint is served right after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_step_contract import CHAT, Served, _group, served  # noqa: F401  (served: the parametrised fixture)

from art_core import LocalBackend, SFTConfig, TrainableModel, TrainConfig, Trajectory
from art_core.errors import ConfigError
from art_core.sft import ChatFileError

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CHATS = [
    {"messages": [{"role": "user", "content": "2+3?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "5"},
                  {"role": "assistant", "content": "It is 5."}],
     "tools": [ADD]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]},
    {"messages": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "Goodbye."}]},
]


def _chat_file(folder: Path, lines: list[str] | None = None) -> Path:
    path = folder / "demos.jsonl"
    path.write_text("\n".join(lines if lines is not None else [json.dumps(c) for c in CHATS]) + "\n")
    return path


async def test_sft_then_grpo_share_the_step_counter_and_the_new_checkpoint_is_served(served: Served,
                                                                                     tmp_path: Path) -> None:
    model = served.model
    metrics = await model.train_sft(_chat_file(tmp_path), config=SFTConfig(batch_size=2, learning_rate=1e-2))
    assert metrics["trained"] == 1.0 and model.step == 1
    assert metrics["optimizer_steps"] == 2.0 and metrics["samples_rerendered"] == 3.0  # 3 chats, 2 per step
    (reply,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
    assert reply.calls[0].adapter_step == 1  # served right after the SFT step

    await model.train([_group(0)], config=TrainConfig(learning_rate=1e-2))
    assert model.step == 2
    history = await model.history()
    assert [(row["step"], row["kind"]) for row in history] == [(1, "sft"), (2, "grpo")]
    assert await model.checkpoints() == [1, 2]
    (reply,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
    assert reply.calls[0].adapter_step == 2


async def test_sft_from_trajectories_and_groups(served: Served) -> None:
    """Trajectories with call records are trained token-exact (nothing re-rendered), whatever their rewards."""
    group = _group(1)
    metrics = await served.model.train_sft(group.trajectories, config=SFTConfig(assistant_turns="last"))
    assert metrics["samples"] == 4.0 and metrics["samples_rerendered"] == 0.0 and metrics["trained_tokens"] == 8.0
    metrics = await served.model.train_sft([group, _group(2)], config=SFTConfig(batch_size=4))
    assert metrics["groups"] == 2.0 and metrics["optimizer_steps"] == 2.0
    assert served.model.step == 2


async def test_grpo_after_sft_resumes_from_the_sft_checkpoint_after_a_restart(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        model = TrainableModel(name="warm", base_model=tiny_model_dir)
        await model.register(backend)
        await model.train_sft(_chat_file(tmp_path), config=SFTConfig(learning_rate=1e-2))
    marker = json.loads((model.model_dir / "checkpoints" / "0001" / "checkpoint.json").read_text())
    assert marker["kind"] == "sft" and (model.model_dir / "checkpoints" / "0001" / "optimizer.pt").is_file()

    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        model = TrainableModel(name="warm", base_model=tiny_model_dir)
        await model.register(backend)
        assert model.step == 1  # the SFT checkpoint is the one loaded
        await model.train([_group(0)], config=TrainConfig(learning_rate=1e-2))
        assert model.step == 2
        assert [row["kind"] for row in await model.history()] == ["sft", "grpo"]


async def test_a_bad_chat_file_fails_before_any_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines = [json.dumps(CHATS[1]), '{"messages": [{"role": "user", "content": "no answer"}]}', "not json"]
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        model = TrainableModel(name="bad", base_model=tiny_model_dir)
        await model.register(backend)
        with pytest.raises(ChatFileError, match="line 2: no assistant message") as caught:
            await model.train_sft(_chat_file(tmp_path, lines))
        assert "line 3: not valid JSON" in str(caught.value)
        assert model.step == 0 and await model.history() == []
        assert not (model.model_dir / "trajectories").exists()
        with pytest.raises(Exception, match="takes an SFTConfig"):
            await model.train_sft(_chat_file(tmp_path), config=TrainConfig())  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"train\(\) takes a TrainConfig, not SFTConfig: .*model.train_sft"):
            await model.train([None], config=SFTConfig())  # type: ignore[list-item, arg-type]  # refused first
        assert model.step == 0 and await model.history() == []


async def test_trajectories_without_records_are_checked_as_a_chat_file_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SFT data given as trajectories (hand-written, or demonstrations) gets the chat file's checks, every problem
    at once: a weight of 0.5 was trained as 1, a tool result answering no call was trained on, and a chat whose only
    assistant turn has weight 0 got an error about rollouts and the gateway."""
    def chat(*messages: dict[str, Any]) -> Trajectory:
        return Trajectory(messages=[{"role": "user", "content": "2+2?"}, *messages])

    data = [chat({"role": "assistant", "content": "4", "weight": 0.5}),
            chat({"role": "tool", "tool_call_id": "nope", "content": "4"}, {"role": "assistant", "content": "4"}),
            chat({"role": "assistant", "content": "4", "weight": 0})]
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        model = TrainableModel(name="checked", base_model=tiny_model_dir)
        await model.register(backend)
        with pytest.raises(ConfigError) as caught:
            await model.train_sft(data)
        message = str(caught.value)
        assert "3 problem(s)" in message or "4 problem(s)" in message, message
        assert f"trajectory {data[0].id} (history 0): messages[1] (assistant) has weight 0.5; use 0" in message
        assert f"trajectory {data[1].id} (history 0): messages[1] (tool) answers tool_call_id 'nope'" in message
        assert f"trajectory {data[2].id} (history 0): no assistant message to learn from" in message
        assert model.step == 0 and await model.history() == []
        metrics = await model.train_sft([chat({"role": "assistant", "content": "4"})])  # a good one trains
        assert model.step == 1 and metrics["trained_tokens"] > 0


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
async def test_sft_on_two_ray_ranks_matches_one_process(cluster, tiny_model_dir: Path, tmp_path: Path,
                                                       sharding: str) -> None:
    """Two trainer ranks each train their slice of every batch (batches of 3: slices of 2 and 1, then 1 and
    none, one micro-batch per chat, so FSDP's ranks pad their passes); after the two optimizer steps, the summed
    gradient of the second equals what one process computes on all the data (so the first update agreed too)."""
    import os

    import torch

    from art_core import LoraSettings, Trajectory, TrajectoryGroup
    from art_core.backends.ray import RayBackend
    from art_core.training.trainer import GRPOTrainer, load_policy

    class Recording:  # the single-process reference: no other rank, so sums are the values
        recorded: list = []

        def sum(self, values):
            return values

        def gradients(self, params):
            self.recorded = [p.grad.detach().clone() for p in params]

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # A seeded adapter: the second step's gradient depends on the first AdamW update, which for a gradient entry
    # within rounding of zero flips with the summation order (~lr apart); an unseeded start hit one now and then.
    lora = LoraSettings(rank=4, alpha=8, seed=0)
    model = TrainableModel(name="sft-ranks", base_model=tiny_model_dir, lora=lora)
    data = [Trajectory.model_validate(c) for c in [*CHATS, CHATS[0]]]
    config = SFTConfig(batch_size=3, micro_batch_tokens=16, learning_rate=1e-2)
    async with RayBackend(address=cluster.address, path=tmp_path, trainer_workers=2, num_threads=1,
                          rollout_workers=1, runtime_env={"env_vars": env}, sharding=sharding) as backend:
        await model.register(backend)
        start = tmp_path / "start"
        start.mkdir()
        for name, blob in (await backend.trainer_group(model.spec).adapter()).items():
            (start / name).write_bytes(blob)
        result = await backend.train_step(model.spec, [TrajectoryGroup(data)], config, return_gradients=True)
    assert result["step"] == 1 and result["metrics"]["optimizer_steps"] == 2.0
    policy, tokenizer = load_policy(tiny_model_dir, lora, device="cpu", adapter_dir=start)
    reference = Recording()
    metrics = GRPOTrainer(policy, tokenizer).train_step([TrajectoryGroup(data)], config, sync=reference)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    rank0, rank1 = result["gradients"]
    scale = max(float(g.abs().max()) for g in reference.recorded)
    diff = max(float((torch.tensor(rank0[n]) - g).abs().max()) for n, g in zip(names, reference.recorded))
    assert scale > 0 and diff <= 1e-4 * scale
    assert all((rank0[n] == rank1[n]).all() for n in names)
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4)
    assert result["metrics"]["samples"] == metrics["samples"] == 4.0
