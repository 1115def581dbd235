"""The GRPO step for real: optimiser steps on a tiny model, checkpoints, resume, and bad input."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from art_core import (
    BaseModelNotFoundError,
    CallRecord,
    ConfigError,
    LocalBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryError,
    TrajectoryGroup,
)
from art_core.config import LoraSettings
from art_core.training.trainer import GRPOTrainer, ZeroVarianceGroupsWarning, load_policy

PROMPT = list(range(100, 140))
COMPLETIONS = [[201, 202, 203, 2], [301, 302, 2], [401, 402, 403, 404, 2], [501, 2]]


def _group(rewarded: int = 0) -> TrajectoryGroup:
    return TrajectoryGroup(
        Trajectory(id=f"t{i}", calls=[CallRecord(prompt_token_ids=PROMPT, completion_token_ids=c)],
                   reward=1.0 if i == rewarded else 0.0)
        for i, c in enumerate(COMPLETIONS))


@torch.no_grad()
def _sequence_logprob(model, completion: list[int]) -> float:
    ids = torch.tensor([PROMPT + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return logp[torch.arange(len(targets)), targets][len(PROMPT) - 1:].sum().item()


def test_a_seeded_adapter_starts_the_same_and_leaves_the_global_random_state_alone(tiny_model_dir):
    def lora_a(seed: int) -> list[torch.Tensor]:
        policy, _ = load_policy(tiny_model_dir, LoraSettings(rank=4, alpha=8, seed=seed), device="cpu")
        return [p.detach() for n, p in policy.named_parameters() if "lora_A" in n]

    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = lora_a(0)
    assert torch.equal(torch.rand(3), expected_draw)  # the seed applied inside load_policy only
    assert all(torch.equal(a, b) for a, b in zip(first, lora_a(0), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, lora_a(1), strict=True))


def test_rewarded_completion_becomes_more_likely(tiny_model_dir):
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    before = [_sequence_logprob(model, c) for c in COMPLETIONS]
    for _ in range(5):
        metrics = trainer.train_step([_group(rewarded=0)], TrainConfig(learning_rate=1e-2, loss="grpo"))
        assert metrics["trained"] == 1.0 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = [_sequence_logprob(model, c) for c in COMPLETIONS]
    assert after[0] > before[0] + 0.5, (before, after)
    for i in range(1, 4):  # the unrewarded ones lose probability
        assert after[i] < before[i]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_every_loss_moves_toward_the_reward(tiny_model_dir, loss):
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    before = _sequence_logprob(model, COMPLETIONS[2])
    for _ in range(3):
        trainer.train_step([_group(rewarded=2)], TrainConfig(learning_rate=1e-2, loss=loss))
    assert _sequence_logprob(model, COMPLETIONS[2]) > before


def test_kl_penalty_runs_the_base_model(tiny_model_dir):
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    trainer.train_step([_group()], TrainConfig(learning_rate=1e-2, beta=0.1))  # adapter = base: KL 0
    metrics = trainer.train_step([_group()], TrainConfig(learning_rate=1e-2, beta=0.1))
    assert metrics["kl"] > 0


def test_zero_variance_groups_are_dropped_and_reported(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    flat = TrajectoryGroup(t.model_copy(update={"reward": 0.5}) for t in _group())
    with pytest.warns(ZeroVarianceGroupsWarning, match="1 of 2 group"):
        metrics = trainer.train_step([flat, _group()], TrainConfig())
    assert metrics["groups_dropped"] == 1 and metrics["groups_used"] == 1 and metrics["trained"] == 1
    with pytest.warns(ZeroVarianceGroupsWarning):
        metrics = trainer.train_step([flat], TrainConfig())
    assert metrics["trained"] == 0  # nothing to learn: no update


@torch.no_grad()
def _token_logprobs(model, completion: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return logp[torch.arange(len(targets)), targets][len(PROMPT) - 1:].tolist()


def _sampled_group(model, offset: float, step: int) -> TrajectoryGroup:
    """``_group()`` as an adapter at ``step`` sampled it: the sampler's log-probs are the model's own + ``offset``."""
    return TrajectoryGroup(
        Trajectory(id=f"t{i}", reward=1.0 if i == 0 else 0.0, calls=[CallRecord(
            prompt_token_ids=PROMPT, completion_token_ids=c, adapter_step=step,
            logprobs=[lp + offset for lp in _token_logprobs(model, c)])])
        for i, c in enumerate(COMPLETIONS))


def test_off_policy_samples_take_the_ratio_against_their_sampler(tiny_model_dir):
    """Data an older adapter sampled is weighed by pi / pi_sampler (here exp(0.1) per token, as the sampler's
    log-probs are 0.1 below the module's), and truncated IS has nothing left to correct (weight 1). Without
    ``policy_step`` the same data is on-policy: ratio exactly 1, and TIS weighs each token by exp(0.1)."""
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    config = TrainConfig(learning_rate=1e-9)  # the tiniest update: the second call sees the same module
    off = trainer.train_step([_sampled_group(model, -0.1, step=0)], config, policy_step=1)
    assert off["samples_off_policy"] == 4
    assert off["ratio_mean"] == pytest.approx(math.exp(0.1), abs=1e-4)
    assert off["ratio_min"] == pytest.approx(math.exp(0.1), abs=1e-4)
    assert off["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    on = trainer.train_step([_sampled_group(model, -0.1, step=0)], config)
    assert on["samples_off_policy"] == 0
    assert on["ratio_mean"] == on["ratio_max"] == on["ratio_min"] == 1.0
    assert on["is_weight_mean"] == pytest.approx(math.exp(0.1), abs=1e-4)
    current = trainer.train_step([_sampled_group(model, -0.1, step=1)], config, policy_step=1)
    assert current["samples_off_policy"] == 0 and current["ratio_mean"] == 1.0  # sampled by the current step


def test_another_objective_runs_through_the_same_step(tiny_model_dir):
    """The step's loop is not GRPO's: a supervised objective (NLL of the sampled tokens, every group kept, even
    with equal rewards) plugs in as an ``Objective`` and raises the likelihood of what it trains on."""
    from art_core.training.losses import LossInputs, LossOutput
    from art_core.training.objectives import Objective, Weights

    class NextTokenLoss:
        name, reference = "nll", False

        def weigh(self, groups):
            return Weights(per_group=[[1.0] * len(g) for g in groups], dropped=[])

        def __call__(self, inputs: LossInputs) -> LossOutput:
            nll = -(inputs.logprobs * inputs.mask).sum() / inputs.num_tokens
            return LossOutput(loss=nll, stats={"tokens": inputs.mask.sum()})

    assert isinstance(NextTokenLoss(), Objective)
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    flat = TrajectoryGroup(t.model_copy(update={"reward": 0.5}) for t in _group())  # GRPO would drop it
    before = _sequence_logprob(model, COMPLETIONS[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroVarianceGroupsWarning)
        for _ in range(3):
            metrics = trainer.train_step([flat], TrainConfig(learning_rate=1e-2), objective=NextTokenLoss())
    assert metrics["trained"] == 1.0 and metrics["groups_dropped"] == 0 and metrics["samples"] == 4
    assert metrics["loss"] > 0
    assert _sequence_logprob(model, COMPLETIONS[1]) > before


def test_readme_off_policy_example_runs(tiny_model_dir, capsys):
    """The README's ``train_step`` example, run on the tiny model with groups an adapter at step 0 sampled."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("What phases 1 and 3 compute"):]
    start = section.index("```python\n") + len("```python\n")
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    groups = [_sampled_group(model, -0.1, step=0)]
    exec(section[start:section.index("```\n", start)],
         {"base_dir": tiny_model_dir, "lora": LoraSettings(), "groups": groups})
    off_policy, ratio = capsys.readouterr().out.split()
    assert float(off_policy) == 4 and float(ratio) == pytest.approx(math.exp(0.1), abs=1e-4)


async def test_checkpoint_round_trip_and_resume(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model = TrainableModel(name="rt", base_model=tiny_model_dir)
    backend = LocalBackend(path=tmp_path, show_progress=False)
    await model.register(backend)
    for _ in range(2):
        await model.train([_group()], config=TrainConfig(learning_rate=1e-2))
    assert model.step == 2
    model_dir = tmp_path / "default" / "models" / "rt"
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["0001", "0002"]
    assert sorted(p.name for p in (model_dir / "trajectories").iterdir()) == ["0001.jsonl", "0002.jsonl"]
    history = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [1, 2]
    trained = backend._slot(model).trainer.model
    ids = torch.tensor([PROMPT + COMPLETIONS[0]])
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
    await backend.aclose()

    # A half-written checkpoint (no marker) must be ignored with a warning, not loaded.
    (model_dir / "checkpoints" / "0003").mkdir()
    again = TrainableModel(name="rt", base_model=tiny_model_dir)
    backend = LocalBackend(path=tmp_path, show_progress=False)
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        await again.register(backend)
    assert again.step == 2
    reloaded = backend._slot(again).trainer
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(input_ids=ids).logits, expected, atol=0, rtol=0)
    assert reloaded.optimizer is None and reloaded._pending_optimizer_state is not None  # AdamW state resumes
    await again.train([_group()], config=TrainConfig(learning_rate=1e-2))
    assert again.step == 3 and (model_dir / "checkpoints" / "0003" / "checkpoint.json").is_file()
    await backend.aclose()


async def test_bad_input_is_refused_and_nothing_on_disk_is_lost(tiny_model_dir, tmp_path):
    model = TrainableModel(name="bad", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        await model.train([_group()], config=TrainConfig(learning_rate=1e-2))
        checkpoint = tmp_path / "default" / "models" / "bad" / "checkpoints" / "0001"
        files = {p.name: p.read_bytes() for p in checkpoint.iterdir()}

        with pytest.raises(TrajectoryError, match="group 0 is empty"):
            await model.train([TrajectoryGroup([])])
        no_assistant = TrajectoryGroup([Trajectory(id="lonely", messages=[{"role": "user", "content": "hi"}],
                                                   reward=1.0), *_group()])
        with pytest.raises(TrajectoryError, match="'lonely' has no assistant turn"):
            await model.train([no_assistant])
        assert model.step == 1
        assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == files
        # the refused groups were still written to disk before the step
        assert len(list((checkpoint.parent.parent / "trajectories").iterdir())) == 3


async def test_a_bad_loss_option_is_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    model = TrainableModel(name="opts", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        with pytest.raises(ConfigError, match="'epsilon_hgih'.*accepts"):
            await model.train([_group()], config=TrainConfig(loss_options={"epsilon_hgih": 0.28}))
        assert model.step == 0
        assert not (tmp_path / "default" / "models" / "opts" / "trajectories").exists()
        assert not (tmp_path / "default" / "models" / "opts" / "history.jsonl").exists()
        # the gateway was never paused: it still answers
        assert (await model.sample([{"role": "user", "content": "hi"}], max_tokens=2))[0].calls


def test_nan_reward_and_mismatched_logprobs_name_the_field():
    with pytest.raises(ValueError, match="'t-nan' has reward nan"):
        Trajectory(id="t-nan", reward=float("nan"))
    with pytest.raises(ValueError, match="logprobs has 1 entries but completion_token_ids has 2"):
        CallRecord(prompt_token_ids=[1], completion_token_ids=[2, 3], logprobs=[-0.5])


async def test_missing_base_model_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    model = TrainableModel(name="m", base_model=missing)
    with pytest.raises(BaseModelNotFoundError, match="no-such-model"):
        await model.register(LocalBackend(path=tmp_path))
    assert not (tmp_path / "default").exists()


async def test_lifecycle_errors(tiny_model_dir, tmp_path):
    from art_core import LifecycleError

    model = TrainableModel(name="life", base_model=tiny_model_dir)
    with pytest.raises(LifecycleError, match="not registered"):
        await model.train([_group()])
    backend = LocalBackend(path=tmp_path, show_progress=False)
    await model.register(backend)
    with pytest.raises(LifecycleError, match="already registered"):
        await model.register(backend)
    await backend.aclose()
    with pytest.raises(LifecycleError, match="closed"):
        await model.train([_group()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Exception, match="not allowed"):
            TrainableModel(name="../escape")
