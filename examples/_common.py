"""What every example shares: its flags, its backend, the training loop with live progress, held-out
evaluation and the learning curve (a PNG and a terminal sparkline).

An example supplies three things and calls ``learn``:

- ``play(task, n, seed) -> TrajectoryGroup``: ``n`` rollouts of its agent on one task, each scored, with
  ``trajectory.metrics["success"]`` (1.0 when the agent did its job) and, when the agent calls tools,
  ``trajectory.metrics["valid_tool_calls"]`` (the share of its tool calls that were well formed and allowed);
- the training tasks and the held-out tasks (fixed seeds);
- a ``TrainConfig``;
- optionally, for an SFT warm start (``--demos N``): ``demonstrate(tasks) -> trajectories``, its agent run once
  per task in demonstration mode (``agent.demonstrations(teacher)``: a stronger model answers the agent's calls),
  and the demonstration tasks (their own seed, apart from the held-out tasks).

``learn`` measures the held-out success rate; with ``--demos N`` it collects N demonstrations, trains one SFT step
on those that succeeded (``model.train_sft``) and measures again; then it trains ``steps`` GRPO steps on the same
adapter, printing one line per step (reward mean and spread, success, tool-call validity, seconds per phase),
measures again, and writes the learning curve next to the checkpoints.

The GRPO steps run in the synchronous loop (roll out a step's groups, train, repeat), or with
``--max-off-policy N`` (N > 0) through ``art_core.pipeline``: rollouts keep running while a step trains, each
group trained at most N steps after the checkpoint that sampled it, on a backend that keeps serving during steps
(``open_backend``). Same tasks, seeds, steps, groups, rollouts and ``TrainConfig`` either way.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console

from art_core import (History, LocalBackend, SFTConfig, StepReport, TrainableModel, TrainConfig, Trajectory,
                      TrajectoryGroup, pipeline, write_groups_jsonl)
from art_core.errors import ArtError, ConfigError
from art_core.models import EMBEDDED_MODEL
from art_core.tracking import TRACKER_NAMES

if TYPE_CHECKING:
    from art_plugins.langgraph import TrainableGraph

    from ._expert import ScriptedExpert

__all__ = ["Demonstrate", "Evaluation", "ExampleSettings", "LearningResult", "StepStats", "demonstration_tasks",
           "graph_at", "graph_demonstrations", "held_out_evaluation", "learn", "open_backend", "parse_settings",
           "plot_curve", "run_from_command_line", "sparkline", "unique_turns"]

T = TypeVar("T")
Play = Callable[[T, int, int], Awaitable[TrajectoryGroup]]
"""``play(task, n, seed)``: ``n`` scored rollouts of the agent on ``task``; ``seed`` seeds the group's sampling
(``agent.group(..., seed=seed)``), so that the held-out evaluation and the training groups can be replayed."""
Demonstrate = Callable[[Sequence[T]], Awaitable[Sequence[Trajectory]]]
"""``demonstrate(tasks)``: the agent run once per task in demonstration mode (its trainable calls answered by a
teacher: ``async with agent.demonstrations(teacher) as demo``), each trajectory scored as ``play`` scores them (with
``metrics["success"]``), in the order of ``tasks``."""


# -- flags ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExampleSettings:
    """What the common flags set; each example picks its own small CPU defaults."""

    base_model: str = EMBEDDED_MODEL
    """A registered name (``art-core models``) or a local Hugging Face model folder."""
    steps: int = 10
    """GRPO steps."""
    groups: int = 4
    """Tasks per step (one group each)."""
    rollouts: int = 8
    """Rollouts per group: GRPO compares them with each other."""
    held_out: int = 24
    """Held-out tasks evaluated before and after training."""
    eval_rollouts: int = 2
    """Rollouts per held-out task (the success rate is over held_out x eval_rollouts runs)."""
    learning_rate: float = 1e-3
    """High for LoRA, so that a few steps on CPU show an effect."""
    inference: str = "transformers"
    """The engine behind the gateway; passed to ``LocalBackend(inference=...)`` where it takes one."""
    judge: str | None = None
    """A litellm model string for RULER (``openai/o4-mini``); ``local``: the base model, on this machine."""
    path: Path = Path(".art")
    """Where checkpoints, trajectories and the learning curve go."""
    seed: int = 0
    """Seeds the tasks and the sampling."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers for ``TrainableModel(report_to=...)``: ``wandb``, ``mlflow``, ``tensorboard``,
    ``trackio``, or ``all`` alone (each one installed; empty: none)."""
    demos: int = 0
    """Demonstrations for an SFT warm start before the GRPO steps (tasks of their own seed). 0: off, RL alone."""
    sft_epochs: int = 3
    """Passes over the demonstrations in the SFT step: a handful of demonstrations need more than one."""
    sft_learning_rate: float = 1e-3
    """Peak rate of the SFT step (linear decay): high for LoRA, as the GRPO rate is, so a few demonstrations tell."""
    sft_batch_size: int = 4
    """Demonstrations (with ``sft_unique_turns``: turns) per optimizer step of the SFT step."""
    sft_unique_turns: bool = False
    """Train each distinct turn of the demonstrations (a context the model saw and the teacher's reply) once per
    epoch instead of each demonstration whole: a game's opening position, repeated in half the games, then costs
    one sample, and the same time covers more positions (see ``unique_turns``)."""
    max_off_policy: int = 0
    """0: the synchronous GRPO loop. N > 0: the GRPO steps run through ``art_core.pipeline(max_off_policy=N)``,
    rollouts overlapping steps, on a backend that serves during steps (``open_backend``)."""


def parse_settings(description: str, defaults: ExampleSettings, argv: Sequence[str] | None = None, *,
                   judged: bool = False, teacher: bool = True) -> ExampleSettings:
    """The common flags (``--base-model``, ``--steps``, ``--groups``, ``--rollouts``, ``--inference``,
    ``--judge``...), with the example's defaults.

    Args:
        description: the example's one-line description (``--help``).
        defaults: the example's defaults.
        argv: the arguments; default: ``sys.argv[1:]``.
        judged: the example's rewards can come from a RULER judge (``--judge``); otherwise ``--judge`` is refused
            rather than ignored (a run would look judged and was not).
        teacher: the example has a teacher for ``--demos``; otherwise ``--demos`` is refused before any work.

    Returns:
        The settings.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-model", default=defaults.base_model,
                        help="registered model name or local Hugging Face folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=defaults.groups, help="tasks per step (default: %(default)s)")
    parser.add_argument("--rollouts", type=int, default=defaults.rollouts,
                        help="rollouts per task (default: %(default)s)")
    parser.add_argument("--held-out", type=int, default=defaults.held_out,
                        help="held-out tasks evaluated before and after (default: %(default)s)")
    parser.add_argument("--eval-rollouts", type=int, default=defaults.eval_rollouts,
                        help="rollouts per held-out task (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                        help="AdamW learning rate of the LoRA adapter (default: %(default)s)")
    parser.add_argument("--inference", default=defaults.inference,
                        help="inference engine behind the gateway, e.g. transformers or vllm (default: %(default)s)")
    parser.add_argument("--judge", default=defaults.judge,
                        help="RULER judge: a litellm model string, or 'local' for the base model on this machine")
    parser.add_argument("--path", type=Path, default=defaults.path, help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of tasks and sampling")
    parser.add_argument("--report-to", nargs="+", choices=(*TRACKER_NAMES, "all"), default=list(defaults.report_to),
                        metavar="TRACKER", help=f"send each step to these trackers ({', '.join(TRACKER_NAMES)}, or "
                        "'all' for each one installed); see the README's 'Experiment tracking'")
    parser.add_argument("--demos", type=int, default=defaults.demos,
                        help="SFT warm start: demonstrations from the example's teacher, trained on before the GRPO "
                        "steps (default: %(default)s; 0: off)")
    parser.add_argument("--sft-epochs", type=int, default=defaults.sft_epochs,
                        help="passes over the demonstrations in the SFT step (default: %(default)s)")
    parser.add_argument("--sft-learning-rate", type=float, default=defaults.sft_learning_rate,
                        help="peak learning rate of the SFT step (default: %(default)s)")
    parser.add_argument("--sft-batch-size", type=int, default=defaults.sft_batch_size,
                        help="demonstrations (turns, with --sft-unique-turns) per SFT optimizer step "
                        "(default: %(default)s)")
    parser.add_argument("--sft-unique-turns", action=argparse.BooleanOptionalAction, default=defaults.sft_unique_turns,
                        help="train each distinct turn of the demonstrations once per epoch, not each demonstration "
                        "whole (default: %(default)s)")
    parser.add_argument("--max-off-policy", type=int, default=defaults.max_off_policy, metavar="N",
                        help="asynchronous GRPO: rollouts keep running while a step trains (art_core.pipeline), each "
                        "group trained at most N steps after the checkpoint that sampled it; the backend serves "
                        "during steps (the transformers engine with a second copy of the base in memory). "
                        "0: the synchronous loop (default: %(default)s)")
    args = parser.parse_args(argv)
    args.report_to = tuple(args.report_to)
    least = {"steps": 0, "demos": 0, "groups": 1, "rollouts": 1, "held_out": 1, "eval_rollouts": 1, "sft_epochs": 1,
             "sft_batch_size": 1}
    for flag, low in least.items():
        if getattr(args, flag) < low:
            parser.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    for flag in ("learning_rate", "sft_learning_rate"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.judge is not None and not judged:
        parser.error(f"--judge {args.judge}: this example scores its runs with a reward of its own, so a judge "
                     "would go unused; RULER judges in email_search and ruler_only")
    if args.demos and not teacher:
        parser.error(f"--demos {args.demos}: this example has no teacher for demonstrations; run it without --demos "
                     "(the examples with one say so in examples/README.md)")
    if args.max_off_policy < 0:
        parser.error(f"--max-off-policy must be at least 0 (0: the synchronous loop; N > 0: rollouts at most N steps "
                     f"off-policy), got {args.max_off_policy}")
    return ExampleSettings(**vars(args))


def run_from_command_line(main: Callable[[], object]) -> None:
    """``python -m examples.<name>``: run ``main``; an error of ours (it names the fix) ends the run with its
    message on one line and exit status 1, not a traceback; Ctrl-C ends it with one line and status 130 (what
    was trained is kept: checkpoints are written whole or not at all). Called from Python, ``main`` raises as
    usual."""
    try:
        main()
    except ArtError as exc:
        raise SystemExit(f"error: {exc}") from None
    except KeyboardInterrupt:
        print("\ninterrupted: the checkpoints written so far are kept (none is half-written)", file=sys.stderr)
        raise SystemExit(130) from None


def run_name(name: str) -> str:
    """A model name of its own for this run: ``name``, the time and a random suffix, so that runs started in the
    same second (seeds launched side by side) never share a folder."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def open_backend(settings: ExampleSettings) -> LocalBackend:
    """A ``LocalBackend`` at ``settings.path`` with the engine ``settings.inference``.

    With ``settings.max_off_policy`` > 0 it keeps serving while a step trains (``pause_during_step=False``), so
    that the pipeline's rollouts overlap the steps; the transformers engine then decodes a copy of the model of
    its own (``TransformersOptions(separate_module=True)``: a second copy of the base in memory).

    Raises:
        ConfigError: an engine other than ``transformers`` was asked for and this ``LocalBackend`` cannot
            choose its engine.
    """
    overlap = LocalBackend.serving_during_steps(settings.inference) if settings.max_off_policy > 0 else {}
    if "inference" in inspect.signature(LocalBackend).parameters:
        return LocalBackend(path=settings.path, show_progress=False, inference=settings.inference,  # type: ignore[call-arg]
                            **overlap)
    if settings.inference != "transformers":
        raise ConfigError(f"--inference {settings.inference!r} is not available: this art-core's LocalBackend "
                          "serves through the transformers engine only; use --inference transformers")
    return LocalBackend(path=settings.path, show_progress=False, **overlap)


# -- the loop ------------------------------------------------------------------------------------------

@dataclass
class StepStats:
    """One training step, as the progress line shows it."""

    step: int
    reward_mean: float
    reward_std: float
    success: float
    """Share of this step's rollouts that did the job."""
    valid_tool_calls: float | None
    """Share of tool calls that were well formed and allowed (None: the agent made none it could)."""
    groups_used: int
    groups: int
    rollout_seconds: float
    """Seconds the step waited for its groups: rolling them out (synchronous loop), or, pipelined, since the
    previous step ended (the rollouts not hidden behind it)."""
    train_seconds: float
    staleness_max: float = 0.0
    """Most steps the adapter had moved since one of the step's groups was sampled (0 in the synchronous loop)."""
    groups_stale: int = 0
    """Groups dropped as staler than ``--max-off-policy`` (pipelined only)."""


@dataclass
class LearningResult:
    """What ``learn`` measured; ``to_json()`` for scripts."""

    name: str
    success_before: float
    """Held-out success rate of the base model."""
    success_after: float
    """Held-out success rate after training."""
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    model_dir: Path | None = None
    curve_png: Path | None = None
    demos: int = 0
    """Demonstrations collected for the SFT warm start (0: no warm start)."""
    demos_trained: int = 0
    """Those the SFT step trained on: the demonstrations that succeeded."""
    sft_loss: float | None = None
    """Mean loss of the SFT step's optimizer steps (None: no SFT step)."""
    success_after_sft: float | None = None
    """Held-out success rate after the SFT step, before any GRPO step (None: no SFT step)."""
    sft_seconds: float = 0.0
    """Collecting the demonstrations and the SFT step (not the evaluation after it)."""
    max_off_policy: int = 0
    """The GRPO steps' bound: 0, the synchronous loop; N > 0, pipelined (``art_core.pipeline``)."""
    rollouts_failed: int = 0
    """Pipelined: rollouts (whole groups) that raised or came back empty, each replaced while steps were left."""
    held_out_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """The held-out runs' metric means (``Evaluation.metrics``) by evaluation: ``before``, ``after_sft``,
    ``after``."""

    @property
    def rewards(self) -> list[float]:
        """Mean training reward per step."""
        return [s.reward_mean for s in self.steps]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "success_before": self.success_before, "success_after": self.success_after,
                "seconds": round(self.seconds, 1), "steps": [asdict(s) for s in self.steps],
                "model_dir": str(self.model_dir), "curve_png": str(self.curve_png), "demos": self.demos,
                "demos_trained": self.demos_trained, "sft_loss": self.sft_loss,
                "success_after_sft": self.success_after_sft, "sft_seconds": round(self.sft_seconds, 1),
                "max_off_policy": self.max_off_policy, "rollouts_failed": self.rollouts_failed,
                "held_out_metrics": self.held_out_metrics}


MAX_CONCURRENT_ROLLOUTS = 16
"""Held-out rollouts in flight at once (whole groups; at least one group)."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class Evaluation:
    """One held-out evaluation."""

    success: float
    """The share of ``tasks x rollouts`` runs whose ``metrics["success"]`` is 1 (a failed rollout counts as a
    failure)."""
    metrics: dict[str, float]
    """The mean of each of the runs' own metrics (tic_tac_toe's ``invalid_move``: the share of games that ended
    on one), over the runs that finished."""
    groups: list[TrajectoryGroup] = field(default_factory=list)
    """The runs themselves, a group per task."""


async def held_out_evaluation(play: Play[T], tasks: Sequence[T], *, rollouts: int, seed: int) -> Evaluation:
    """``rollouts`` seeded runs of each held-out task: their success rate and their metrics' means."""
    # A few groups at a time: on a small CPU, one very large batch decodes slower per rollout than two halves.
    limit = asyncio.Semaphore(max(1, MAX_CONCURRENT_ROLLOUTS // rollouts))

    async def one(k: int, task: T) -> TrajectoryGroup:
        async with limit:
            return await play(task, rollouts, seed + 7919 * k)

    groups = await asyncio.gather(*(one(k, task) for k, task in enumerate(tasks)))
    runs = [t for g in groups for t in g.trajectories]
    successes = sum(t.metrics.get("success", 0.0) >= 1.0 for t in runs)
    names = sorted({name for t in runs for name in t.metrics})
    means = {name: _mean([float(t.metrics[name]) for t in runs if name in t.metrics]) for name in names}
    return Evaluation(successes / (len(tasks) * rollouts), means, list(groups))


async def _evaluate(model: TrainableModel, measure: Play[T], tasks: Sequence[T], settings: ExampleSettings,
                    console: Console, label: str, what: str) -> Evaluation:
    """One held-out evaluation with progress, its runs written to ``evaluations/<label>.jsonl`` in the model's
    folder (beside the training steps' ``trajectories/``), so a figure can be traced back to the runs behind it."""
    runs = f"{len(tasks)} tasks x {settings.eval_rollouts} runs"
    with console.status(f"held-out evaluation {what} ({runs})..."):
        t0 = time.perf_counter()
        evaluation = await held_out_evaluation(measure, tasks, rollouts=settings.eval_rollouts, seed=settings.seed)
    write_groups_jsonl(model.model_dir / "evaluations" / f"{label}.jsonl", evaluation.groups)
    console.print(f"held-out success {what}: [bold]{evaluation.success:.1%}[/] ({runs}, "
                  f"{time.perf_counter() - t0:.0f}s)")
    return evaluation


async def learn(model: TrainableModel, play: Play[T], *, train_tasks: Sequence[T], eval_tasks: Sequence[T],
                settings: ExampleSettings, measure: Play[T] | None = None, config: TrainConfig | None = None,
                console: Console | None = None, title: str = "", demonstrate: Demonstrate[T] | None = None,
                demo_tasks: Sequence[T] = (), sft_config: SFTConfig | None = None) -> LearningResult:
    """Evaluate; with ``settings.demos``, warm-start with SFT on demonstrations and evaluate; train
    ``settings.steps`` GRPO steps with live progress, evaluate again, plot the curve.

    Args:
        model: registered with a backend.
        play: runs ``n`` scored rollouts of the agent on a task (see the module docstring).
        train_tasks: at least ``settings.steps * settings.groups`` tasks (used in order).
        eval_tasks: the held-out tasks.
        settings: steps, groups, rollouts, eval rollouts, learning rate, seed.
        measure: runs the held-out rollouts; default: ``play`` (give one that skips a costly reward, such as
            a judge, when only ``metrics["success"]`` is needed).
        config: GRPO settings; default: ``TrainConfig(learning_rate=settings.learning_rate)``.
        console: where to print.
        title: names the run in the output.
        demonstrate: runs the agent in demonstration mode on tasks (see ``Demonstrate``); needed when
            ``settings.demos`` > 0.
        demo_tasks: at least ``settings.demos`` tasks for the demonstrations (the first ones are used), none of
            them a held-out task.
        sft_config: the SFT step's settings; default: ``settings.sft_epochs`` passes at
            ``settings.sft_learning_rate``, ``settings.sft_batch_size`` demonstrations (or turns) per optimizer step.

    Returns:
        The held-out success before, after the SFT step (if any) and after, and each step's figures.

    Raises:
        ConfigError: fewer training tasks than steps x groups; ``settings.demos`` > 0 and the example has no
            ``demonstrate``, too few demonstration tasks, or some of them held out.
    """
    console = console or Console(soft_wrap=True)
    config = config or TrainConfig(learning_rate=settings.learning_rate)
    needed = settings.steps * settings.groups
    if len(train_tasks) < needed:
        raise ConfigError(f"learn() needs {needed} training tasks ({settings.steps} steps x {settings.groups} "
                          f"groups), got {len(train_tasks)}")
    demo_tasks = list(demo_tasks[:settings.demos]) if settings.demos else []
    if settings.demos:
        _check_demonstrations(settings.demos, demonstrate, demo_tasks, eval_tasks, title or model.name)
        sft_config = sft_config or SFTConfig(epochs=settings.sft_epochs, learning_rate=settings.sft_learning_rate,
                                             batch_size=settings.sft_batch_size)
    measure = measure or play
    started = time.perf_counter()
    evaluation = await _evaluate(model, measure, eval_tasks, settings, console, "before", "before training")
    before = evaluation.success
    result = LearningResult(title or model.name, before, before, model_dir=model.model_dir)
    result.held_out_metrics["before"] = evaluation.metrics
    if demo_tasks:
        assert demonstrate is not None and sft_config is not None  # _check_demonstrations saw to both
        trained = await _warm_start(model, demonstrate, demo_tasks, sft_config, result, console,
                                    unique=settings.sft_unique_turns)
        if trained and settings.steps:  # with no GRPO step, the evaluation after training is this one
            evaluation = await _evaluate(model, measure, eval_tasks, settings, console, "after_sft", "after SFT")
            result.success_after_sft, result.held_out_metrics["after_sft"] = evaluation.success, evaluation.metrics
    result.max_off_policy = settings.max_off_policy
    if settings.max_off_policy > 0 and settings.steps:
        await _train_pipelined(model, play, train_tasks[:needed], settings, config, result, console)
    else:
        await _train_synchronously(model, play, train_tasks, settings, config, result, console)
    evaluation = await _evaluate(model, measure, eval_tasks, settings, console, "after", "after training")
    result.success_after, result.held_out_metrics["after"] = evaluation.success, evaluation.metrics
    if result.sft_loss is not None and result.success_after_sft is None:
        result.success_after_sft = result.success_after
    result.seconds = time.perf_counter() - started
    await model.finish_tracking()  # the trackers' runs end with the example (a later run of the model resumes them)
    result.curve_png = plot_curve(result, model.model_dir / "learning_curve.png")
    (model.model_dir / "learning_result.json").write_text(json.dumps(result.to_json(), indent=1))
    _summary(result, console)
    return result


async def _train_synchronously(model: TrainableModel, play: Play[T], train_tasks: Sequence[T],
                               settings: ExampleSettings, config: TrainConfig, result: LearningResult,
                               console: Console) -> None:
    """``settings.steps`` GRPO steps, each rolling out its ``settings.groups`` tasks, then training on them."""
    for step in range(settings.steps):
        batch = train_tasks[step * settings.groups:(step + 1) * settings.groups]
        t0 = time.perf_counter()
        with console.status(f"step {step + 1}/{settings.steps}: {len(batch)} x {settings.rollouts} rollouts..."):
            groups = await asyncio.gather(*(
                play(task, settings.rollouts, _training_seed(settings, step * settings.groups + k))
                for k, task in enumerate(batch)))
        t1 = time.perf_counter()
        groups = [g for g in groups if g.trajectories]
        with console.status(f"step {step + 1}/{settings.steps}: GRPO step on "
                            f"{sum(len(g.trajectories) for g in groups)} trajectories..."):
            metrics = await model.train(groups, config=config) if groups else {"groups_used": 0}
        stats = _step_stats(step + 1, groups, metrics, planned=len(batch), rollout_seconds=t1 - t0,
                            train_seconds=time.perf_counter() - t1)
        result.steps.append(stats)
        _print_step(console, stats, settings.steps)


def _training_seed(settings: ExampleSettings, index: int) -> int:
    """The sampling seed of the ``index``-th training group (step ``index // groups``, its ``index % groups``-th)."""
    return settings.seed * 1_000_003 + (index // settings.groups) * 101 + index % settings.groups


def _step_stats(step: int, groups: Sequence[TrajectoryGroup], metrics: dict[str, Any], *, planned: int,
                rollout_seconds: float, train_seconds: float) -> StepStats:
    """A step's figures: from the groups it trained on and the metrics ``model.train`` returned."""
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    valid = [t.metrics["valid_tool_calls"] for t in trajectories if "valid_tool_calls" in t.metrics]
    return StepStats(step=step, reward_mean=_mean(rewards),
                     reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                     success=_mean([t.metrics.get("success", 0.0) for t in trajectories]),
                     valid_tool_calls=_mean(valid) if valid else None,
                     groups_used=int(metrics.get("groups_used", 0)), groups=planned,
                     rollout_seconds=rollout_seconds, train_seconds=train_seconds,
                     staleness_max=float(metrics.get("staleness_max", 0.0)),
                     groups_stale=int(metrics.get("groups_stale", 0)))


def _print_step(console: Console, stats: StepStats, steps: int) -> None:
    valid_text = f"{stats.valid_tool_calls:4.0%}" if stats.valid_tool_calls is not None else "   -"
    console.print(f"step {stats.step:>2}/{steps}  reward {stats.reward_mean:+.2f} ± {stats.reward_std:.2f}  "
                  f"success {stats.success:4.0%}  valid calls {valid_text}  groups {stats.groups_used}/{stats.groups}"
                  f"  rollouts {stats.rollout_seconds:3.0f}s  train {stats.train_seconds:3.0f}s", soft_wrap=True)


@dataclass
class _Replacements:
    """Pipelined: rollouts lost (failed, or their group dropped as stale) and the replacements handed out."""

    lost: int = 0
    given: int = 0


async def _train_pipelined(model: TrainableModel, play: Play[T], tasks: Sequence[T], settings: ExampleSettings,
                           config: TrainConfig, result: LearningResult, console: Console) -> None:
    """``settings.steps`` GRPO steps through ``art_core.pipeline(max_off_policy=settings.max_off_policy)``.

    The synchronous loop's tasks in its order, each with its sampling seed; ``settings.groups`` rollouts (groups)
    in flight at once, as many as one synchronous step runs. A rollout that fails, or a group dropped as stale,
    is replaced by a rollout of a training task from the start of the list (a seed of its own), at most
    ``len(tasks)`` times, and only while steps are left to fill: one lost near the end can leave the run a step
    short, which its output says. One progress line per step, as the synchronous loop prints, then the
    pipeline's own (staleness, groups dropped, seconds rolling out and training, overlap).
    """
    m, steps = settings.max_off_policy, settings.steps
    lost = _Replacements()

    def numbered() -> Iterator[tuple[int, T]]:
        yield from enumerate(tasks)
        index = len(tasks)
        while lost.given < min(lost.lost, len(tasks)):  # checked at each pull: only what was lost so far
            lost.given += 1
            yield index, tasks[(index - len(tasks)) % len(tasks)]
            index += 1

    async def play_one(item: tuple[int, T]) -> TrajectoryGroup:
        index, task = item
        try:
            group = await play(task, settings.rollouts, _training_seed(settings, index))
        except Exception:
            lost.lost += 1
            raise  # the pipeline counts it and goes on
        if not group.trajectories:
            lost.lost += 1  # the pipeline refuses an empty group as failed
        return group

    console.print(f"GRPO through the asynchronous pipeline (--max-off-policy {m}): rollouts go on while a step "
                  f"trains; each group trained at most {m} step(s) after the checkpoint that sampled it")
    with console.status(f"pipelined GRPO: step 1/{steps}, {settings.groups} x {settings.rollouts} rollouts "
                        "in flight...") as status:
        def on_step(report: StepReport, groups: list[TrajectoryGroup]) -> None:
            # as the synchronous loop counts them: the wait since the previous step ended, then the step
            stats = _step_stats(len(result.steps) + 1, groups, report.metrics, planned=len(groups),
                                rollout_seconds=report.seconds_wall - report.seconds_train,
                                train_seconds=report.seconds_train)
            lost.lost += stats.groups_stale
            result.steps.append(stats)
            _print_step(console, stats, steps)
            status.update(f"pipelined GRPO: step {min(stats.step + 1, steps)}/{steps}...")

        report = await pipeline(model, numbered(), play_one, steps=steps, groups_per_step=settings.groups,
                                max_off_policy=m, concurrency=settings.groups, config=config, on_step=on_step,
                                log=lambda line: console.print(_pipeline_line(line), markup=False,
                                                               highlight=False, soft_wrap=True))
    result.rollouts_failed = report.rollouts_failed
    if report.rollouts_failed:
        console.print(f"pipeline: {report.rollouts_failed} rollout(s) failed (first: {report.failures[0]!r})",
                      markup=False, highlight=False, soft_wrap=True)
    if len(report.steps) < steps:
        console.print(f"pipeline: ran {len(report.steps)} of {steps} steps: too few groups left after failed "
                      "rollouts and stale groups", soft_wrap=True)


def _pipeline_line(line: str) -> str:
    """The pipeline's progress line under the example's: ``step N: ...`` names the checkpoint served after the step
    (the model's step counter, the warm start's SFT step included), so it says so."""
    head, sep, rest = line.partition(": ")
    if sep and head.startswith("step "):
        return f"        pipeline, checkpoint {head.removeprefix('step ')}: {rest}"
    return f"        pipeline: {line}"


def demonstration_tasks(make_tasks: Callable[..., Sequence[T]], n: int, *, seed: int,
                        held_out: Sequence[T]) -> list[T]:
    """``n`` tasks for demonstrations from ``make_tasks(count, seed=seed)``, none of them a held-out task."""
    return [t for t in make_tasks(2 * n + len(held_out), seed=seed) if t not in held_out][:n]


def graph_at(build_graph: Callable[..., Any], model: TrainableModel, model_name: str, *, temperature: float,
             reward: Callable[..., float] | None = None, recursion_limit: int, timeout: float = 600,
             task_input: Callable[[Any], Any] = dict,
             task_reward: Callable[[Any], Callable[..., float]] | None = None) -> tuple[TrainableGraph, Play[Any]]:
    """An example's graph sampling at ``temperature``, made trainable, and its ``play(task, n, seed)``.

    The examples train at 1.0 (GRPO needs varied runs to compare) and are measured at a lower temperature, near the
    policy's most likely moves: one ``graph_at`` each.

    Args:
        build_graph: the example's ``build_graph(temperature=...)``.
        model: the trainable model; the graph's ``model_name`` calls are routed to it.
        model_name: the model name the graph's chat model asks for.
        temperature: the graph's sampling temperature.
        reward: the reward function of every run (``fn(trajectory, final_state) -> float``).
        recursion_limit: LangGraph's step limit for one run.
        timeout: seconds one run may take.
        task_input: the graph's input for a task (default: a copy of the task, the games' state).
        task_reward: the reward function for a task's runs, where it depends on the task (instead of ``reward``).

    Raises:
        ValueError: neither ``reward`` nor ``task_reward`` given.
    """
    from art_plugins.langgraph import trainable

    if (reward is None) == (task_reward is None):
        raise ValueError("graph_at needs exactly one of reward= (every run) and task_reward= (per task)")
    reward_of = task_reward or (lambda task: reward)
    graph = trainable(build_graph(temperature=temperature), model, model_names=[model_name],
                      recursion_limit=recursion_limit, timeout=timeout)

    async def play(task: Any, n: int, seed: int) -> TrajectoryGroup:
        return await graph.group(task_input(task), n=n, reward=reward_of(task), seed=seed)

    return graph, play


def graph_demonstrations(agent: TrainableGraph, expert: Callable[[], ScriptedExpert],
                         task_input: Callable[[T], Any], task_reward: Callable[[T], Any]) -> Demonstrate[T]:
    """The ``demonstrate`` of a LangGraph example: the same graph in demonstration mode, its trainable model's
    calls answered by a fresh ``expert()`` (served for the batch), one recorded rollout per task, side by side.

    Args:
        agent: the example's ``trainable(graph, model)``.
        expert: makes the scripted teacher (``examples._expert.ScriptedExpert``).
        task_input: the graph's input for a task.
        task_reward: the reward function for a task's run.
    """
    async def demonstrate(tasks: Sequence[T]) -> list[Trajectory]:
        async with expert() as teacher, agent.demonstrations(teacher.teacher) as demo:
            return list(await asyncio.gather(*(demo.rollout(task_input(t), reward=task_reward(t)) for t in tasks)))

    return demonstrate


def _check_demonstrations(demos: int, demonstrate: Demonstrate[T] | None, demo_tasks: Sequence[T],
                          eval_tasks: Sequence[T], name: str) -> None:
    """Refuse a warm start that cannot run, or that would train on held-out tasks, before any work."""
    if demonstrate is None:
        raise ConfigError(f"--demos {demos}: {name} has no teacher for demonstrations; run it without --demos "
                          "(the examples with one say so in examples/README.md)")
    if len(demo_tasks) < demos:
        raise ConfigError(f"--demos {demos} needs {demos} demonstration tasks, got {len(demo_tasks)}")
    held_out = [task for task in demo_tasks if task in eval_tasks]
    if held_out:
        raise ConfigError(f"{len(held_out)} demonstration task(s) are also held-out tasks (first: {held_out[0]!r}): "
                          "draw the demonstration tasks apart from the held-out ones")


def unique_turns(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Each distinct conversation the trajectories hold (every history: a turn, for an agent that prompts afresh
    each turn), as a trajectory of its own, in order of first appearance.

    Two histories are the same when their recorded tokens are, or, unrecorded, their messages and tool schemas
    (tool-call ids aside: they number the calls, and differ between equal turns): the same context answered the
    same way (a scripted teacher is deterministic) teaches nothing a second time, and training it once leaves the
    time to rarer positions. The copies keep their source's reward, metrics and metadata (``demonstration_of``
    names it).
    """
    seen: set[str] = set()
    turns = []
    for trajectory in trajectories:
        for history in trajectory.histories():
            key = _turn_key(history)
            if key in seen:
                continue
            seen.add(key)
            turns.append(Trajectory(messages=history.messages, tools=history.tools, calls=history.calls,
                                    reward=trajectory.reward, metrics=dict(trajectory.metrics),
                                    metadata={**trajectory.metadata, "demonstration_of": trajectory.id}))
    return turns


def _turn_key(history: History) -> str:
    """What makes two histories the same sample (see ``unique_turns``)."""
    if history.calls:
        return json.dumps([[c.prompt_token_ids, c.completion_token_ids] for c in history.calls])
    messages = [m.model_dump(mode="json", exclude_none=True, exclude={"tool_call_id"}) for m in history.messages]
    for message in messages:
        for call in message.get("tool_calls") or []:
            call.pop("id", None)
    return json.dumps([messages, history.tools], sort_keys=True)


async def _warm_start(model: TrainableModel, demonstrate: Demonstrate[T], tasks: Sequence[T], config: SFTConfig,
                      result: LearningResult, console: Console, *, unique: bool = False) -> bool:
    """Collect one demonstration per task, then one SFT step on those that succeeded (with ``unique``: on their
    distinct turns, see ``unique_turns``); one progress line.

    Returns:
        Whether the SFT step ran (not when no demonstration succeeded).
    """
    t0 = time.perf_counter()
    with console.status(f"sft: {len(tasks)} demonstrations from the teacher..."):
        demonstrations = list(await demonstrate(tasks))
    t1 = time.perf_counter()
    # SFT imitates every token it is given: a failed demonstration would teach its mistake.
    good = [t for t in demonstrations if t.metrics.get("success", 0.0) >= 1.0]
    result.demos, result.demos_trained = len(demonstrations), len(good)
    if not good:
        console.print(f"sft: none of the {len(demonstrations)} demonstrations succeeded: no SFT step; "
                      "check the teacher", soft_wrap=True)
        return False
    data = unique_turns(good) if unique else good
    what = f"{len(data)} distinct turns of {len(good)} demonstrations" if unique else f"{len(good)} demonstrations"
    with console.status(f"sft: {config.epochs} epoch(s) on {what}..."):
        metrics = await model.train_sft(data, config=config)
    result.sft_loss = float(metrics["loss"])
    result.sft_seconds = time.perf_counter() - t0
    trained_on = f"trained on their {len(data)} distinct turns" if unique else "trained on"
    console.print(f"sft     demos {len(demonstrations)} ({len(good)} succeeded, {trained_on})  "
                  f"loss {metrics.get('loss_first', result.sft_loss):.3f} -> {metrics.get('loss_last', result.sft_loss):.3f}"
                  f"  epochs {config.epochs}  demos {t1 - t0:3.0f}s  train {time.perf_counter() - t1:3.0f}s",
                  soft_wrap=True)
    return True


# -- output --------------------------------------------------------------------------------------------

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """One character per value, ``▁`` (lowest) to ``█`` (highest)."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(_BARS[round((v - low) / span * (len(_BARS) - 1))] for v in values)


def plot_curve(result: LearningResult, path: Path) -> Path | None:
    """Write the learning curve (training reward with its spread, success per step, held-out before/after).

    Returns:
        The PNG's path, or None when matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never opens a window
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [s.step for s in result.steps]
    mean = [s.reward_mean for s in result.steps]
    std = [s.reward_std for s in result.steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, marker="o", label="training reward (mean)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    label="± 1 std")
    ax.plot(steps, [s.success for s in result.steps], marker=".", linestyle="--", label="training success")
    last = steps[-1] if steps else 1
    ax.scatter([0, last], [result.success_before, result.success_after], color="black", zorder=3,
               label=f"held-out success {result.success_before:.0%} → {result.success_after:.0%}")
    if result.success_after_sft is not None:
        ax.scatter([0], [result.success_after_sft], color="tab:red", marker="s", zorder=3,
                   label=f"held-out success after SFT on {result.demos_trained} demos: {result.success_after_sft:.0%}")
    ax.set_xlabel("GRPO step")
    ax.set_title(result.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _summary(result: LearningResult, console: Console) -> None:
    delta = result.success_after - result.success_before
    console.print(f"\n[bold]{result.name}[/]: held-out success {result.success_before:.1%} -> "
                  f"{result.success_after:.1%} ({delta * 100:+.1f} points) in {result.seconds / 60:.1f} min")
    if result.success_after_sft is not None:
        then_grpo = f", then GRPO -> {result.success_after:.1%}" if result.steps else " (no GRPO step)"
        console.print(f"SFT warm start on {result.demos_trained} demonstrations: held-out success "
                      f"{result.success_before:.1%} -> {result.success_after_sft:.1%}{then_grpo}")
    if result.steps:
        console.print(f"training reward per step  {sparkline(result.rewards)}  "
                      f"({result.rewards[0]:+.2f} -> {result.rewards[-1]:+.2f})")
    if result.model_dir is not None:
        written = [("checkpoints:  ", "checkpoints", ""),
                   ("trajectories: ", "trajectories", "  (one JSONL file per step)"),
                   ("held-out runs:", "evaluations", "  (one JSONL file per evaluation)"),
                   ("result:       ", "learning_result.json", "")]
        for label, name, note in written:  # only what this run wrote: no checkpoint folder when no step trained
            if (result.model_dir / name).exists():
                console.print(f"{label} {result.model_dir / name}{note}")
    if result.curve_png is not None:
        console.print(f"learning curve: {result.curve_png}")
