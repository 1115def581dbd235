"""Supervised fine-tuning through ``GRPOTrainer.train_step``: the assistant-only mask and the loss, by hand.

The mask is worked out on a tiny chat with a tool call: the trained tokens must be exactly the two assistant
turns' text (the tool call's ``<tool_call>`` block and the final answer, each up to and including its
``<|im_end|>``), nothing of the system prompt, the user turn or the tool result. The loss is checked against
torch's own cross-entropy over exactly those positions, on the same weights (``loss_first`` is computed before
the first optimizer step changes them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pydantic import ValidationError

from art_core import CallRecord, SFTConfig, TrainConfig, Trajectory, TrajectoryGroup
from art_core.config import LoraSettings, step_config
from art_core.training.samples import trajectory_samples
from art_core.training.schedules import learning_rates
from art_core.training.trainer import GRPOTrainer, load_policy

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CHAT = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]
# What SmolLM2's template makes of the two assistant turns: worked out by reading the template, not by the code.
TOOL_TURN = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
ANSWER_TURN = "It is 5.<|im_end|>"


def _chat_trajectory(**fields) -> Trajectory:
    return Trajectory.model_validate({"messages": CHAT, "tools": [ADD], **fields})


def _trained_runs(tokenizer, sample) -> list[str]:
    """The trained tokens, decoded as runs of consecutive positions."""
    runs, current = [], []
    for token, trained in zip(sample.token_ids, sample.trained):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


@pytest.fixture()
def trainer(tiny_model_dir: Path) -> GRPOTrainer:
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    return GRPOTrainer(model, tokenizer)


def _reference_nll(trainer: GRPOTrainer, samples) -> float:
    """Token-mean cross-entropy of the trained positions of ``samples``, by torch, on the current weights."""
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.token_ids])  # [1, T]
            logits = trainer.model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]: position t predicts t+1
            nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")  # [T-1]
            keep = torch.tensor(sample.trained[1:])  # the loss at t uses the logits at t-1
            total += nll[keep].sum().item()
            count += int(keep.sum())
    return total / count


def test_mask_covers_exactly_the_assistant_turns_of_a_tool_chat(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (sample,) = trajectory_samples(_chat_trajectory(), tokenizer)
    assert sample.rerendered
    assert _trained_runs(tokenizer, sample) == [TOOL_TURN, ANSWER_TURN]
    expected = len(tokenizer(TOOL_TURN, add_special_tokens=False)["input_ids"]) + len(
        tokenizer(ANSWER_TURN, add_special_tokens=False)["input_ids"])
    assert sample.num_trained == expected
    untrained = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.trained) if not m])
    for context in ("2+3?", "<tool_response>\n5\n</tool_response>", "# Tools"):
        assert context in untrained

    (last,) = trajectory_samples(_chat_trajectory(), tokenizer, assistant_turns="last")
    assert _trained_runs(tokenizer, last) == [ANSWER_TURN]
    assert last.token_ids == sample.token_ids  # the whole chat is the context; only the mask shrinks


def test_a_turn_weighted_zero_is_context_only(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = [dict(m) for m in CHAT]
    chat[1]["weight"] = 0  # OpenAI's fine-tuning format: keep the tool call as context, do not train it
    (sample,) = trajectory_samples(Trajectory.model_validate({"messages": chat, "tools": [ADD]}), tokenizer)
    assert _trained_runs(tokenizer, sample) == [ANSWER_TURN]


@pytest.mark.parametrize("turns", ["all", "last"])
def test_sft_loss_is_torch_cross_entropy_over_the_assistant_tokens(trainer, turns):
    trajectory = _chat_trajectory()
    samples = trajectory_samples(trajectory, trainer.tokenizer, assistant_turns=turns)
    expected = _reference_nll(trainer, samples)
    metrics = trainer.train_step([TrajectoryGroup([trajectory])],
                                 SFTConfig(batch_size=1, assistant_turns=turns, learning_rate=1e-3))
    assert metrics["trained"] == 1.0 and metrics["optimizer_steps"] == 1.0
    assert metrics["samples_rerendered"] == 1.0
    assert metrics["trained_tokens"] == sum(s.num_trained for s in samples)
    assert metrics["loss_first"] == pytest.approx(expected, rel=1e-5)
    assert _reference_nll(trainer, samples) < expected  # one step on the data makes it more likely


@pytest.mark.parametrize("share_prefix", [False, True])
def test_the_loss_is_a_token_mean_over_the_whole_optimizer_step(trainer, share_prefix):
    """Two chats of different lengths in one batch, one micro-batch each: the step's loss is their summed NLL
    over their summed token count, not the mean of two per-chat means; running their common prompt (the tool
    schemas) once changes nothing but the tokens run."""
    short = Trajectory.model_validate({"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "Hello."}], "tools": [ADD]})
    long = _chat_trajectory()
    samples = [s for t in (short, long) for s in trajectory_samples(t, trainer.tokenizer)]
    expected = _reference_nll(trainer, samples)
    metrics = trainer.train_step([TrajectoryGroup([short, long])],
                                 SFTConfig(batch_size=2, micro_batch_tokens=16, share_prefix=share_prefix))
    assert metrics["micro_batches"] == 2.0 and metrics["optimizer_steps"] == 1.0
    assert metrics["loss_first"] == pytest.approx(expected, rel=1e-5)
    every_token = sum(len(s.token_ids) for s in samples)
    assert (metrics["forward_tokens"] < every_token) == share_prefix


def test_token_exact_records_train_every_call_or_only_the_last(trainer):
    first = CallRecord(prompt_token_ids=list(range(100, 130)), completion_token_ids=[201, 202, 2])
    second = CallRecord(prompt_token_ids=[*range(100, 130), 201, 202, 2, 55, 56], completion_token_ids=[301, 2])
    trajectory = Trajectory(calls=[first, second], reward=0.0)
    (merged,) = trajectory_samples(trajectory, trainer.tokenizer)
    assert [t for t, m in zip(merged.token_ids, merged.trained) if m] == [201, 202, 2, 301, 2]
    (last,) = trajectory_samples(trajectory, trainer.tokenizer, assistant_turns="last")
    assert last.token_ids == [*second.prompt_token_ids, 301, 2]
    assert [t for t, m in zip(last.token_ids, last.trained) if m] == [301, 2]

    expected = _reference_nll(trainer, [last])
    metrics = trainer.train_step([TrajectoryGroup([trajectory])], SFTConfig(assistant_turns="last"))
    assert metrics["trained_tokens"] == 2.0 and metrics["samples_rerendered"] == 0.0
    assert metrics["loss_first"] == pytest.approx(expected, rel=1e-5)


def test_equal_rewards_are_trained_on_and_epochs_times_batches_make_the_optimizer_steps(trainer):
    """GRPO would drop a group whose rewards are equal; SFT trains every trajectory, ``epochs`` times, in
    ``ceil(n / batch_size)`` optimizer steps per epoch, at the schedule's rates."""
    trajectories = [Trajectory.model_validate({"messages": [{"role": "user", "content": f"say {k}"},
                                                            {"role": "assistant", "content": str(k)}]})
                    for k in range(5)]
    seen: list[tuple[int, int]] = []
    metrics = trainer.train_step([TrajectoryGroup(trajectories)],
                                 SFTConfig(batch_size=2, epochs=2, learning_rate=1e-2, lr_schedule="linear"),
                                 progress=lambda done, total: seen.append((done, total)))
    assert metrics["optimizer_steps"] == 6.0 and metrics["groups_dropped"] == 0.0 and metrics["samples"] == 5.0
    assert metrics["learning_rate"] == 1e-2 and metrics["learning_rate_last"] == pytest.approx(1e-2 / 6)
    assert seen[-1][0] == seen[-1][1] == metrics["micro_batches"]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # one count across the optimizer steps
    assert metrics["loss_last"] < metrics["loss_first"]


def test_learning_rate_schedules_by_hand():
    assert learning_rates(1.0, 4, schedule="constant") == [1.0, 1.0, 1.0, 1.0]
    assert learning_rates(1.0, 4, schedule="linear") == [1.0, 0.75, 0.5, 0.25]
    # cosine: 0.5 * (1 + cos(pi * s / 4)) for s = 0..3
    assert learning_rates(1.0, 4, schedule="cosine") == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    # warmup of ceil(0.5 * 4) = 2 steps: 1/3, 2/3, then linear over the 2 left: 1.0, 0.5
    assert learning_rates(1.0, 4, schedule="linear", warmup_ratio=0.5) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])


def test_sft_config_is_checked_and_tells_grpo_apart_on_the_wire():
    with pytest.raises(ValidationError, match="epochs"):
        SFTConfig(epochs=0)
    with pytest.raises(ValidationError, match="loss"):
        SFTConfig(loss="dapo")  # extra=forbid: a GRPO knob is refused, not ignored
    assert isinstance(step_config({"kind": "sft", "batch_size": 4}), SFTConfig)
    assert isinstance(step_config({"loss": "grpo"}), TrainConfig)  # a body from before ``kind``: GRPO
    config = SFTConfig(epochs=2, lr_schedule="cosine")
    assert step_config(json.loads(config.model_dump_json())) == config
    assert math.isclose(SFTConfig().learning_rate, 1e-4)


def test_a_pass_that_fails_midway_leaves_the_adapter_as_it_was(trainer):
    """Three optimizer steps; the third fails (here: the progress callback raises, as an interrupt would) after
    two were applied. The adapter and optimizer are put back: a failed step changes nothing."""
    trajectories = [Trajectory.model_validate({"messages": [{"role": "user", "content": f"say {k}"},
                                                            {"role": "assistant", "content": str(k)}]})
                    for k in range(3)]
    before = [p.detach().clone() for p in trainer.params]

    def progress(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        trainer.train_step([TrajectoryGroup(trajectories)], SFTConfig(batch_size=1, learning_rate=1e-2),
                           progress=progress)
    assert all(torch.equal(p, b) for p, b in zip(trainer.params, before))
    assert trainer.optimizer is None and all(p.grad is None for p in trainer.params)
    metrics = trainer.train_step([TrajectoryGroup(trajectories)], SFTConfig(batch_size=1, learning_rate=1e-2))
    assert metrics["optimizer_steps"] == 3.0  # and the trainer still works


def _adamw_steps(trainer: GRPOTrainer) -> int:
    """How many updates the optimizer's moments have accumulated (AdamW's ``step``, equal over parameters)."""
    counts = {float(state["step"]) for state in trainer.optimizer.state.values()}
    assert len(counts) == 1
    return int(counts.pop())


def _moments(trainer: GRPOTrainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each trainable parameter's AdamW momentum and second moment, copied."""
    return [(trainer.optimizer.state[p]["exp_avg"].clone(), trainer.optimizer.state[p]["exp_avg_sq"].clone())
            for p in trainer.params]


def _weights(trainer: GRPOTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def _gradient_momentum(trainer: GRPOTrainer, weights: list[torch.Tensor], group: TrajectoryGroup) -> list[torch.Tensor]:
    """``0.1 x`` the gradient of a GRPO step on ``group`` from ``weights``: the momentum a fresh AdamW holds after
    that one step (betas 0.9, 0.999), worked out on a fresh trainer of the same module; the weights are put back."""
    now = _weights(trainer)
    with torch.no_grad():
        for param, weight in zip(trainer.params, weights, strict=True):
            param.copy_(weight)
    fresh = GRPOTrainer(trainer.model, trainer.tokenizer)
    fresh.train_step([group], TrainConfig(learning_rate=1e-3))
    momentum = [fresh.optimizer.state[p]["exp_avg"].clone() for p in fresh.params]
    with torch.no_grad():
        for param, weight in zip(trainer.params, now, strict=True):
            param.copy_(weight)
    return momentum


def _check_one_update(trainer, before, weights, *, momentum_kept: bool) -> None:
    """By hand, AdamW's moments after one GRPO step from ``weights`` with moments ``before``: ``m = 0.9 m0 + 0.1 g``
    with ``m0`` the momentum before it, or zero where it was dropped; ``v`` at least ``0.999 v0`` (kept, not
    started afresh)."""
    expected = _gradient_momentum(trainer, weights, _ranked_group())
    for (m0, v0), (m1, v1), fresh in zip(before, _moments(trainer), expected, strict=True):
        torch.testing.assert_close(m1, (0.9 * m0 if momentum_kept else 0.0) + fresh, rtol=1e-4, atol=1e-12)
        assert bool((v1 >= 0.999 * v0 * (1 - 1e-5)).all())


def _ranked_group() -> TrajectoryGroup:
    """Two answers to one question with different rewards: a GRPO step has something to train."""
    return TrajectoryGroup([Trajectory.model_validate({"messages": [{"role": "user", "content": "2+3?"},
                                                                    {"role": "assistant", "content": answer}],
                                                       "reward": reward})
                            for answer, reward in (("5", 1.0), ("6", 0.0))])


def test_a_step_of_another_kind_drops_the_momentum_and_keeps_the_second_moments(trainer, tmp_path):
    """SFT's momentum is not GRPO's: carried over, it steered the GRPO steps after a warm start. At each change of
    kind the momentum starts from zero; the second moments and the step count go on (a fresh AdamW's first step
    would move every parameter by the full rate). Steps of one kind keep their momentum, also across a resume from
    a checkpoint of that kind, and not from one of the other kind."""
    from art_core.training.checkpoints import write_checkpoint

    chats = TrajectoryGroup([_chat_trajectory(), _chat_trajectory()])
    trainer.train_step([chats], SFTConfig(batch_size=1, epochs=2, learning_rate=1e-3))
    sft, sft_weights = _moments(trainer), _weights(trainer)
    assert _adamw_steps(trainer) == 4 and any(m.abs().sum() > 0 for m, _ in sft)
    sft_dir = write_checkpoint(tmp_path, 1, trainer.save, metadata={"kind": "sft"})
    trainer.train_step([_ranked_group()], TrainConfig(learning_rate=1e-3))
    assert _adamw_steps(trainer) == 5
    _check_one_update(trainer, sft, sft_weights, momentum_kept=False)
    grpo, grpo_weights = _moments(trainer), _weights(trainer)
    grpo_dir = write_checkpoint(tmp_path, 2, trainer.save, metadata={"kind": "grpo"})
    trainer.train_step([_ranked_group()], TrainConfig(learning_rate=1e-3))
    _check_one_update(trainer, grpo, grpo_weights, momentum_kept=True)

    for directory, saved, weights, kept in ((grpo_dir, grpo, grpo_weights, True), (sft_dir, sft, sft_weights, False)):
        with torch.no_grad():
            for param, weight in zip(trainer.params, weights, strict=True):
                param.copy_(weight)
        resumed = GRPOTrainer(trainer.model, trainer.tokenizer)
        assert resumed.load_optimizer_state(directory)
        resumed.train_step([_ranked_group()], TrainConfig(learning_rate=1e-3))
        _check_one_update(resumed, saved, weights, momentum_kept=kept)


def test_a_failed_pass_of_another_kind_puts_the_old_moments_back(trainer):
    """An SFT pass after GRPO steps drops the momentum; if it fails, the GRPO moments are back, and the next GRPO
    step continues them."""
    for _ in range(2):
        trainer.train_step([_ranked_group()], TrainConfig(learning_rate=1e-3))
    grpo, weights = _moments(trainer), _weights(trainer)

    def interrupt(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt("stop")

    chats = TrajectoryGroup([_chat_trajectory(), _chat_trajectory(), _chat_trajectory()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train_step([chats], SFTConfig(batch_size=1, learning_rate=1e-3), progress=interrupt)
    assert _adamw_steps(trainer) == 2
    assert all(torch.equal(m, m_back) and torch.equal(v, v_back)
               for (m, v), (m_back, v_back) in zip(grpo, _moments(trainer), strict=True))
    trainer.train_step([_ranked_group()], TrainConfig(learning_rate=1e-3))
    _check_one_update(trainer, grpo, weights, momentum_kept=True)
