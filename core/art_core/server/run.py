"""``art-core serve``: one process, one port, the training API and every registered model's gateway.

    art-core serve --host 0.0.0.0 --port 7999 --token "$ART_SERVER_TOKEN"
    art-core serve --backend ray --ray-address auto --replicas 2 --trainer-workers 2 ...   # on a Ray cluster

A host other than loopback needs a token (``--token`` or ``ART_SERVER_TOKEN``): the server trains and
serves models for anyone who can reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..gateway.settings import is_loopback_host
from ..wire import gateway_path

__all__ = ["ServerSettings", "run_forever", "serve"]

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
BACKEND_CHOICES = ("local", "ray")


class ServerSettings:
    """What ``art-core serve`` was asked for, checked before anything loads.

    Args:
        host: the address to listen on (loopback by default).
        port: the port; 0 picks a free one (printed on start).
        token: bearer token every route wants; default ``ART_SERVER_TOKEN``. Required off loopback.
        path: root folder of projects (checkpoints, trajectories, history) on this machine.
        inference: the engine (``LocalBackend(inference=...)``), when this art-core's LocalBackend takes it.
        trainer: the trainer (``LocalBackend(trainer=...)``), likewise.
        max_body_mb: largest training-API body in MiB (before and after gzip).
        num_threads: torch threads for training and inference (None: torch's default); on Ray, in each
            replica and rank.
        backend: ``"local"`` (``LocalBackend``, this machine) or ``"ray"`` (``RayBackend``: engine replicas
            and a trainer group on a Ray cluster; needs ``art-core[distributed]``).
        ray_address: with ``backend="ray"``: the cluster (``"auto"``, ``"ray://host:10001"``); None starts a
            local one whose files stay under ``<path>/ray``.
        inference_replicas, trainer_workers: with ``backend="ray"``: engine replicas and trainer ranks.
        pause_during_step: hold gateway requests while a step trains (True, the default), or keep serving the
            last checkpoint during a step so clients' rollouts overlap training (False: what ``pipeline`` on a
            ``RemoteBackend`` wants). False gives the local transformers engine weights of its own (the
            separate-module layout: a second copy of the base in memory); Ray replicas switch one at a time.

    Raises:
        ConfigError: every problem found, in one message.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 7999, token: str | None = None,
                 path: str | Path = ".art", inference: str | None = None, trainer: str | None = None,
                 max_body_mb: int = 256, num_threads: int | None = None, backend: str = "local",
                 ray_address: str | None = None, inference_replicas: int = 1, trainer_workers: int = 1,
                 pause_during_step: bool = True) -> None:
        problems = []
        if backend not in BACKEND_CHOICES:
            problems.append(f"--backend {backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
        elif backend == "local" and (ray_address is not None or inference_replicas != 1 or trainer_workers != 1):
            problems.append("--ray-address, --replicas and --trainer-workers need --backend ray")
        elif backend == "ray":
            if trainer not in (None, "peft"):
                problems.append(f"--trainer {trainer} is not available with --backend ray (its ranks train with peft)")
            if inference_replicas < 1 or trainer_workers < 1:
                problems.append("--replicas and --trainer-workers must be at least 1")
        token = token if token is not None else os.environ.get("ART_SERVER_TOKEN") or None
        if token is None and not is_loopback_host(host):
            problems.append(f"host {host!r} is not a loopback address, so other machines could train and call "
                            "the models: give --token (or set ART_SERVER_TOKEN), or use --host 127.0.0.1")
        if token is not None and len(token) < 16:
            problems.append(f"the token has {len(token)} characters; use at least 16 (e.g. `openssl rand -hex 24`)")
        if not 0 <= port <= 65535:
            problems.append(f"port {port} is not in 0..65535")
        if max_body_mb < 1:
            problems.append(f"max_body_mb {max_body_mb} must be at least 1")
        backend_options = _backend_options()
        for option, value in (("inference", inference), ("trainer", trainer)):
            if value is None:
                continue
            choices = _choices(option)
            if value not in choices:
                problems.append(f"--{option} {value!r} is not one of {', '.join(choices)}")
            elif backend != "ray" and option not in backend_options:
                problems.append(f"--{option} {value} is not available in this art-core (its LocalBackend has no "
                                f"{option}= option)")
        if problems:
            raise ConfigError("cannot start the server:\n" + "\n".join(f"- {p}" for p in problems))
        self.host, self.port, self.token, self.path = host, port, token, Path(path)
        self.max_body_bytes = max_body_mb * MiB
        self.num_threads = num_threads
        self.backend, self.ray_address, self.inference = backend, ray_address, inference
        self.inference_replicas, self.trainer_workers = inference_replicas, trainer_workers
        # Passed on only when LocalBackend takes them (see _backend_options); otherwise the default is what runs.
        self.backend_options: dict[str, Any] = {k: v for k, v in (("inference", inference), ("trainer", trainer))
                                                if v is not None and k in backend_options}
        self.pause_during_step = pause_during_step
        if not pause_during_step and backend == "local":
            from ..backends.local import LocalBackend

            self.backend_options.update(LocalBackend.serving_during_steps(inference or backend_options["inference"]))


def _backend_options() -> dict[str, Any]:
    """``LocalBackend``'s keyword arguments and their defaults."""
    from ..backends.local import LocalBackend

    return {name: p.default for name, p in inspect.signature(LocalBackend).parameters.items()}


def _choices(option: str) -> list[str]:
    """The names ``LocalBackend`` takes for ``option``, read from its own tables (one source of truth)."""
    if option == "inference":
        from ..backends._engines import INFERENCE

        return sorted(INFERENCE)
    from ..backends._trainers import TRAINERS

    return sorted(TRAINERS)


async def serve(settings: ServerSettings, *, ready: Any = None) -> None:
    """Run the server until cancelled (Ctrl-C, SIGTERM); train calls in progress finish first.

    Args:
        settings: checked settings.
        ready: called with the server's URL once it accepts connections (the CLI prints it).

    Raises:
        ConfigError: the host/port cannot be bound.
    """
    from ..gateway.listen import bind, start_server
    from .app import create_server_app

    _quiet_progress_bars()
    if settings.num_threads is not None:
        import torch

        # Process-wide, as `art-core demo` does: the engine's decode loop runs outside LocalBackend's
        # per-call thread setting, and 2 threads on a busy 2-core machine collapse (see ENVIRONMENT.md).
        torch.set_num_threads(settings.num_threads)
    sock = bind(settings.host, settings.port, fix="pick another --port (0: a free one)")
    url = f"http://{_client_host(settings.host)}:{sock.getsockname()[1]}"
    backend = _backend(settings, url)
    app = create_server_app(backend, token=settings.token, max_body_bytes=settings.max_body_bytes)
    loop = asyncio.get_running_loop()
    server = task = None
    try:
        server, task = await start_server(app, sock, failed=lambda error: ConfigError(
            f"the server failed to start on {url}: {error}"))
        for signum in (signal.SIGINT, signal.SIGTERM):
            # Stop accepting, let open streams end, then close the backend; uvicorn would re-raise the signal
            # after its own shutdown, which ends the process before the backend is closed.
            loop.add_signal_handler(signum, setattr, server, "should_exit", True)
        if ready is not None:
            ready(url)
        await task
    finally:
        if server is not None and task is not None:
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        await app.jobs.aclose()
        await backend.aclose()
        sock.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _backend(settings: ServerSettings, url: str) -> Any:
    if settings.backend == "ray":
        from ..backends.ray import RayBackend

        # The gateways also listen on their own loopback ports (the rollout workers' way in, on this node);
        # the server mounts the same apps, with the same token.
        return RayBackend(address=settings.ray_address, path=settings.path,
                          inference=settings.inference or "transformers",
                          inference_replicas=settings.inference_replicas, trainer_workers=settings.trainer_workers,
                          num_threads=settings.num_threads, api_key=settings.token,
                          pause_during_step=settings.pause_during_step)
    from ..backends.local import LocalBackend

    return LocalBackend(path=settings.path, num_threads=settings.num_threads, show_progress=False,
                        gateway_mount=lambda spec: url + gateway_path(spec.project, spec.name),
                        **settings.backend_options)


def run_forever(settings: ServerSettings) -> None:
    """The CLI's entry: print the URL, serve until Ctrl-C or SIGTERM."""
    def ready(url: str) -> None:
        auth = "bearer token required" if settings.token else "no token (loopback only)"
        print(f"art-core server on {url} ({auth}); models' gateways at {url}/gateway/<project>/<name>/v1",
              flush=True)
        print(f"ART_SERVER_URL={url}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, ready=ready))


def _quiet_progress_bars() -> None:
    """Turn off transformers' and the hub's tqdm bars in this (server) process.

    They are drawn from worker threads (loading, saving checkpoints) and nobody watches a server's console;
    worse, a bar collected by the garbage collector on the event loop's thread can deadlock on tqdm's write
    lock against tqdm's monitor thread (seen: the server hung until killed).
    """
    import importlib

    for module, function in (("transformers.utils.logging", "disable_progress_bar"),
                             ("huggingface_hub.utils", "disable_progress_bars")):
        try:
            getattr(importlib.import_module(module), function)()
        except (ImportError, AttributeError):
            pass  # not installed, or a version without the switch: nothing to turn off
    try:
        import tqdm

        tqdm.tqdm.monitor_interval = 0  # no monitor thread for any bar that is still drawn
    except ImportError:
        pass


def _client_host(host: str) -> str:
    # The gateways' URLs are handed to clients; on a wildcard host, name this machine (clients are elsewhere).
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
