"""LocalBackend end to end: the official client talks to the gateway, its records train the model.

Rollouts -> gateway records -> Trajectory.calls -> GRPO step -> the engine serves the new step, with
requests sent during the step waiting rather than failing.
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup


async def test_rollouts_through_the_gateway_train_token_exactly(tiny_model_dir, tmp_path):
    model = TrainableModel(name="served", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        messages = [{"role": "system", "content": "You are terse. " * 10}, {"role": "user", "content": "Name a color."}]

        async def rollout(i: int) -> Trajectory:
            rollout_id = f"r{i}"
            client = AsyncOpenAI(base_url=model.rollout_base_url(rollout_id), api_key="local")
            reply = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=8,
                                                         temperature=1.0, seed=i)
            text = reply.choices[0].message.content or ""
            return Trajectory(messages=[*messages, {"role": "assistant", "content": text}],
                              calls=model.rollout_calls(rollout_id), reward=float(i % 2))

        trajectories = await asyncio.gather(*(rollout(i) for i in range(6)))
        assert all(len(t.calls) == 1 and t.calls[0].adapter_step == 0 for t in trajectories)
        assert {t.calls[0].rollout_id for t in trajectories} == {f"r{i}" for i in range(6)}

        train = asyncio.create_task(model.train([TrajectoryGroup(trajectories)], config=TrainConfig(learning_rate=1e-2)))
        while model.rollout_status("during").gateway != "paused":  # the step has paused the gateway
            assert not train.done(), train
            await asyncio.sleep(0.01)
        client = AsyncOpenAI(base_url=model.rollout_base_url("during"), api_key="local")
        during = asyncio.create_task(client.chat.completions.create(model=model.name, messages=messages, max_tokens=4))
        metrics = await train
        await during
        assert model.step == 1
        assert metrics["samples_rerendered"] == 0  # every sample came from the gateway's token records
        # The trainer re-scored the sampled tokens; they match the sampler's logprobs.
        print(f"max |sampler - trainer| logprob diff (mean over tokens): {metrics['sampler_logprob_abs_diff']:.2e}")
        assert metrics["sampler_logprob_abs_diff"] < 1e-4
        (record,) = model.rollout_calls("during")
        assert record.adapter_step == 1  # it waited for the step and ran on the new adapter
        models = await client.models.list()
        assert {m.id for m in models.data} >= {model.name, f"{model.name}@1"}
