"""The agent: a LangGraph loop in which the model plays 2048 on a 3x3 board through a ``move`` tool.

Each turn must be a call (``tool_choice="required"``: the reply is a well-formed call, the direction the
model's choice), and the ``move`` tool of each turn offers only the directions that change the board, as a game
app greys out the moves it would refuse (``move_schema``). Under the board, the prompt lists what each offered move
would do (how many tiles it merges). The board
and the target are small (3x3, reach 16 within 10 moves) so that a game fits a CPU. The graph alternates
``player`` (the chat model sees the board and calls ``move(direction)``) and ``game`` (plain Python: slides and
merges, adds a 2 (or a 4) in a random empty cell, decides whether the game is over).

Reward: 1 for reaching the target; otherwise the progress log2(largest tile) / log2(target), in [0.2, 0.8];
an invalid move (no call, a malformed call, a direction not offered) ends the game at -1. Success (held-out):
reaching the target.
"""

from __future__ import annotations

import math
import random
from typing import Any, Literal, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from art_core import Trajectory

__all__ = ["MODEL_NAME", "SIZE", "TARGET", "build_graph", "make_tasks", "move_schema", "moves_that_change", "preview",
           "reward", "slide"]

MODEL_NAME = "game-2048"
SIZE = 3
TARGET = 16
MAX_MOVES = 10
SYSTEM = (f"You play 2048 on a {SIZE}x{SIZE} board. Call move with one of the directions it offers. Tiles "
          f"slide that way and equal tiles merge. Reach a {TARGET} tile. Under the board, each move says how many "
          "tiles it merges.")
_DIRECTIONS = ("left", "right", "up", "down")


@tool
def move(direction: Literal["left", "right", "up", "down"]) -> str:
    """Slide every tile that way."""
    return f"moved {direction}"  # the game node plays it; ``move_schema`` narrows it to each turn's choices


def move_schema(board: list[list[int]]) -> dict[str, Any]:
    """The ``move`` tool as the player sees it on ``board``: its ``direction`` one of ``moves_that_change(board)``.

    Offering only those is for the small model: SmolLM2-135M, after SFT on expectimax games, still picked moves
    that change nothing, and at a low temperature repeated them on the unchanged board until the game's moves ran
    out (probed: 2 of 16 held-out games won). The server's constrained decoding keeps the reply to the enum, and
    to ``direction`` alone (``additionalProperties: false``: a small model otherwise invents more arguments).
    """
    schema = convert_to_openai_tool(move)
    parameters = schema["function"]["parameters"]
    parameters["properties"]["direction"]["enum"] = moves_that_change(board)
    parameters["additionalProperties"] = False
    return schema


class Game(TypedDict, total=False):
    board: list[list[int]]
    seed: int
    moves: int
    outcome: str
    """``won``, ``stuck`` (no move left or out of moves) or ``invalid`` once the game is over."""
    last_reply: Any


def _slide_row_left(row: list[int]) -> list[int]:
    tiles = [t for t in row if t]
    out: list[int] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            out.append(tiles[0] * 2)
            tiles = tiles[2:]
        else:
            out.append(tiles.pop(0))
    return out + [0] * (len(row) - len(out))


def slide(board: list[list[int]], direction: str) -> list[list[int]]:
    """The board after sliding every tile towards ``direction`` (merging equal neighbours once)."""
    if direction in ("up", "down"):
        columns = [list(c) for c in zip(*board)]
        moved = slide(columns, "left" if direction == "up" else "right")
        return [list(r) for r in zip(*moved)]
    if direction == "right":
        return [_slide_row_left(row[::-1])[::-1] for row in board]
    return [_slide_row_left(row) for row in board]


def _spawn(board: list[list[int]], rng: random.Random) -> None:
    empty = [(r, c) for r in range(SIZE) for c in range(SIZE) if not board[r][c]]
    if empty:
        r, c = rng.choice(empty)
        board[r][c] = 4 if rng.random() < 0.1 else 2


def render(board: list[list[int]]) -> str:
    return "\n".join(" ".join(f"{t or '.':>3}" for t in row) for row in board)


def moves_that_change(board: list[list[int]]) -> list[str]:
    """The directions whose slide changes ``board`` (empty: the game is stuck)."""
    return [d for d in _DIRECTIONS if slide(board, d) != board]


def preview(board: list[list[int]]) -> str:
    """What each offered move would do, as the player's prompt lists it: how many tiles it merges
    (``left: merges 1``).

    The player reads this instead of simulating the slides: SmolLM2-135M does not (after SFT on 32 expectimax
    games with the board alone, 1 of 16 held-out games reached 16 at temperature 0.3). Picking the move with the
    most merges wins 62% of the example's games, a random move that changes the board 24%, a random move 12%.
    """
    tiles = sum(1 for row in board for t in row if t)
    return "\n".join(f"{d}: merges {tiles - sum(1 for row in slide(board, d) for t in row if t)}"
                     for d in moves_that_change(board))


def build_graph(*, base_url: str = "http://127.0.0.1:9/v1", temperature: float = 1.0, max_tokens: int = 48) -> Any:
    """The compiled game loop (``player`` <-> ``game``)."""
    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", temperature=temperature,
                     max_tokens=max_tokens)

    async def player(game: Game) -> Game:
        board = game["board"]
        chat = llm.bind_tools([move_schema(board)], tool_choice="required")
        prompt = f"Board:\n{render(board)}\n{preview(board)}\nYour move?"
        return {"last_reply": await chat.ainvoke([SystemMessage(SYSTEM), HumanMessage(prompt)])}

    def play(game: Game) -> Game:
        reply = game["last_reply"]
        calls = reply.tool_calls if isinstance(reply, AIMessage) else []
        direction = calls[0]["args"].get("direction") if len(calls) == 1 and calls[0]["name"] == "move" else None
        if direction not in moves_that_change(game["board"]):
            return {"outcome": "invalid"}
        moves = game.get("moves", 0) + 1
        board = slide(game["board"], direction)
        _spawn(board, random.Random(game.get("seed", 0) * 997 + moves))
        if max(max(row) for row in board) >= TARGET:
            return {"board": board, "moves": moves, "outcome": "won"}
        stuck = not moves_that_change(board)
        if stuck or moves >= MAX_MOVES:
            return {"board": board, "moves": moves, "outcome": "stuck"}
        return {"board": board, "moves": moves}

    graph = StateGraph(Game)
    graph.add_node("player", player)
    graph.add_node("game", play)
    graph.add_edge(START, "player")
    graph.add_edge("player", "game")
    graph.add_conditional_edges("game", lambda game: END if game.get("outcome") else "player")
    return graph.compile()


def make_tasks(n: int, *, seed: int) -> list[dict[str, Any]]:
    """``n`` starting boards: two or three small tiles, each game with its own seed for new tiles."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        board = [[0] * SIZE for _ in range(SIZE)]
        for _ in range(rng.choice((2, 3))):
            _spawn(board, rng)
        tasks.append({"board": board, "seed": rng.randrange(1 << 30), "moves": 0})
    return tasks


def reward(trajectory: Trajectory, game: Game | None) -> float:
    """1 at the target; else progress in [0.2, 0.8] by the largest tile; -1 for an invalid move."""
    game = game or {}
    outcome = game.get("outcome", "stuck")
    moves = game.get("moves", 0)
    calls = moves + (outcome == "invalid")
    trajectory.metrics.update({"success": float(outcome == "won"), "moves": float(moves),
                               "valid_tool_calls": moves / calls if calls else 0.0})
    if outcome == "won":
        return 1.0
    if outcome == "invalid":
        return -1.0
    largest = max(max(row) for row in game.get("board", [[2]]))
    return 0.8 * math.log2(max(largest, 2)) / math.log2(TARGET)
