"""Each example runs end to end: one tiny GRPO step on the tiny random model, held-out evaluation included.

The tiny model's answers are noise, so these tests check the plumbing (the agent runs on the gateway,
trajectories reach the trainer and the disk, the curve and the result file are written), not learning:
``tests/test_learning.py`` and ``tests/benchmarks/learning.py`` measure that on the embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_core import read_groups_jsonl
from examples._common import ExampleSettings, sparkline

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tiny(model_dir: Path, path: Path, **more) -> ExampleSettings:
    return ExampleSettings(base_model=str(model_dir), steps=1, groups=1, rollouts=2, held_out=1, eval_rollouts=1,
                           path=path, **more)


def check_run(result, steps: int = 1) -> None:
    assert len(result.steps) == steps
    assert 0.0 <= result.success_before <= 1.0 and 0.0 <= result.success_after <= 1.0
    assert list((result.model_dir / "trajectories").glob("*.jsonl")), "the step's trajectories were not written"
    saved = json.loads((result.model_dir / "learning_result.json").read_text())
    assert saved["success_after"] == result.success_after
    assert {"before", "after"} <= set(saved["held_out_metrics"])  # the held-out runs' metric means
    for evaluation in ("before", "after"):  # and the runs behind them, on disk
        groups = read_groups_jsonl(result.model_dir / "evaluations" / f"{evaluation}.jsonl")
        runs = [t for g in groups for t in g.trajectories]
        assert runs and all(t.messages for t in runs)
        won = sum(t.metrics.get("success", 0.0) >= 1.0 for t in runs)
        tried = sum(len(g.trajectories) + len(g.exceptions) for g in groups)  # a failed run counts as lost
        assert won / tried == pytest.approx(saved[f"success_{evaluation}"])
    assert result.curve_png is not None and result.curve_png.stat().st_size > 1000


def _history(result) -> list[dict]:
    """The rows of the run's ``history.jsonl``, one per step."""
    return [json.loads(line) for line in (result.model_dir / "history.jsonl").read_text().splitlines()]


def _demonstrations(result):
    """The one group of step 1's trajectories: the warm start's demonstrations."""
    (group,) = read_groups_jsonl(result.model_dir / "trajectories" / "0001.jsonl")
    return group


async def test_langgraph_tools(tiny_model_dir, tmp_path):
    from examples import langgraph_tools

    result = await langgraph_tools.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_langgraph_tools_warm_starts_with_sft_on_the_experts_demonstrations(tiny_model_dir, tmp_path):
    """``--demos 2``: two runs of the unchanged graph answered by the scripted expert, one SFT step on them (the
    model's step 1, ``kind: "sft"``), then the GRPO step on the same adapter."""
    from examples import langgraph_tools
    from examples._common import parse_settings
    from examples.langgraph_tools.agent import make_tasks

    settings = parse_settings("calculator", tiny(tiny_model_dir, tmp_path), ["--demos", "2", "--steps", "1"])
    assert (settings.demos, settings.steps) == (2, 1)
    result = await langgraph_tools.run(settings)
    check_run(result)
    assert (result.demos, result.demos_trained) == (2, 2)  # the expert gets every question right
    assert result.sft_loss is not None and result.sft_loss > 0 and result.sft_seconds > 0
    assert result.success_after_sft is not None and 0.0 <= result.success_after_sft <= 1.0
    saved = json.loads((result.model_dir / "learning_result.json").read_text())
    assert (saved["demos_trained"], saved["sft_loss"]) == (2, result.sft_loss)
    history = _history(result)
    assert (history[0]["kind"], history[0]["step"]) == ("sft", 1)
    # The GRPO step on the same adapter: step 2, or still 1 when the tiny model's rollouts all tied (dropped).
    assert [row["kind"] for row in history] == ["sft", "grpo"]
    assert history[1]["step"] == 1 + int(history[1]["trained"])

    # What the SFT step trained on, as written before it: the expert's runs of the demonstration questions.
    questions = langgraph_tools.demonstration_tasks(2, seed=settings.seed + 20_000,
                                                    held_out=make_tasks(settings.held_out, seed=settings.seed + 10_000))
    group = _demonstrations(result)
    assert len(group.trajectories) == 2
    for task, demo in zip(questions, group.trajectories):
        assert demo.metadata["demonstration"] is True and "calculator-expert" in demo.metadata["teacher"]
        assert demo.calls == [] and demo.metrics["success"] == 1.0
        roles = [m.role for m in demo.messages]
        assert roles[-4:] == ["user", "assistant", "tool", "assistant"], roles
        assert demo.messages[-4].text() == task.question
        call = demo.messages[-3].tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (task.tool, {"a": task.a, "b": task.b})
        assert demo.messages[-1].text() == f"{task.a} {task.operation} {task.b} is {task.answer}."


def test_demos_flag_is_refused_where_an_example_has_no_teacher_or_a_bad_count(tmp_path, capsys):
    from examples._common import parse_settings

    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--demos", "-1"])
    assert "--demos must be at least 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--sft-epochs", "0"])
    assert "--sft-epochs must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "judged", "message"), [
    (["--judge", "local"], False, "--judge local: this example scores its runs with a reward of its own"),
    (["--learning-rate", "0"], True, "--learning-rate must be positive, got 0.0"),
    (["--demos", "2"], True, "--demos 2: this example has no teacher"),
])
def test_flags_an_example_could_not_honour_are_refused_at_parse_time(tmp_path, capsys, argv, judged, message):
    """A judge the example's reward would never ask (it ran as if judged), a learning rate AdamW refuses (after
    the model had loaded), demonstrations without a teacher (idem): refused before anything loads."""
    from examples._common import parse_settings

    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), argv, judged=judged, teacher=False)
    assert message in capsys.readouterr().err
    assert parse_settings("x", ExampleSettings(path=tmp_path), ["--judge", "local"], judged=True).judge == "local"


def test_an_example_on_the_command_line_ends_an_error_of_ours_in_one_line(tmp_path):
    """``python -m examples.<name>`` with a base model that does not exist: the error's text, no traceback."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "examples.langgraph_tools", "--base-model", str(tmp_path / "none"),
                          "--path", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("error: base model") and "Traceback" not in out.stderr, out.stderr


async def test_an_example_without_a_teacher_refuses_demos_before_any_work(tmp_path):
    from art_core import TrainableModel
    from art_core.errors import ConfigError
    from examples._common import learn

    async def play(task, n, seed):  # never reached: the settings are refused first
        raise AssertionError("learn() ran a rollout before checking its settings")

    model = TrainableModel(name="no-teacher", project="examples", base_model="unused")
    settings = ExampleSettings(path=tmp_path, steps=0, demos=2)
    with pytest.raises(ConfigError, match="--demos 2: no-teacher has no teacher for demonstrations"):
        await learn(model, play, train_tasks=[], eval_tasks=[1, 2], settings=settings)

    async def demonstrate(tasks):
        raise AssertionError("learn() collected demonstrations before checking its settings")

    with pytest.raises(ConfigError, match=r"1 demonstration task\(s\) are also held-out tasks \(first: 2\)"):
        await learn(model, play, train_tasks=[], eval_tasks=[1, 2], settings=settings, demonstrate=demonstrate,
                    demo_tasks=[2, 3])


async def test_an_example_reports_to_the_trackers_report_to_names(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from examples import tic_tac_toe
    from examples._common import parse_settings

    settings = parse_settings("tic-tac-toe", tiny(tiny_model_dir, tmp_path), ["--report-to", "tensorboard"])
    assert settings.report_to == ("tensorboard",)
    result = await tic_tac_toe.run(settings)
    check_run(result)
    (run_dir,) = (result.model_dir / "tracking" / "tensorboard").iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    # One report, at the model's step after the call (0 when the tiny model's rollouts all scored alike)
    history = _history(result)
    assert [e.step for e in accumulator.Tensors("train/reward_mean")] == [history[-1]["step"]]
    assert len(accumulator.Tensors("rollout/success_mean")) == 1


async def test_langgraph_tools_pipelined_with_max_off_policy_1(tiny_model_dir, tmp_path, capsys):
    """``--max-off-policy 1 --steps 2``: the GRPO steps through ``art_core.pipeline`` on a backend that serves during
    steps (separate-module layout); the same per-step lines, ``learning_result.json`` rows and ``history.jsonl``."""
    from examples import langgraph_tools
    from examples._common import open_backend, parse_settings

    settings = parse_settings("calculator", tiny(tiny_model_dir, tmp_path), ["--max-off-policy", "1", "--steps", "2"])
    assert (settings.max_off_policy, settings.steps) == (1, 2)
    backend = open_backend(settings)  # what run() opens: nothing is loaded before register()
    assert backend.pause_during_step is False and backend.transformers.separate_module is True
    result = await langgraph_tools.run(settings)
    check_run(result, steps=2)
    assert [s.step for s in result.steps] == [1, 2] and result.max_off_policy == 1
    assert all(s.groups == 1 and s.staleness_max <= 1 and s.groups_stale == 0 for s in result.steps)
    saved = json.loads((result.model_dir / "learning_result.json").read_text())
    assert saved["max_off_policy"] == 1
    assert [(row["step"], row["reward_mean"]) for row in saved["steps"]] == [(s.step, s.reward_mean)
                                                                          for s in result.steps]
    history = _history(result)
    assert len(history) == 2 and {row["kind"] for row in history} == {"grpo"}
    out = capsys.readouterr().out
    assert "asynchronous pipeline (--max-off-policy 1)" in out
    assert "step  1/2  reward" in out and "step  2/2  reward" in out  # the synchronous loop's lines
    assert out.count("pipeline, checkpoint ") == 2 and "staleness mean" in out  # and the pipeline's, one per step
    # The default stays the synchronous loop, on the default backend.
    default = open_backend(tiny(tiny_model_dir, tmp_path))
    assert default.pause_during_step is True and default.transformers.separate_module is False


class _FakeModel:
    """Just what ``learn`` and ``pipeline`` use of a model: ``train`` records the groups of each step."""

    name = "fake"

    def __init__(self, model_dir: Path) -> None:
        self.model_dir, self.step, self.trained = model_dir, 0, []

    async def train(self, groups, *, config=None):
        self.trained.append((config.max_off_policy, [(g.trajectories[0].metadata["task"],
                                                       g.trajectories[0].metadata["seed"]) for g in groups]))
        self.step += 1
        return {"groups_used": len(groups), "staleness_max": 0.0, "groups_stale": 0.0}

    async def prepare_training(self, config=None) -> None:
        pass  # nothing to prepare: there is no trainer

    async def finish_tracking(self) -> None:
        pass


async def _learn_with_a_fake_model(tmp_path: Path, max_off_policy: int, fail_first: bool = False):
    """``learn`` on tasks "t0".."t5" (3 steps x 2 groups), no backend: which (task, seed) each step trained on."""
    from art_core import Trajectory, TrajectoryGroup
    from examples._common import learn

    played: list[tuple[str, int]] = []

    async def play(task, n, seed):
        if fail_first and not played:
            played.append((task, seed))
            raise RuntimeError("the first rollout fails")
        played.append((task, seed))
        return TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": task}], reward=float(k),
                                           metrics={"success": 1.0}, metadata={"task": task, "seed": seed})
                                for k in range(n)])

    async def measure(task, n, seed):
        return TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": task}], reward=0.0)
                                for _ in range(n)])

    model = _FakeModel(tmp_path / f"fake-{max_off_policy}")
    settings = ExampleSettings(path=tmp_path, steps=3, groups=2, rollouts=2, held_out=1, eval_rollouts=1,
                               max_off_policy=max_off_policy)
    result = await learn(model, play, measure=measure, train_tasks=[f"t{i}" for i in range(6)], eval_tasks=["e"],
                         settings=settings)
    return model, result


async def test_pipelined_steps_train_the_synchronous_loops_tasks_and_seeds_and_replace_a_failed_rollout(tmp_path):
    """``--max-off-policy 1``: the same 3 steps of 2 groups, tasks and sampling seeds as the synchronous loop (each
    step's groups in the order they finished); a rollout that raises is replaced, so no step is lost."""
    sync_model, sync = await _learn_with_a_fake_model(tmp_path, 0)
    assert [bound for bound, _ in sync_model.trained] == [None, None, None]  # the TrainConfig as given
    pipe_model, piped = await _learn_with_a_fake_model(tmp_path, 1)
    assert [bound for bound, _ in pipe_model.trained] == [1, 1, 1]
    assert [sorted(step) for _, step in pipe_model.trained] == [sorted(step) for _, step in sync_model.trained]
    assert [s.step for s in piped.steps] == [1, 2, 3] and piped.rewards == sync.rewards
    assert (piped.max_off_policy, piped.rollouts_failed, sync.max_off_policy) == (1, 0, 0)

    failing_model, failing = await _learn_with_a_fake_model(tmp_path, 1, fail_first=True)
    assert len(failing.steps) == 3 and failing.rollouts_failed == 1
    tasks = [task for _, step in failing_model.trained for task, _ in step]
    assert sorted(tasks) == ["t0", "t1", "t2", "t3", "t4", "t5"]  # t0's failed rollout replaced by t0 again
    trained = dict(pair for _, step in failing_model.trained for pair in step)
    synchronous = dict(pair for _, step in sync_model.trained for pair in step)
    assert trained["t0"] != synchronous["t0"]  # the replacement samples with a seed of its own
    assert {task: seed for task, seed in trained.items() if task != "t0"} == {
        task: seed for task, seed in synchronous.items() if task != "t0"}


def test_max_off_policy_flag_refuses_a_negative_bound(tmp_path, capsys):
    from examples._common import parse_settings

    assert parse_settings("x", ExampleSettings(path=tmp_path), []).max_off_policy == 0
    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--max-off-policy", "-1"])
    assert "--max-off-policy must be at least 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--max-off-policy", "one"])
    assert "invalid int value: 'one'" in capsys.readouterr().err


def test_report_to_flag_takes_several_trackers_and_refuses_unknown_ones(tmp_path, capsys):
    from examples._common import parse_settings

    settings = parse_settings("x", ExampleSettings(path=tmp_path), ["--report-to", "tensorboard", "mlflow"])
    assert settings.report_to == ("tensorboard", "mlflow")
    assert parse_settings("x", ExampleSettings(path=tmp_path), []).report_to == ()
    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--report-to", "comet"])
    assert "invalid choice: 'comet'" in capsys.readouterr().err


def test_sparkline_spans_lowest_to_highest():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([]) == ""


async def test_tic_tac_toe(tiny_model_dir, tmp_path):
    from examples import tic_tac_toe

    result = await tic_tac_toe.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)
    for when in ("before", "after"):  # the share of held-out games that ended on an invalid move
        assert 0.0 <= result.held_out_metrics[when]["invalid_move"] <= 1.0


async def test_tic_tac_toe_warm_starts_with_sft_on_the_experts_games(tiny_model_dir, tmp_path):
    """``--demos 2``: two games of the unchanged graph with the scripted expert's moves, the won ones trained on."""
    from examples import tic_tac_toe
    from examples._common import parse_settings
    from examples.tic_tac_toe.expert import best_move, parse_board

    result = await tic_tac_toe.run(parse_settings("tic-tac-toe", tiny(tiny_model_dir, tmp_path), ["--demos", "2"]))
    check_run(result)
    assert result.demos == 2 and result.demos_trained >= 1 and result.sft_loss is not None
    history = _history(result)
    assert (history[0]["kind"], history[0]["step"]) == ("sft", 1)
    group = _demonstrations(result)
    assert len(group.trajectories) == result.demos_trained
    for game in group.trajectories:
        assert game.metadata["demonstration"] is True and game.metrics["success"] == 1.0
        for turn in game.histories():  # one per move: the board it saw, the expert's move on it
            board = parse_board(next(m for m in turn.messages if m.role == "user").text())
            args = json.loads(turn.messages[-1].tool_calls[0].function.arguments)
            assert args["cell"] - 1 == best_move(board)


async def test_tic_tac_toe_sft_on_unique_turns_trains_each_distinct_position_once(tiny_model_dir, tmp_path):
    """``--demos 4 --sft-unique-turns``: the SFT step's data (on disk) is the games' distinct turns, one each."""
    from examples import tic_tac_toe
    from examples._common import parse_settings
    from examples.tic_tac_toe.expert import best_move, parse_board

    settings = parse_settings("tic-tac-toe", tiny(tiny_model_dir, tmp_path),
                              ["--demos", "4", "--sft-unique-turns", "--sft-batch-size", "3", "--steps", "0"])
    result = await tic_tac_toe.run(settings)
    check_run(result, steps=0)
    turns = _demonstrations(result).trajectories
    boards = [next(m for m in t.messages if m.role == "user").text() for t in turns]
    assert len(set(boards)) == len(boards) >= 3  # 4 games of 3+ moves each, none repeated
    for turn, board in zip(turns, boards, strict=True):
        assert turn.additional_histories == [] and turn.metadata["demonstration_of"]
        assert json.loads(turn.messages[-1].tool_calls[0].function.arguments)["cell"] - 1 == best_move(parse_board(board))


def test_unique_turns_splits_histories_and_drops_repeats_whatever_their_call_ids():
    from art_core import History, Message, Trajectory
    from examples._common import unique_turns

    def turn(board: str, cell: int, call_id: str) -> list[Message]:
        call = {"id": call_id, "type": "function", "function": {"name": "make_move", "arguments": f'{{"cell": {cell}}}'}}
        return [Message(role="user", content=board), Message(role="assistant", tool_calls=[call])]

    game_1 = Trajectory(messages=turn("empty", 5, "call_1"), reward=1.0,
                        additional_histories=[History(messages=turn("O in 1", 5, "call_2"))])
    game_2 = Trajectory(messages=turn("empty", 5, "call_3"), reward=1.0,  # the same opening, another call id
                        additional_histories=[History(messages=turn("O in 1", 9, "call_4"))])  # another reply
    turns = unique_turns([game_1, game_2])
    assert [(t.messages[0].content, t.messages[1].tool_calls[0].id) for t in turns] == [
        ("empty", "call_1"), ("O in 1", "call_2"), ("O in 1", "call_4")]
    assert [t.metadata["demonstration_of"] for t in turns] == [game_1.id, game_1.id, game_2.id]
    assert all(t.reward == 1.0 and not t.additional_histories for t in turns)


async def test_game_2048(tiny_model_dir, tmp_path):
    from examples import game_2048

    result = await game_2048.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_game_2048_warm_starts_with_sft_on_expectimax_games(tiny_model_dir, tmp_path):
    """``--demos 2 --steps 0``: two games of the unchanged graph with the expectimax expert's moves, one SFT step on
    the won ones, no GRPO step."""
    from examples import game_2048
    from examples._common import parse_settings
    from examples.game_2048.agent import moves_that_change
    from examples.game_2048.expert import best_direction, parse_board

    settings = parse_settings("2048", tiny(tiny_model_dir, tmp_path), ["--demos", "2", "--steps", "0"])
    result = await game_2048.run(settings)
    check_run(result, steps=0)
    assert result.demos == 2 and result.demos_trained >= 1 and result.sft_loss is not None and result.sft_loss > 0
    history = _history(result)
    assert [(row["kind"], row["step"]) for row in history] == [("sft", 1)]
    group = _demonstrations(result)
    assert len(group.trajectories) == result.demos_trained
    offered = []
    for game in group.trajectories:
        assert game.metadata["demonstration"] is True and game.metrics["success"] == 1.0 and game.reward == 1.0
        for turn in game.histories():  # one per move: the board it saw, the expert's move on it
            board = parse_board(next(m for m in turn.messages if m.role == "user").text())
            call = turn.messages[-1].tool_calls[0]
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "move", {"direction": best_direction(board)})
            (tool,) = turn.tools  # the move tool as offered on that board: only the moves that change it
            offered.append(tool["function"]["parameters"]["properties"]["direction"]["enum"])
            assert offered[-1] == moves_that_change(board)
    assert min(map(len, offered)) < 4, "no turn had a move that changes nothing: the narrowing went untested"


def test_2048_slides_and_merges_once():
    from examples.game_2048.agent import slide

    board = [[2, 2, 2], [4, 0, 4], [0, 0, 2]]
    assert slide(board, "left") == [[4, 2, 0], [8, 0, 0], [2, 0, 0]]
    assert slide(board, "right") == [[0, 2, 4], [0, 0, 8], [0, 0, 2]]
    assert slide(board, "up") == board  # nothing can move up: a wasted move
    assert slide([[2, 0, 0], [2, 0, 0], [4, 0, 0]], "up") == [[4, 0, 0], [4, 0, 0], [0, 0, 0]]
    assert slide([[2, 0, 0], [2, 0, 0], [4, 0, 0]], "down") == [[0, 0, 0], [4, 0, 0], [4, 0, 0]]


def test_2048_offers_and_previews_only_the_moves_that_change_the_board_and_the_expert_still_reads_it():
    from examples.game_2048.agent import move_schema, preview, render
    from examples.game_2048.expert import parse_board

    board = [[2, 2, 4], [0, 0, 0], [0, 0, 0]]
    assert preview(board) == "left: merges 1\nright: merges 1\ndown: merges 0"  # up changes nothing
    parameters = move_schema(board)["function"]["parameters"]
    assert parameters["properties"]["direction"]["enum"] == ["left", "right", "down"]
    assert parameters["additionalProperties"] is False and parameters["required"] == ["direction"]
    assert parse_board(f"Board:\n{render(board)}\n{preview(board)}\nYour move?") == board


def test_tic_tac_toe_rewards_follow_the_outcome():
    from art_core import Trajectory
    from examples.tic_tac_toe.agent import reward, winner

    assert winner(list("XXX.O.O..")) == "X" and winner(list("XO.OX...X")) == "X" and winner(list(".........")) is None
    scores = {outcome: reward(Trajectory(messages=[{"role": "user", "content": "?"}]), {"outcome": outcome, "turn": 2})
              for outcome in ("win", "draw", "loss", "invalid")}
    assert scores == {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": pytest.approx(-0.6)}  # 2 valid moves first
    invalid = [reward(Trajectory(messages=[{"role": "user", "content": "?"}]), {"outcome": "invalid", "turn": turn})
               for turn in range(5)]
    assert invalid[0] == -1.0 and invalid == sorted(invalid) and invalid[-1] < scores["loss"]


def test_tic_tac_toe_shows_empty_cells_by_number_and_the_expert_reads_them_back():
    from examples.tic_tac_toe.agent import _cell, observe, render
    from examples.tic_tac_toe.expert import parse_board

    board = list("X...O...X")
    assert render(board) == "X 2 3\n4 O 6\n7 8 X"
    assert parse_board(observe(board)) == board
    assert [_cell({"cell": 3}), _cell({"cell": 0}), _cell({"cell": 10}), _cell({"cell": True}), _cell({})] == \
        [2, None, None, None, None]


def test_tic_tac_toe_names_the_cells_that_win_now_and_those_that_block_o():
    from examples.tic_tac_toe.agent import completing_cells, observe
    from examples.tic_tac_toe.expert import best_move

    assert observe(list("X.XOO....")) == "Board:\nX 2 X\nO O 6\n7 8 9\nWins now: 2\nBlocks O: 6\nYour move?"
    assert observe(list("....X....")).splitlines()[-3:-1] == ["Wins now: none", "Blocks O: none"]
    board = list("XO.XO.O.X")  # every X line holds an O; O has two: the 3-5-7 diagonal and the middle column
    assert (completing_cells(board, "X"), completing_cells(board, "O")) == ([], [2, 7])
    assert observe(board).splitlines()[-3:-1] == ["Wins now: none", "Blocks O: 3, 8"]
    board = list("XX.OO.X.O")  # both threaten: X wins at 3, O at 6; the expert wins rather than blocks
    assert (completing_cells(board, "X"), completing_cells(board, "O")) == ([2], [5]) and best_move(board) == 2


async def test_agents_sdk_support(tiny_model_dir, tmp_path):
    from examples import agents_sdk_support

    result = await agents_sdk_support.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_agents_sdk_support_warm_starts_with_sft_on_the_experts_runs(tiny_model_dir, tmp_path):
    """``--demos 2 --steps 0``: two runs of the unchanged agents by ``TrainableRunner.demonstrations``, the expert
    handing off, looking up and answering with the structured output; one SFT step on them, no GRPO step."""
    from examples import agents_sdk_support
    from examples._common import parse_settings

    settings = parse_settings("support", tiny(tiny_model_dir, tmp_path), ["--demos", "2", "--steps", "0"])
    result = await agents_sdk_support.run(settings)
    check_run(result, steps=0)
    assert (result.demos, result.demos_trained) == (2, 2) and result.sft_loss is not None and result.sft_loss > 0
    history = _history(result)
    assert [(row["kind"], row["step"]) for row in history] == [("sft", 1)]
    group = _demonstrations(result)
    # make_tasks alternates: the first demonstration is an invoice question, the second a service question.
    for run, (handoff, lookup, department) in zip(group.trajectories, [
            ("transfer_to_billing", "invoice_total", "billing"), ("transfer_to_technical", "service_status",
                                                                    "technical")]):
        assert run.metadata["demonstration"] is True and "support-expert" in run.metadata["teacher"]
        assert run.metrics["success"] == 1.0 and run.reward == 1.0
        calls = [c.function.name for h in run.histories() for m in h.messages for c in m.tool_calls or []]
        assert handoff in calls and lookup in calls, calls
        assert json.loads(run.messages[-1].text())["department"] == department


async def test_ruler_only(tiny_model_dir, tmp_path):
    from examples import ruler_only

    result = await ruler_only.run(tiny(tiny_model_dir, tmp_path, judge="local"))
    check_run(result)
    trained = (result.model_dir / "trajectories" / "0001.jsonl").read_text()
    assert "ruler_score" in trained  # the rewards came from the judge


async def test_email_search(tiny_model_dir, tmp_path):
    """The graph runs through the real adapter; held-out runs use the hand reward, training RULER (local judge)."""
    from examples import email_search

    result = await email_search.run(tiny(tiny_model_dir, tmp_path, judge="local"))
    check_run(result)
    trained = [json.loads(line) for line in (result.model_dir / "trajectories" / "0001.jsonl").read_text().splitlines()]
    text = json.dumps(trained)
    assert "ruler_score" in text  # the training rewards came from the judge
    assert '"found"' in text and "search_inbox" in text  # the hand marks were recorded; the first call searched


async def test_email_search_warm_starts_with_sft_on_the_experts_runs(tiny_model_dir, tmp_path):
    """``--demos 2 --steps 0``: two runs of the unchanged graph answered by the expert (search, read the source,
    answer citing it), one SFT step on them, no GRPO step."""
    from examples import email_search
    from examples._common import parse_settings
    from examples.email_search.mailbox import Mailbox

    settings = parse_settings("email", tiny(tiny_model_dir, tmp_path), ["--demos", "2", "--steps", "0"])
    result = await email_search.run(settings)
    check_run(result, steps=0)
    assert (result.demos, result.demos_trained) == (2, 2) and result.sft_loss is not None and result.sft_loss > 0
    history = _history(result)
    assert [(row["kind"], row["step"]) for row in history] == [("sft", 1)]
    mailbox = Mailbox(seed=settings.seed)
    questions = email_search.demonstration_questions(mailbox, 2, train=0, held_out=settings.held_out)
    group = _demonstrations(result)
    for question, run in zip(questions, group.trajectories, strict=True):
        assert run.metadata["demonstration"] is True and run.metrics["success"] == 1.0
        assert run.reward == pytest.approx(1.0)  # every mark: found, read, cited, answered
        calls = [(c.function.name, json.loads(c.function.arguments)) for m in run.messages
                 for c in m.tool_calls or [] if c.id.startswith("call_expert_")]  # not the worked exchange's
        assert [name for name, _ in calls] == ["search_inbox", "read_email", "return_answer"]
        assert calls[2][1] == {"answer": question.answer, "source_id": question.source_id}


def test_the_summary_names_only_what_the_run_wrote(tmp_path):
    """A run that trained no step (``--steps 0``, or every group dropped) names no checkpoints folder; the
    result file it wrote is named."""
    from rich.console import Console

    from examples._common import LearningResult, _summary

    (tmp_path / "evaluations").mkdir()
    (tmp_path / "learning_result.json").write_text("{}")
    console = Console(record=True, width=200)
    _summary(LearningResult(name="x", success_before=0.1, success_after=0.1, model_dir=tmp_path), console)
    text = console.export_text()
    assert "checkpoints:" not in text and "trajectories:" not in text
    assert f"held-out runs: {tmp_path / 'evaluations'}" in text and f"{tmp_path / 'learning_result.json'}" in text
