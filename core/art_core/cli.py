"""The ``art-core`` command line: ``art-core demo``, ``art-core models``, ``art-core serve``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import typer

app = typer.Typer(help="art-core: GRPO training of LoRA adapters for agents.", no_args_is_help=True,
                  add_completion=False)


@app.command()
def demo(
    steps: int = typer.Option(10, help="GRPO steps."),
    group_size: int = typer.Option(8, help="Sampled answers per question."),
    learning_rate: float = typer.Option(1e-3, help="AdamW learning rate of the LoRA adapter."),
    path: Path = typer.Option(Path(".art"), help="Where checkpoints, trajectories and history go."),
    base_model: str = typer.Option("smollm2-135m-instruct", help="Local model folder or registered name."),
    threads: int = typer.Option(0, help="torch threads (0: as many as cores)."),
) -> None:
    """The minimal loop, no agent: GRPO on raw samples of "a + b" (`make demo` trains a LangGraph agent instead)."""
    import torch

    from .config import TrainConfig
    from .demo import run_demo

    torch.set_num_threads(threads or os.cpu_count() or 1)
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
    path: Path = typer.Option(Path(".art"), help="Where checkpoints, trajectories and history go."),
    inference: str = typer.Option(None, help="Inference engine: transformers or vllm [default: LocalBackend's]."),
    trainer: str = typer.Option(None, help="Trainer: peft or unsloth [default: LocalBackend's]."),
    max_body_mb: int = typer.Option(256, help="Largest training-API request body, in MiB (gzip inflated)."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
) -> None:
    """Serve the training API and every registered model's OpenAI-compatible gateway on one port.

    Clients use ``RemoteBackend("http://HOST:PORT", token=...)``; their agents reach the models through it.
    """
    from .errors import ConfigError
    from .server.run import ServerSettings, run_forever

    try:
        settings = ServerSettings(host=host, port=port, token=token, path=path, inference=inference,
                                  trainer=trainer, max_body_mb=max_body_mb, num_threads=threads or None)
    except ConfigError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from exc
    run_forever(settings)


if __name__ == "__main__":
    app()
