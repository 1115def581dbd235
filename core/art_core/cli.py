"""The ``art-core`` command line: ``art-core demo``, ``art-core models``, ``art-core serve``, ``art-core export``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from .backends._engines import INFERENCE
from .backends._trainers import TRAINERS
from .errors import ArtError

# No rich markup: help texts name extras and defaults in brackets (art-core[distributed], [default: ...]) that
# typer's markup would swallow.
app = typer.Typer(help="art-core: GRPO training of LoRA adapters for agents.", no_args_is_help=True,
                  add_completion=False, rich_markup_mode=None)


def _positive(value: float) -> float:
    if value <= 0:
        raise typer.BadParameter(f"{value} is not > 0 (e.g. 1e-3)")
    return value


@contextlib.contextmanager
def errors_as_lines() -> Iterator[None]:
    """Within: an error of ours (it names the fix) ends the command with its message on one line and exit status
    1, not a traceback."""
    try:
        yield
    except ArtError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from exc


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Within: a warning prints as ``warning: <Category>: <message>``. Our warnings point at the user's line that
    caused them; run from the command line there is none, and they would name a frame of typer's instead."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        print(f"warning: {category.__name__}: {message}", file=file or sys.stderr)

    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.showwarning = show
        yield


def _require_training_stack(command: str, modules: tuple[str, ...] = ("torch", "transformers", "peft")) -> None:
    """End ``command`` with one line naming the extra to install when the training stack is missing (a light
    client install, ``art-core[serve]``, has the CLI without it)."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        typer.secho(f"error: {command} needs {', '.join(missing)}, which this install lacks: pip install "
                    "'art-core[train]'", fg="red", err=True)
        raise typer.Exit(1)


@app.command()
def demo(
    steps: int = typer.Option(10, min=1, help="GRPO steps."),
    # One answer per question leaves GRPO nothing to compare: every group would be dropped.
    group_size: int = typer.Option(8, min=2, help="Sampled answers per question."),
    learning_rate: float = typer.Option(1e-3, callback=_positive, help="AdamW learning rate of the LoRA adapter."),
    path: Path = typer.Option(Path(".art"), file_okay=False, help="Where checkpoints, trajectories and history "
                                                                  "go (a folder, made if missing)."),
    base_model: str = typer.Option("smollm2-135m-instruct", help="Local model folder or registered name."),
    threads: int = typer.Option(0, min=0, help="torch threads (0: as many as cores)."),
) -> None:
    """The minimal loop, no agent: GRPO on raw samples of "a + b" (`make demo` trains a LangGraph agent instead)."""
    _require_training_stack("art-core demo")
    import torch

    from .config import TrainConfig
    from .demo import run_demo

    torch.set_num_threads(threads or os.cpu_count() or 1)
    with errors_as_lines(), warnings_as_lines():
        result = asyncio.run(run_demo(steps=steps, group_size=group_size, base_model=base_model, path=path,
                                      config=TrainConfig(learning_rate=learning_rate)))
    if result.success_after <= result.success_before:
        typer.secho("no improvement this run (sampling is random; try more --steps)", fg="yellow")


@app.command()
def models() -> None:
    """List the registered base-model names (local folders work too)."""
    from .models import known_base_models

    for name in known_base_models():
        typer.echo(name)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on; anything but loopback needs a token."),
    port: int = typer.Option(7999, help="Port (0: a free one, printed on start)."),
    token: str = typer.Option(None, help="Bearer token every route wants [default: ART_SERVER_TOKEN]."),
    path: Path = typer.Option(Path(".art"), file_okay=False, help="Where checkpoints, trajectories and history "
                                                                  "go (a folder, made if missing)."),
    inference: str = typer.Option(None, help=f"Inference engine: {', '.join(sorted(INFERENCE))} "
                                             "(default: LocalBackend's)."),
    trainer: str = typer.Option(None, help=f"Trainer: {', '.join(sorted(TRAINERS))} (default: LocalBackend's)."),
    max_body_mb: int = typer.Option(256, help="Largest training-API request body, in MiB (gzip inflated)."),
    threads: int = typer.Option(0, min=0, help="torch threads (0: torch's default)."),
    backend: str = typer.Option("local", help="local (this machine) or ray (replicas and trainer ranks on a Ray "
                                               "cluster; needs art-core[distributed])."),
    ray_address: str = typer.Option(None, help="With --backend ray: the cluster (auto, ray://host:10001) "
                                               "[default: a local one]."),
    replicas: int = typer.Option(1, help="With --backend ray: engine replicas behind each gateway."),
    trainer_workers: int = typer.Option(1, help="With --backend ray: ranks of the trainer group."),
    pause_during_steps: bool = typer.Option(
        True, "--pause-during-steps/--serve-during-steps",
        help="Hold gateway requests while a step trains, or keep serving the last checkpoint so clients' "
             "rollouts overlap steps (art_core.pipeline; a second copy of the base for the local "
             "transformers engine; Ray replicas switch one at a time)."),
) -> None:
    """Serve the training API and every registered model's OpenAI-compatible gateway on one port.

    Clients use ``RemoteBackend("http://HOST:PORT", token=...)``; their agents reach the models through it.
    """
    from .errors import ConfigError
    from .server.run import ServerSettings, run_forever

    try:
        settings = ServerSettings(host=host, port=port, token=token, path=path, inference=inference,
                                  trainer=trainer, max_body_mb=max_body_mb, num_threads=threads or None,
                                  backend=backend, ray_address=ray_address, inference_replicas=replicas,
                                  trainer_workers=trainer_workers, pause_during_step=pause_during_steps)
    except ConfigError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from exc
    # errors found starting the engine or trainer (no vLLM venv, no GPU); warnings of the steps it runs
    with errors_as_lines(), warnings_as_lines():
        run_forever(settings)


@app.command()
def export(
    source: Path = typer.Argument(..., help="A model folder (<path>/<project>/models/<name>) or one of its "
                                            "checkpoints/NNNN folders."),
    out: Path = typer.Argument(..., help="The folder to write (new, or empty)."),
    step: int = typer.Option(None, help="Which checkpoint of a model folder (default: the latest)."),
    merged: bool = typer.Option(False, "--merged", help="Merge the adapter into the base model and write a full "
                                                         "Hugging Face model folder (default: the PEFT adapter alone)."),
    base_model: str = typer.Option(None, help="Base model for --merged: a registered name or a local folder "
                                              "(default: the one the adapter records)."),
    dtype: str = typer.Option(None, help="Weights of the merged model: float32, bfloat16 or float16 "
                                         "[default: float32]."),
) -> None:
    """Write a checkpoint as a plain PEFT adapter folder, or merged into its base model (loads in vLLM and transformers)."""
    if merged:
        _require_training_stack("art-core export --merged")
    from .export import export_adapter, export_merged, find_checkpoint

    unused = [flag for flag, value in (("--base-model", base_model), ("--dtype", dtype)) if value is not None]
    if unused and not merged:  # the adapter is copied as it is: these would be ignored
        raise typer.BadParameter(f"{' and '.join(unused)} only apply with --merged (the adapter is written as "
                                 "it was trained): add --merged, or drop them")
    with errors_as_lines(), warnings_as_lines():
        checkpoint = find_checkpoint(source, step)
        written = (export_merged(checkpoint, out, base_model=base_model, dtype=dtype or "float32") if merged
                   else export_adapter(checkpoint, out))
    kind = "merged model" if merged else "PEFT adapter"
    typer.echo(f"wrote {kind} of {checkpoint} to {written}")


if __name__ == "__main__":
    app()
