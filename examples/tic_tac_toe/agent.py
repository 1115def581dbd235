"""The agent: a LangGraph loop in which the model plays tic-tac-toe through a ``make_move`` tool.

The graph alternates two nodes until the game ends:

- ``player``: the chat model sees the board, its empty cells drawn as their numbers (1-9, row by row), with the
  cells that win at once and those that block O's three in a row named under it, and must call
  ``make_move(cell)`` (``tool_choice="required"``, so the reply is a well-formed call and the cell is the
  model's choice);
- ``referee``: plain Python. It plays the model's move (an illegal or missing move ends the game), then a
  random opponent's, and decides whether the game is over.

Each turn the player sees a fresh prompt (the rules and the current board), so the context stays short;
the adapter records each turn's context as its own history of the one trajectory.

Reward: win 1, draw 0.5, loss 0; an invalid move (no call, a malformed call, an occupied or off-board cell)
ends the game at -1, plus 0.2 for each valid move before it. Success (held-out): a win.
"""

from __future__ import annotations

import random
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from art_core import Trajectory

__all__ = ["MODEL_NAME", "VALID_MOVE_CREDIT", "build_graph", "completing_cells", "make_tasks", "observe", "reward"]

MODEL_NAME = "tic-tac-toe"
_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
SYSTEM = ("You play tic-tac-toe as X against O. The board shows X, O and the number of each empty cell. Call "
          "make_move with the number of an empty cell. Three X in a row, column or diagonal wins. Under the board: "
          "the cells that win now, and the cells where O would win next (play one to block it).")


@tool
def make_move(cell: int) -> str:
    """Put an X in the empty cell with this number (1-9, as the board shows it)."""
    return f"X in cell {cell}"  # the referee node plays it; this is the schema the model sees


class Game(TypedDict, total=False):
    board: list[str]
    """Nine cells, row by row: ``X``, ``O`` or ``.``."""
    seed: int
    """Seeds the opponent."""
    turn: int
    outcome: str
    """``win``, ``draw``, ``loss`` or ``invalid`` once the game is over."""
    last_reply: Any


def winner(board: list[str]) -> str | None:
    for a, b, c in _LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    """The board as the player sees it: X, O, and each empty cell's number (1-9, row by row).

    A small model picks a legal cell far more often when it can copy a number it sees than when it must turn a
    ``.``'s position into coordinates (SmolLM2-135M after SFT on 56 minimax games: 27 of 32 held-out games ended
    on an occupied cell with ``make_move(row, col)`` and a board of dots).
    """
    cells = [c if c != "." else str(i + 1) for i, c in enumerate(board)]
    return "\n".join(" ".join(cells[r * 3:(r + 1) * 3]) for r in range(3))


def completing_cells(board: list[str], mark: str) -> list[int]:
    """The empty cells (0-8) that would give ``mark`` three in a row (the line's other two cells hold it)."""
    return sorted({cell for line in _LINES for cell in line
                   if board[cell] == "." and sum(board[other] == mark for other in line) == 2})


def observe(board: list[str]) -> str:
    """The player's turn prompt: the board (``render``), then the cells that win now and those that block O.

    A game app highlights these cells; a 135M model does not find them on its own (on the bare board, after SFT on
    the scripted expert's games, it still failed to win about a quarter of its held-out games), while copying a
    number it is shown is easy: a player that takes a winning cell, else a blocking one, else the first empty
    cell, wins 83% of this example's games, and 90% with the centre and corners before the edges.
    """
    def numbers(cells: list[int]) -> str:
        return ", ".join(str(cell + 1) for cell in cells) or "none"

    return (f"Board:\n{render(board)}\nWins now: {numbers(completing_cells(board, 'X'))}\n"
            f"Blocks O: {numbers(completing_cells(board, 'O'))}\nYour move?")


def build_graph(*, base_url: str = "http://127.0.0.1:9/v1", temperature: float = 1.0, max_tokens: int = 48) -> Any:
    """The compiled game loop (``player`` <-> ``referee``)."""
    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", temperature=temperature,
                     max_tokens=max_tokens).bind_tools([make_move], tool_choice="required")

    async def player(game: Game) -> Game:
        return {"last_reply": await llm.ainvoke([SystemMessage(SYSTEM), HumanMessage(observe(game["board"]))])}

    def referee(game: Game) -> Game:
        board, reply = list(game["board"]), game["last_reply"]
        calls = reply.tool_calls if isinstance(reply, AIMessage) else []
        cell = _cell(calls[0]["args"]) if len(calls) == 1 and calls[0]["name"] == "make_move" else None
        if cell is None or board[cell] != ".":
            return {"outcome": "invalid"}
        board[cell] = "X"
        turn = game.get("turn", 0) + 1
        if winner(board) == "X":
            return {"board": board, "turn": turn, "outcome": "win"}
        empty = [i for i, c in enumerate(board) if c == "."]
        if not empty:
            return {"board": board, "turn": turn, "outcome": "draw"}
        board[random.Random(game.get("seed", 0) * 31 + turn).choice(empty)] = "O"
        if winner(board) == "O":
            return {"board": board, "turn": turn, "outcome": "loss"}
        if "." not in board:
            return {"board": board, "turn": turn, "outcome": "draw"}
        return {"board": board, "turn": turn}

    graph = StateGraph(Game)
    graph.add_node("player", player)
    graph.add_node("referee", referee)
    graph.add_edge(START, "player")
    graph.add_edge("player", "referee")
    graph.add_conditional_edges("referee", lambda game: END if game.get("outcome") else "player")
    return graph.compile()


def _cell(args: dict[str, Any]) -> int | None:
    """The board index (0-8) of a ``make_move`` call's cell, or None when it names no cell."""
    cell = args.get("cell")
    if not isinstance(cell, int) or isinstance(cell, bool) or not 1 <= cell <= 9:
        return None
    return cell - 1


def make_tasks(n: int, *, seed: int) -> list[dict[str, Any]]:
    """``n`` games: an empty board, or (every other game) one where O has opened, each with its opponent's seed."""
    rng = random.Random(seed)
    games = []
    for k in range(n):
        board = ["."] * 9
        if k % 2:
            board[rng.randrange(9)] = "O"
        games.append({"board": board, "seed": rng.randrange(1 << 30), "turn": 0})
    return games


_REWARDS = {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": -1.0}
VALID_MOVE_CREDIT = 0.2
"""Partial credit for each valid move made before an invalid one: a game that goes wrong on its fourth move
(-0.4) beats one that goes wrong on its first (-1.0), so a group whose games all end invalid still has a
gradient; even four valid moves (-0.2) stay below a loss (0)."""


def reward(trajectory: Trajectory, game: Game | None) -> float:
    """Win 1, draw 0.5, loss 0 (also a game cut short by the step limit); an invalid move -1 plus
    ``VALID_MOVE_CREDIT`` per valid move before it."""
    outcome = (game or {}).get("outcome", "loss")
    moves = (game or {}).get("turn", 0)
    calls = moves + (outcome == "invalid")
    trajectory.metrics.update({"success": float(outcome == "win"), "moves": float(moves),
                               "valid_tool_calls": moves / calls if calls else 0.0,
                               "invalid_move": float(outcome == "invalid")})
    if outcome == "invalid":
        return _REWARDS["invalid"] + VALID_MOVE_CREDIT * moves
    return _REWARDS[outcome]
