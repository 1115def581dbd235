"""Trajectories -> training samples: token ids plus a mask of the tokens the model sampled.

Two paths:

* **Token-exact** (the normal one): a history's ``calls`` carry the prompt ids the engine ran and the
  completion ids it sampled. A call whose prompt extends the previous call's prompt + completion
  (a multi-turn agent with a prefix-stable template) is merged into one sample, so the shared context is
  computed once; otherwise each call starts a new sample.
* **Re-rendered** (the fallback, for histories recorded without token ids): the messages go through the
  tokenizer's chat template again. This is not guaranteed to reproduce what the model saw (templates
  normalise whitespace, drop reasoning, re-serialise tool arguments), so such samples are flagged and
  counted in the step's metrics.

Either way the mask covers exactly the tokens the model produced (assistant text and tool calls, up to and
including its end-of-turn token), never system, user or tool tokens. An assistant message carrying OpenAI's
fine-tuning ``"weight": 0`` stays as context and is not trained. ``assistant_turns="last"`` (supervised
fine-tuning) trains only a trajectory's last turn: its last call, or its last assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import TrajectoryError
from ..messages import template_messages
from ..types import CallRecord, History, Trajectory

__all__ = ["Sample", "attribute_behaviour", "trajectory_samples"]

NAN = float("nan")


@dataclass
class Sample:
    """One sequence to train on.

    ``trained[t]`` says whether token t was sampled by the model; the loss at t uses the logits at t-1,
    so ``trained[0]`` is always False.
    """

    trajectory_id: str
    token_ids: list[int]
    trained: list[bool]
    sampler_logprobs: list[float]
    """The sampler's logprob of each trained token; NaN elsewhere and where the engine gave none."""
    rerendered: bool = False
    advantage: float = 0.0
    group_index: int = -1
    extras: dict[str, Any] = field(default_factory=dict)
    sampling_step: int | None = None
    """The adapter step that sampled this sample's tokens (the oldest, when merged calls differ); None: unknown."""
    behaviour_logprobs: list[float] | None = None
    """Log-prob of each trained token under the policy that sampled it (the behaviour policy), NaN elsewhere.

    Given, the loss's importance ratio is ``pi / pi_behaviour`` exactly: data sampled by an older adapter (an
    asynchronous pipeline) is corrected for the policy's lag. None (the default): the sample is on-policy, and the
    trainer's own detached log-probs stand in (ratio 1 in value, the gradient of log pi). A NaN at a trained token
    falls back the same way for that token.
    """

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.trained) != n or len(self.sampler_logprobs) != n:
            raise TrajectoryError(
                f"trajectory {self.trajectory_id!r}: {n} token ids but {len(self.trained)} mask entries and "
                f"{len(self.sampler_logprobs)} logprobs; the three must have one entry per token"
            )
        if self.behaviour_logprobs is not None and len(self.behaviour_logprobs) != n:
            raise TrajectoryError(
                f"trajectory {self.trajectory_id!r}: {n} token ids but {len(self.behaviour_logprobs)} behaviour "
                "log-probs; give one per token (NaN where not trained), or None for on-policy data"
            )
        if n and self.trained[0]:
            raise TrajectoryError(
                f"trajectory {self.trajectory_id!r}: the first token is marked as sampled, but nothing predicts "
                "it; a call's prompt must hold at least one token"
            )
        if not any(self.trained):
            raise TrajectoryError(
                f"trajectory {self.trajectory_id!r}: a sample has no token sampled by the model; "
                "nothing to train on"
            )

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


def trajectory_samples(trajectory: Trajectory, tokenizer: Any | None = None, *,
                       assistant_turns: Literal["all", "last"] = "all") -> list[Sample]:
    """Build the training samples of one trajectory (all of its histories).

    Args:
        trajectory: the run to learn from.
        tokenizer: a Hugging Face tokenizer with a chat template; needed only for histories
            recorded without token ids (the re-rendered fallback).
        assistant_turns: ``"all"`` trains every assistant turn of every history; ``"last"`` only the last turn
            of the main history (its last call, with that call's whole prompt as context; or its last trained
            assistant message), and no additional history.

    Returns:
        One sample per merged run of calls, for each history.

    Raises:
        TrajectoryError: the trajectory has no assistant turn, an assistant message's ``weight`` is neither 0
            nor 1, or a history without token ids cannot be re-rendered (no tokenizer given, or the template
            cannot render it). The message names the trajectory.
    """
    samples: list[Sample] = []
    last = assistant_turns == "last"
    for history in trajectory.histories()[:1] if last else trajectory.histories():
        if history.calls:
            samples.extend(_samples_from_calls(trajectory.id, history.calls[-1:] if last else history.calls))
        elif turns := _trained_turns(trajectory.id, history, last):
            samples.extend(_samples_by_rerendering(trajectory.id, history, tokenizer, turns))
    if not samples:
        raise TrajectoryError(
            f"trajectory {trajectory.id!r} has no assistant turn and no recorded call: nothing to train on. "
            "Make sure the rollout called the trainable model (through the gateway), or drop this trajectory."
        )
    return samples


def attribute_behaviour(samples: list[Sample], policy_step: int) -> int:
    """Give the samples drawn by an adapter older than ``policy_step`` their sampler's log-probs as behaviour log-probs.

    Such samples are off-policy: the module has moved on since they were sampled, so the loss's ratio must be taken
    against the policy that sampled them, whose log-probs the engine reported with each token. A sample of an unknown
    step, of the current one, or with behaviour log-probs already is left as it is.

    Returns:
        How many samples were attributed.
    """
    attributed = 0
    for sample in samples:
        step = sample.sampling_step
        if sample.behaviour_logprobs is None and step is not None and step < policy_step:
            sample.behaviour_logprobs = list(sample.sampler_logprobs)  # NaN where the engine gave none
            attributed += 1
    return attributed


def _samples_from_calls(trajectory_id: str, calls: list[CallRecord]) -> list[Sample]:
    samples: list[Sample] = []
    ids: list[int] = []
    trained: list[bool] = []
    logprobs: list[float] = []
    steps: list[int] = []  # adapter steps of the calls merged into the current sample
    for call in calls:
        prompt = call.prompt_token_ids
        if ids and len(prompt) >= len(ids) and prompt[: len(ids)] == ids:
            # This call continues the current sample: only the new context (tool results, next user turn).
            new_context = prompt[len(ids) :]
        else:
            if ids:
                samples.append(Sample(trajectory_id, ids, trained, logprobs, sampling_step=_oldest(steps)))
            if not prompt:
                raise TrajectoryError(
                    f"trajectory {trajectory_id!r}: a call has an empty prompt_token_ids; the gateway's "
                    "record of the call is incomplete"
                )
            ids, trained, logprobs, steps = [], [], [], []
            new_context = prompt
        ids = ids + list(new_context) + list(call.completion_token_ids)
        trained += [False] * len(new_context) + [True] * len(call.completion_token_ids)
        sampled = call.logprobs if call.logprobs is not None else [NAN] * len(call.completion_token_ids)
        logprobs += [NAN] * len(new_context) + [float(x) for x in sampled]
        if call.adapter_step is not None:
            steps.append(call.adapter_step)
    samples.append(Sample(trajectory_id, ids, trained, logprobs, sampling_step=_oldest(steps)))
    return samples


def _oldest(steps: list[int]) -> int | None:
    # A merged sample's staleness is that of its oldest call: its tokens lag the trainer the most.
    return min(steps) if steps else None


def _trained_turns(trajectory_id: str, history: History, last: bool) -> list[int]:
    """The indices of the assistant messages to train on: all but those weighted 0 (OpenAI's fine-tuning
    ``"weight": 0``: context only), or only the last of them."""
    turns = []
    for k, message in enumerate(history.messages):
        if message.role != "assistant":
            continue
        weight = (message.model_extra or {}).get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):  # OpenAI's fine-tuning format allows 0 and 1 only
            raise TrajectoryError(f"trajectory {trajectory_id!r}: assistant message {k} has weight {weight!r}: give 0 "
                                  "(context, not trained) or 1 (trained), as in OpenAI's fine-tuning format")
        if weight == 1:
            turns.append(k)
    return turns[-1:] if last else turns


def _samples_by_rerendering(trajectory_id: str, history: History, tokenizer: Any | None,
                            turns: list[int]) -> list[Sample]:
    if tokenizer is None:
        raise TrajectoryError(
            f"trajectory {trajectory_id!r} has no token-exact call records, and no tokenizer was given to "
            "re-render its messages; record calls through the gateway, or pass the tokenizer"
        )
    messages = template_messages(m.model_dump(exclude_none=True) for m in history.messages)
    tools = history.tools or None

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja errors: the template cannot express this history
            raise TrajectoryError(
                f"trajectory {trajectory_id!r}: the chat template failed to render message {upto - 1}: {exc}"
            ) from exc

    # Group assistant turns into texts that extend each other (a prefix-stable template gives one text
    # for the whole history); record the character span of each assistant turn.
    texts: list[tuple[str, list[tuple[int, int]]]] = []
    for k in turns:
        if k == 0:  # rendered on nothing, the template fails with "empty conversation"
            raise TrajectoryError(
                f"trajectory {trajectory_id!r}: its first message is a trained assistant turn, with nothing before "
                "it to prompt it; start the history with a user (or system) message, or give that turn weight 0")
        before = render(k, generation_prompt=True)
        upto = render(k + 1, generation_prompt=False)
        if not upto.startswith(before):
            raise TrajectoryError(
                f"trajectory {trajectory_id!r}: rendering message {k} changes the text before it; "
                "this chat template cannot be re-rendered turn by turn. Record calls through the gateway."
            )
        # The model stopped at its end-of-turn token; whitespace the template adds after it was not sampled.
        span = (len(before), len(upto.rstrip()))
        if texts and before.startswith(texts[-1][0]):
            texts[-1] = (upto, [*texts[-1][1], span])
        else:
            texts.append((upto, [span]))

    samples = []
    for text, spans in texts:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        trained = [any(lo <= start and end <= hi for lo, hi in spans) and end > start
                   for start, end in encoding["offset_mapping"]]
        samples.append(Sample(trajectory_id, ids, trained, [NAN] * len(ids), rerendered=True))
    return samples
