"""A local HTTP server standing in for Langfuse, for the tests of ``art_plugins.langfuse``.

A real Langfuse server cannot run on this machine (it needs Postgres, ClickHouse, Redis and S3), so the
tests point the real ``langfuse`` SDK at this receiver instead. It speaks the few routes the v5 SDK uses,
with the payloads the SDK really sends:

- ``POST /api/public/otel/v1/traces``: OTLP/HTTP protobuf (gzip or plain), decoded with
  ``opentelemetry-proto`` into ``Span`` records (attributes as Python values);
- ``POST /api/public/scores``: the JSON list of scores of one batch;
- ``GET /api/public/projects``: one project (``get_trace_url``, ``auth_check`` and the experiment runner read it);
- ``GET /api/public/v2/datasets/{name}`` and ``GET /api/public/dataset-items``: datasets given to ``add_dataset``;
- ``POST /api/public/dataset-run-items``: recorded, for SDKs that post run items (v5 links items through spans).

``mode`` makes it misbehave: ``"ok"``, ``"error"`` (every request answered 500) or ``"hang"`` (requests are
held, unanswered, until the test closes the receiver). Nothing here knows art-plugins: it records what arrives.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

PROJECT_ID = "proj-art-tests"


@dataclass
class Span:
    """One exported OpenTelemetry span, as Langfuse receives it."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    scope: str
    attributes: dict[str, Any]

    def metadata(self, key: str) -> Any:
        """An observation metadata value (``langfuse.observation.metadata.<key>``), JSON-decoded."""
        value = self.attributes.get(f"langfuse.observation.metadata.{key}")
        return json.loads(value) if isinstance(value, str) else value

    def trace_metadata(self, key: str) -> Any:
        value = self.attributes.get(f"langfuse.trace.metadata.{key}")
        return json.loads(value) if isinstance(value, str) else value


@dataclass
class Receiver:
    """The server's state: what it received, and how it behaves."""

    mode: str = "ok"
    spans: list[Span] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    run_items: list[dict[str, Any]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    datasets: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = field(default_factory=dict)
    gzip_bodies: int = 0
    url: str = ""
    _server: ThreadingHTTPServer | None = None
    _closing: threading.Event = field(default_factory=threading.Event)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                receiver._handle(self, "GET")

            def do_POST(self) -> None:
                receiver._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def add_dataset(self, name: str, items: list[dict[str, Any]]) -> None:
        """A dataset the SDK can read: ``items`` hold ``input``, ``expected_output`` and ``metadata``."""
        now = "2026-11-01T00:00:00.000Z"
        dataset_id = f"ds-{name}"
        dataset = {"id": dataset_id, "name": name, "description": None, "metadata": {}, "projectId": PROJECT_ID,
                   "createdAt": now, "updatedAt": now, "inputSchema": None, "expectedOutputSchema": None}
        rows = [{"id": f"item-{k}", "status": "ACTIVE", "input": item["input"],
                 "expectedOutput": item.get("expected_output"), "metadata": item.get("metadata"),
                 "sourceTraceId": None, "sourceObservationId": None, "datasetId": dataset_id, "datasetName": name,
                 "createdAt": now, "updatedAt": now, "mediaReferences": []} for k, item in enumerate(items)]
        self.datasets[name] = (dataset, rows)

    # --- what arrived ---

    def wait_for(self, predicate: Any, timeout: float = 120.0) -> bool:
        """Whether ``predicate(self)`` comes true within ``timeout`` seconds (a bound for a hang, not a guess at
        how long an export takes: a loaded machine may take many seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return True
            time.sleep(0.05)
        return False

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def scores_for(self, trace_id: str) -> dict[str, dict[str, Any]]:
        """The latest score of each name on a trace (the SDK updates a score by sending its id again)."""
        with self._lock:
            latest: dict[str, dict[str, Any]] = {}
            for score in self.scores:
                if score.get("traceId") == trace_id:
                    latest[score["name"]] = score
            return latest

    # --- the routes ---

    def _handle(self, http: BaseHTTPRequestHandler, method: str) -> None:
        path = urlparse(http.path).path
        with self._lock:
            self.requests.append(f"{method} {path}")
        length = int(http.headers.get("Content-Length") or 0)
        body = http.rfile.read(length) if length else b""
        if self.mode == "hang":
            self._closing.wait()  # a gate the test holds: nothing is answered before it calls close()
            return
        if self.mode == "error":
            return self._reply(http, 500, {"message": "receiver told to fail"})
        if method == "POST" and path == "/api/public/otel/v1/traces":
            if http.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
                self.gzip_bodies += 1
            spans = _decode_spans(body)
            with self._lock:
                self.spans.extend(spans)
            return self._reply(http, 200, {})
        if method == "POST" and path == "/api/public/scores":
            batch = json.loads(body)
            with self._lock:
                self.scores.extend(batch if isinstance(batch, list) else [batch])
            return self._reply(http, 200, {"message": "Accepted"})
        if method == "GET" and path == "/api/public/projects":
            return self._reply(http, 200, {"data": [{"id": PROJECT_ID, "name": "art-tests", "metadata": {},
                                                     "organization": {"id": "org-1", "name": "tests"}}]})
        if method == "GET" and path.startswith("/api/public/v2/datasets/"):
            found = self.datasets.get(unquote(path.rsplit("/", 1)[-1]))
            return self._reply(http, 200, found[0]) if found else self._reply(http, 404, {"message": "no dataset"})
        if method == "GET" and path == "/api/public/dataset-items":
            query = parse_qs(urlparse(http.path).query)
            found = self.datasets.get(query.get("datasetName", [""])[0])
            if found is None:
                return self._reply(http, 404, {"message": "no dataset"})
            rows = found[1]
            return self._reply(http, 200, {"data": rows, "meta": {"page": 1, "limit": max(len(rows), 1),
                                                                   "totalItems": len(rows), "totalPages": 1}})
        if method == "POST" and path == "/api/public/dataset-run-items":
            with self._lock:
                self.run_items.append(json.loads(body))
            return self._reply(http, 200, {"id": uuid.uuid4().hex})
        return self._reply(http, 404, {"message": f"no route {method} {path}"})

    @staticmethod
    def _reply(http: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        http.send_response(status)
        http.send_header("Content-Type", "application/json")
        http.send_header("Content-Length", str(len(data)))
        http.end_headers()
        http.wfile.write(data)


def _decode_spans(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(Span(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex() or None, name=span.name, scope=scope_spans.scope.name,
                    attributes={a.key: _value(a.value) for a in span.attributes}))
    return spans


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None
