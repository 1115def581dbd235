"""The 2048 player's scripted expert: the teacher of ``--demos`` (see ``examples._expert``).

It stands in for a strong hosted model (a scripted expert): it reads the board from the conversation's last user
message and calls ``move`` in the direction a two-move expectimax over the example's own rules (``agent.slide``,
new tiles a 2 nine times in ten, else a 4) rates best. A position is rated by the sum of its tiles' squares (a
merge doubles that part of it, so the larger the merged tiles the better) plus a bonus per empty cell (room to
move), and a move that changes nothing is never chosen. The spawns' randomness is averaged over, not known: the
expert sees only the board, as the trainable model does.
"""

from __future__ import annotations

import re
from typing import Any

from .._expert import ScriptedExpert, ToolCall, message_text
from .agent import SIZE, slide

__all__ = ["EXPERT_NAME", "DIRECTIONS", "best_direction", "expectimax_expert", "expectimax_policy", "parse_board"]

EXPERT_NAME = "expectimax-expert"
DIRECTIONS = ("left", "right", "up", "down")
"""The ``move`` tool's directions, in the order a tie is broken."""

EMPTY_BONUS = 8
"""What an empty cell is worth, next to a tile's square (a merge of two 2s gains 8, of two 4s 32)."""

_ROW = re.compile(r"^\s*((?:(?:\d+|\.)\s+){%d}(?:\d+|\.))\s*$" % (SIZE - 1), re.MULTILINE)

Board = list[list[int]]


def parse_board(text: str) -> Board:
    """The board drawn in ``text`` (``SIZE`` rows of numbers or ``.``, as ``agent.render`` draws them).

    Raises:
        ValueError: the text holds no ``SIZE`` x ``SIZE`` board.
    """
    rows = _ROW.findall(text)
    if len(rows) != SIZE:
        raise ValueError(f"no {SIZE} x {SIZE} board of numbers and '.' in {text[:120]!r}")
    return [[0 if cell == "." else int(cell) for cell in row.split()] for row in rows]


def _rating(board: Board) -> float:
    return sum(t * t for row in board for t in row) + EMPTY_BONUS * sum(not t for row in board for t in row)


def _after_spawn(board: Board, depth: int) -> float:
    """The expected rating once a tile lands on a random empty cell (2 or 4), then ``depth`` more moves."""
    empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if not board[r][c]]
    if not empty:
        return _best(board, depth)[1]
    total = 0.0
    for r, c in empty:
        for tile, chance in ((2, 0.9), (4, 0.1)):
            spawned = [row[:] for row in board]
            spawned[r][c] = tile
            total += chance * _best(spawned, depth)[1]
    return total / len(empty)


def _best(board: Board, depth: int) -> tuple[str | None, float]:
    """The best direction and its expected rating, looking ``depth`` moves ahead (``None`` when stuck)."""
    if depth == 0:
        return None, _rating(board)
    best: tuple[str | None, float] = (None, _rating(board))
    for direction in DIRECTIONS:
        moved = slide(board, direction)
        if moved == board:
            continue  # a wasted move
        value = _after_spawn(moved, depth - 1)
        if best[0] is None or value > best[1]:
            best = (direction, value)
    return best


def best_direction(board: Board, *, depth: int = 2) -> str:
    """The direction the expectimax picks, looking ``depth`` moves ahead (the first of ``DIRECTIONS`` on a tie).

    Raises:
        ValueError: no move changes the board (the game is stuck).
    """
    direction, _ = _best(board, depth)
    if direction is None:
        raise ValueError(f"no move changes the board {board}: the game is over")
    return direction


def expectimax_policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ToolCall:
    """``move`` in the expectimax's direction for the board of the last user message.

    Raises:
        ValueError: no user message draws a board, or no move changes it.
    """
    asked = [m for m in messages if m.get("role") == "user"]
    if not asked:
        raise ValueError("the conversation has no user message")
    return ToolCall("move", {"direction": best_direction(parse_board(message_text(asked[-1])))})


def expectimax_expert() -> ScriptedExpert:
    """The expert, to serve with ``async with expectimax_expert() as expert:``."""
    return ScriptedExpert(expectimax_policy, name=EXPERT_NAME)
