"""The tic-tac-toe player's scripted expert: the teacher of ``--demos`` (see ``examples._expert``).

It stands in for a strong hosted model (a scripted expert): it reads the board from the conversation's last user
message and calls ``make_move`` on the cell minimax picks for X (a win now before a win later, a loss as late as
possible), the move a perfect player makes against any opponent.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from .._expert import ScriptedExpert, ToolCall, message_text
from .agent import winner

__all__ = ["EXPERT_NAME", "best_move", "minimax_expert", "minimax_policy", "parse_board"]

EXPERT_NAME = "minimax-expert"

_ROW = re.compile(r"^\s*([XO.]) ([XO.]) ([XO.])\s*$", re.MULTILINE)


def parse_board(text: str) -> list[str]:
    """The nine cells of the board drawn in ``text`` (three rows of ``X``, ``O`` or ``.``, as ``agent.render``).

    Raises:
        ValueError: the text holds no 3 x 3 board.
    """
    rows = _ROW.findall(text)
    if len(rows) != 3:
        raise ValueError(f"no 3 x 3 board of 'X', 'O' and '.' in {text[:120]!r}")
    return [cell for row in rows for cell in row]


@functools.cache
def _value(board: str, player: str) -> int:
    """Minimax value for X of ``board`` with ``player`` to move: +(10 - moves) for an X win, -(10 - moves) for an
    O win, 0 for a draw (the moves count makes a faster win, and a slower loss, worth more)."""
    won = winner(list(board))
    moves = 9 - board.count(".")
    if won is not None:
        return (10 - moves) * (1 if won == "X" else -1)
    if "." not in board:
        return 0
    other = "O" if player == "X" else "X"
    values = [_value(board[:i] + player + board[i + 1:], other) for i, cell in enumerate(board) if cell == "."]
    return max(values) if player == "X" else min(values)


def best_move(board: list[str]) -> int:
    """The cell (0-8, row by row) minimax picks for X; the first such cell on a tie.

    Raises:
        ValueError: the game is over (a line is complete, or no cell is empty).
    """
    text = "".join(board)
    if winner(board) is not None or "." not in text:
        raise ValueError(f"the game on {text!r} is over: there is no move to make")
    empty = [i for i, cell in enumerate(text) if cell == "."]
    return max(empty, key=lambda i: (_value(text[:i] + "X" + text[i + 1:], "O"), -i))


def minimax_policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ToolCall:
    """``make_move`` on minimax's cell for the board of the last user message.

    Raises:
        ValueError: no user message draws a board, or the game on it is over.
    """
    asked = [m for m in messages if m.get("role") == "user"]
    if not asked:
        raise ValueError("the conversation has no user message")
    cell = best_move(parse_board(message_text(asked[-1])))
    return ToolCall("make_move", {"row": cell // 3 + 1, "col": cell % 3 + 1})


def minimax_expert() -> ScriptedExpert:
    """The expert, to serve with ``async with minimax_expert() as expert:``."""
    return ScriptedExpert(minimax_policy, name=EXPERT_NAME)
