"""A scripted judge served over real HTTP on loopback, and a group of runs to judge.

``FakeJudge`` is a stand-in only for what the real judge (SmolLM2 behind our gateway, with constrained
decoding: see ``test_ruler_gateway.py``) cannot be made to do on demand: answer broken JSON, score too few
trajectories, or score by a rule the test knows. It is a real OpenAI-compatible HTTP server (stdlib
``http.server`` in a thread) that litellm reaches over loopback, so the whole client path runs for real.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from art_core.types import Message, Trajectory, TrajectoryGroup

Reply = str | Callable[[dict[str, Any]], str]
"""A scripted judge answer: the content text, or a function of the request body that returns it."""

NO_CHOICES = "<no choices>"
"""A reply that answers with an empty ``choices`` list (a server that is not quite OpenAI's)."""

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a city up.", "parameters": CITY}}]


def capital_group() -> TrajectoryGroup:
    """Three runs of one task: right, wrong, and a refusal; each with its own reward to keep."""
    shared = [Message(role="system", content="You answer geography questions."),
              Message(role="user", content="What is the capital of France?")]
    answers = ["The capital of France is Paris.", "The capital of France is Lyon.", "I do not know."]
    return TrajectoryGroup([
        Trajectory(id=f"run-{i}", messages=[*shared, Message(role="assistant", content=answer)], tools=TOOLS,
                   reward=float(i) + 0.5)
        for i, answer in enumerate(answers)
    ])


def trajectory_blocks(body: dict[str, Any]) -> dict[str, str]:
    """label -> the text of that trajectory's block, from the judge request's user message."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    return dict(re.findall(r'<trajectory id="(trajectory_\d+)">\n(.*?)\n</trajectory>', user, flags=re.S))


def score_by_content(body: dict[str, Any]) -> str:
    """A judge that knows the answer: Paris 1.0, Lyon 0.3, anything else 0.0; it names what it saw."""
    answer = {}
    for label, block in trajectory_blocks(body).items():
        score = 1.0 if "Paris" in block else 0.3 if "Lyon" in block else 0.0
        answer[label] = {"explanation": f"saw {'Paris' if score == 1 else 'Lyon' if score else 'no city'}",
                         "score": score}
    return json.dumps(answer)


class FakeJudge:
    """A scripted OpenAI-compatible judge: answers ``replies`` in order, then ``default`` forever."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.default: Reply = score_by_content
        self.requests: list[dict[str, Any]] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append(body)
                reply = judge.replies.pop(0) if judge.replies else judge.default
                content = reply(body) if callable(reply) else reply
                payload = json.dumps({
                    "id": f"chatcmpl-fake-{len(judge.requests)}", "object": "chat.completion", "created": 0,
                    "model": body.get("model", "judge"),
                    "choices": [] if content == NO_CHOICES else [
                        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
