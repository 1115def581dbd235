"""A ``RayBackend`` on a running cluster after a local-cluster ``RayBackend`` closed in the same process.

A local cluster turns on Ray's token authentication in this process; ``aclose()`` puts the environment back and
makes Ray read it again, so the next backend connects to a cluster without tokens as a fresh process would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from art_core import LoraSettings, RayBackend, TrainableModel


async def test_a_backend_on_a_cluster_works_after_a_local_one_closed(cluster: Any, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    auth_before = os.environ.get("RAY_AUTH_MODE")
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
    for name, address in (("local", None), ("on-cluster", cluster.address)):
        model = TrainableModel(name=name, base_model=tiny_model_dir, lora=LoraSettings(rank=4, alpha=8))
        async with RayBackend(address=address, path=tmp_path / name, num_threads=1, cpus_per_replica=1,
                              cpus_per_rank=1, runtime_env=env) as backend:
            await model.register(backend)  # the trainer rank and the replica start (they died unstarted before)
            [trajectory] = await model.sample([{"role": "user", "content": "Hi"}], n=1, max_tokens=4)
            assert trajectory.calls[0].completion_token_ids, name
            link = tmp_path / name / "ray"
            short = link.resolve() if link.is_symlink() else None
        assert os.environ.get("RAY_AUTH_MODE") == auth_before, f"{name}: the process's Ray settings were left changed"
        if address is None and short is not None:  # pytest's folders are too long for Ray's sockets: a short one
            assert not short.exists() and not link.is_symlink(), "the short folder for Ray's sockets was left behind"
