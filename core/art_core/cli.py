"""The ``art-core`` command line: ``art-core demo``, ``art-core models``."""

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
    """Train the embedded SmolLM2-135M to add small numbers; show the held-out success rate before and after."""
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


if __name__ == "__main__":
    app()
