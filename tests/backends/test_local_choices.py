"""``LocalBackend``'s choices and settings: engine and trainer names, gateway settings, one way into the model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch
from openai import AsyncOpenAI

from art_core import (
    CallRecord,
    ConfigError,
    LocalBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryError,
    TrajectoryGroup,
    TransformersOptions,
    VLLMOptions,
)
from art_core.engines._packed import packing_available


def test_unknown_names_are_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown inference engine 'sglang': choose one of \['transformers', 'vllm'\]"):
        LocalBackend(path=tmp_path, inference="sglang")
    with pytest.raises(ConfigError, match=r"unknown trainer 'trl': choose one of \['peft', 'unsloth'\]"):
        LocalBackend(path=tmp_path, trainer="trl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no NVIDIA GPU is visible")
def test_unsloth_without_a_gpu_names_the_peft_trainer(tmp_path):
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU.*trainer='peft'"):
        LocalBackend(path=tmp_path, trainer="unsloth")


def test_vllm_without_its_venv_says_how_to_build_it(tmp_path):
    with pytest.raises(ConfigError, match="no vLLM python at .*setup_vllm_cpu.sh"):
        LocalBackend(path=tmp_path, inference="vllm", vllm=VLLMOptions(python=str(tmp_path / "no-venv")))
    with pytest.raises(ConfigError, match="set ART_VLLM_VENV to that venv"):
        LocalBackend(path=tmp_path, inference="vllm", vllm=VLLMOptions(python=str(tmp_path / "no-venv")))
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VLLMOptions(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="extra"):
        VLLMOptions(gpu_util=0.5)  # type: ignore[call-arg]


def test_a_vllm_venv_given_with_a_tilde_is_found(tmp_path, monkeypatch):
    """The README writes ``VLLMOptions(python="~/.cache/art-core/venv-vllm")``; ``~`` is the user's home."""
    from art_core.engines.vllm import find_vllm_python

    monkeypatch.setenv("HOME", str(tmp_path))
    python = tmp_path / ".cache" / "venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert find_vllm_python("~/.cache/venv-vllm") == python


def test_gateway_settings_are_checked_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="not a loopback address.*api_key"):
        LocalBackend(path=tmp_path, host="0.0.0.0")
    with pytest.raises(ConfigError, match="default_max_tokens"):
        LocalBackend(path=tmp_path, default_max_tokens=0)


async def test_sample_refuses_a_count_below_one_before_sending():
    model = TrainableModel(name="unsent")  # never registered: the check comes before the backend is asked
    for bad, name in (({"n": 0}, "n=0"), ({"max_tokens": 0}, "max_tokens=0"), ({"n": 2.0}, "n=2.0")):
        with pytest.raises(ConfigError, match=rf"sample\({name}\): give an int >= 1"):
            await model.sample([{"role": "user", "content": "hi"}], **bad)


@pytest.mark.parametrize(("message", "problem"), [
    ({"role": "usr", "content": "hi"}, r"\(role: Input should be 'system'"),
    ({"content": "hi"}, r"\(role: Field required"),
    ("hi", r"\(message: Input should be a valid dictionary"),
])
async def test_sample_refuses_a_message_that_is_not_a_chat_message_before_sending(message, problem):
    model = TrainableModel(name="unsent")  # never registered: the check comes before the backend is asked
    system = {"role": "system", "content": "Be brief."}
    with pytest.raises(ConfigError, match=r"sample\(\): message 1 is not a chat message " + problem +
                       r".*with role one of system, developer, user, assistant, tool"):
        await model.sample(iter([system, message]), max_tokens=2)


async def test_gateway_settings_pass_through(tiny_model_dir, tmp_path):
    model = TrainableModel(name="passed", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, api_key="secret", default_max_tokens=5, max_tokens_limit=40,
                            show_progress=False) as backend:
        await model.register(backend)
        assert model.api_key == "secret"
        question = [{"role": "user", "content": "Tell me a long story."}]
        client = AsyncOpenAI(base_url=model.base_url, api_key="secret", max_retries=0)
        reply = await client.chat.completions.create(model=model.name, messages=question, temperature=1.0)
        assert reply.usage is not None and reply.usage.completion_tokens <= 5  # the script set no max_tokens
        with pytest.raises(openai.BadRequestError, match="40"):
            await client.chat.completions.create(model=model.name, messages=question, max_tokens=41)
        with pytest.raises(openai.AuthenticationError):
            await AsyncOpenAI(base_url=model.base_url, api_key="wrong", max_retries=0).chat.completions.create(
                model=model.name, messages=question)


def _group(prompt_length: int = 20) -> TrajectoryGroup:
    prompt = list(range(100, 100 + prompt_length))
    return TrajectoryGroup(
        Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[200 + i, 2])], reward=float(i))
        for i in range(4))


async def test_sample_waits_for_a_step_and_shares_the_engine_queue(tiny_model_dir, tmp_path):
    model = TrainableModel(name="queue", base_model=tiny_model_dir)
    question = [{"role": "user", "content": "Name a color."}]
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        client = AsyncOpenAI(base_url=model.rollout_base_url("beside"), api_key="local")
        # Samples and gateway requests together: one decode loop serves both (no second way into the module).
        before = await asyncio.gather(*(model.sample(question, n=2, max_tokens=6, seed=i) for i in range(3)),
                                      *(client.chat.completions.create(model=model.name, messages=question,
                                                                       max_tokens=6) for _ in range(3)))
        assert all(c.adapter_step == 0 for trajectories in before[:3] for t in trajectories for c in t.calls)
        train = asyncio.create_task(model.train([_group()], config=TrainConfig(learning_rate=1e-2)))
        while model.rollout_status("beside").gateway != "paused":  # the step has paused the gateway and engine
            assert not train.done(), train
            await asyncio.sleep(0.01)
        during = await model.sample(question, n=2, max_tokens=6)
        await train
        assert model.step == 1 and all(t.calls[0].adapter_step == 1 for t in during)  # it waited for the step
        # /health reports the engine as of its last background check (at most about a second old): wait for one
        # taken after the sample was answered.
        while (health := await _health(model))["engine"]["queued"]:
            await asyncio.sleep(0.05)
        assert health["state"] == "serving"


async def _health(model: TrainableModel) -> dict:
    import httpx

    async with httpx.AsyncClient(trust_env=False) as http:
        return (await http.get(model.base_url.removesuffix("/v1") + "/health")).json()


async def test_a_failed_step_leaves_the_gateway_serving(tiny_model_dir, tmp_path):
    model = TrainableModel(name="failing", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        with pytest.raises(TrajectoryError, match="over max_sequence_length=16"):
            await model.train([_group(prompt_length=40)], config=TrainConfig(max_sequence_length=16))
        assert model.step == 0
        client = AsyncOpenAI(base_url=model.base_url, api_key="local", max_retries=0)
        reply = await asyncio.wait_for(client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3), 30)
        assert reply.choices[0].finish_reason in ("stop", "length")
        (sampled,) = await model.sample([{"role": "user", "content": "Hi"}], max_tokens=3)
        assert sampled.calls[0].adapter_step == 0


def _readme_backends() -> list[str]:
    """The statements of the README's engine-and-trainer example, one per blank-line-separated block."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Engine and trainer"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```\n", start)].split("\n\n")


def test_readme_backends_construct_or_refuse_clearly(vllm_venv_or_none, tmp_path):
    imports, vllm_cpu, unsloth, gateway = _readme_backends()
    namespace: dict = {}
    exec(imports, namespace)
    if vllm_venv_or_none is not None:
        exec(vllm_cpu.replace("~/.cache/art-core/venv-vllm", str(vllm_venv_or_none)), namespace)
        assert namespace["backend"].inference == "vllm"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="trainer='peft'"):
            exec(unsloth, namespace)
    exec(gateway, namespace)
    assert namespace["backend"]._gateway_options["default_max_tokens"] == 256


def test_transformers_options_are_checked_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="prefix_cache_mb"):
        TransformersOptions(prefix_cache_mb=-1)
    with pytest.raises(ConfigError, match="extra"):
        TransformersOptions(packed=True)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="num_threads"):
        TransformersOptions(num_threads=0)
    assert TransformersOptions(num_threads=2).engine_kwargs()["num_threads"] == 2
    with pytest.raises(ConfigError, match="inference='vllm'.*inference='transformers'"):
        LocalBackend(path=tmp_path, inference="vllm", transformers=TransformersOptions(packed_weights=True))
    with pytest.raises(ConfigError, match="TransformersOptions, not dict"):
        LocalBackend(path=tmp_path, transformers={"packed_weights": True})  # type: ignore[arg-type]


def _readme_transformers_options() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("The in-process transformers engine takes its options"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```\n", start)]


@pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN")
async def test_packed_weights_reach_the_engine_that_serves_the_gateway(tiny_model_dir, tmp_path):
    namespace: dict = {}
    exec(_readme_transformers_options(), namespace)  # the README's example builds what this test runs
    assert namespace["backend"].transformers == TransformersOptions(packed_weights=True)
    model = TrainableModel(name="packed", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False,
                            transformers=TransformersOptions(packed_weights=True, prefix_cache_mb=0)) as backend:
        await model.register(backend)
        engine = backend._slots[(model.project, model.name)].engine
        assert engine._packed is not None and engine._packed.packs == 0  # packed on first decode, not at load
        assert engine._prefix.max_bytes == 0
        client = AsyncOpenAI(base_url=model.base_url, api_key="x", max_retries=0)
        reply = await client.chat.completions.create(model=model.name, max_tokens=4, temperature=0,
                                                     messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        linears = [m for name, m in engine.model.named_modules()
                   if type(m) is torch.nn.Linear and ".lora_" not in name]  # LoRA's own matrices stay plain
        assert engine._packed.packs == len(linears) > 0  # the gateway's request ran through packed weights
    plain = TrainableModel(name="plain", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path / "plain", show_progress=False) as backend:  # the default: not packed
        await plain.register(backend)
        assert backend._slots[(plain.project, plain.name)].engine._packed is None
