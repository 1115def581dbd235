"""``RayBackend``: the Backend contract on a Ray cluster (engine replicas, rollout workers, a trainer group).

    driver process                          Ray actors (any node)
    --------------                          ----------------------
    TrainableModel -> RayBackend
                      gateway (records) --> ReplicaRouter --> EngineReplica x inference_replicas
                      RolloutPool --------> RolloutWorker x rollout_workers  (call the gateway over HTTP)
                      TrainerGroup -------> TrainerRank x trainer_workers    (torch.distributed)
                      model_dir: checkpoints, trajectories, records, history (on the driver's disk)

A step runs as on every backend (``_steps.StepRunner``: groups to disk, pause, train, checkpoint, publish,
history, resume); this backend supplies how it trains (the trainer group, on the groups split by tokens; rank
0's adapter comes back and is written atomically on the driver's disk) and how it publishes (the adapter goes
through the object store to every replica, which hot-loads it; the gateway resumes once every replica serves
the new step, and stays paused with the error if one cannot). With ``pause_during_step=False`` the replicas
serve while the trainer group trains (their weights are their own), and take the new checkpoint one at a
time (``ReplicaRouter.load_adapter_files(one_at_a_time=True)``), so requests never all wait.

Ray is started and stopped through its API only: ``address=None`` starts a local cluster whose temp and
log files stay under ``<path>/ray`` and which ``aclose()`` stops; any other address (``"auto"``,
``"ray://..."``) joins a running cluster, and ``aclose()`` only disconnects from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._threads import HELPERS
from ...config import SFTConfig, TrainConfig
from ...errors import ConfigError, LifecycleError
from ...types import TrajectoryGroup
from .._engines import transformers_options
from .._shared import ServesModels
from .._tables import ModelTable
from .._steps import StepRunner, Trained
from ..base import ModelSpec, Progress

if TYPE_CHECKING:
    from .._engines import TransformersOptions, VLLMOptions
    from ...gateway import Gateway
    from .replicas import ReplicaRouter
    from .rollouts import RolloutPool, RolloutStats
    from .trainer_group import TrainerGroup

__all__ = ["RayBackend"]

_ROLES = ("replica", "trainer", "rollout")
_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's token-auth settings: a new local cluster otherwise writes its token to ``~/.ray/auth_token``."""


@functools.cache
def _local_cluster_token() -> str:
    """This process's token for the local clusters it starts: Ray's loader caches the first token it reads, so a
    second local cluster in the same process must use the same one."""
    return secrets.token_hex(32)


@dataclass
class _Slot:
    router: ReplicaRouter
    trainer: TrainerGroup
    gateway: Gateway
    worker_url: str
    pools: dict[str, RolloutPool]
    steps: StepRunner

    @property
    def engine(self) -> ReplicaRouter:
        return self.router


@dataclass
class _RaySteps:
    """How a step trains and publishes on the cluster (``_steps.StepWork``)."""

    trainer: TrainerGroup
    router: ReplicaRouter
    one_at_a_time: bool = False
    """Switch the replicas in turn while the others serve (the pipeline's policy) instead of all at once."""

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, *, step: int,
                    progress: Progress | None, return_gradients: bool = False) -> Trained:
        # The ranks' modules are at the checkpoint before this step: samples an older one drew are off-policy.
        result = await self.trainer.train(groups, config, policy_step=step - 1, return_gradients=return_gradients)
        if progress is not None:  # the ranks report nothing until the step ends
            progress(len(groups), len(groups))
        files = result["checkpoint"]
        extra = {"shares": result["shares"], **({"gradients": result["gradients"]} if return_gradients else {})}
        trained = result["metrics"].get("trained")
        return Trained(result["metrics"], (lambda folder: _write_files(folder, files)) if trained else None, extra,
                       detached=True)  # the ranks' bytes: the next step may train while they are written

    async def prepare(self, config: TrainConfig | SFTConfig) -> None:
        await self.trainer.prepare(config)

    async def publish(self, checkpoint: Path, step: int) -> None:
        from .replicas import adapter_files

        await self.router.load_adapter_files(adapter_files(checkpoint), step, one_at_a_time=self.one_at_a_time)


class RayBackend(ServesModels):
    """Trains and serves on a Ray cluster; implements ``art_core.backends.Backend``.

    Args:
        address: the cluster: None starts a local one (stopped by ``aclose``), ``"auto"`` joins the one this
            node belongs to, ``"ray://host:10001"`` a remote one. Default: None.
        path: root folder of projects on the driver's disk (checkpoints, trajectories, records, history,
            and the local cluster's temp and log files under ``<path>/ray``; when that path is too long for
            Ray's Unix sockets, ``<path>/ray`` links to a short folder in the system's temp folder).
        inference_replicas: engine replicas behind the gateway. Default: 1.
        trainer_workers: ranks of the trainer group. Default: 1.
        rollout_workers: rollout worker actors for ``gather`` (started on first use). Default: 8.
        rollouts_per_worker: rollouts each worker runs at once. Default: 4 (agents mostly wait on HTTP).
        inference: the replicas' engine: ``"transformers"`` (in the replica's process) or ``"vllm"`` (each
            replica actor runs a vLLM server on its node, started as ``LocalBackend(inference="vllm")`` starts
            one; the vLLM venv, ``vllm.python`` or ``$ART_VLLM_VENV``, must exist on every replica node).
        vllm: how vLLM replicas start (``VLLMOptions``: venv, dtype, extra ``vllm serve`` arguments).
        transformers: how transformers replicas build their engine (``TransformersOptions``, as for
            ``LocalBackend``: ``packed_weights``, ``prefix_cache_mb``, ``max_batch_rows``). Its ``separate_module``
            changes nothing here: a replica always decodes a model of its own, never the trainer's.
        cpus_per_replica, cpus_per_rank: CPUs Ray reserves for each. Default: 1.
        cpus_per_rollout_worker: Default: 0.25 (an agent mostly waits for the gateway).
        gpus_per_replica, gpus_per_rank: GPUs for each. Default: 1 when the cluster has GPUs, else 0.
        num_threads: torch threads in each replica and rank (None: torch's default, which assumes the
            whole node; set it when several share a node).
        resources: extra Ray resources per role (``"replica"``, ``"trainer"``, ``"rollout"``), to pin a
            role to labelled nodes, e.g. ``{"trainer": {"a100": 1}}``.
        gateway_host: where the gateway listens. Use ``"0.0.0.0"`` (with ``api_key``) when rollout workers
            run on other machines; they then reach it at this node's IP.
        api_key: the gateway's bearer token (required when it listens beyond loopback).
        runtime_env: Ray's runtime environment for every actor (e.g. ``{"py_modules": [...]}`` to ship the
            module of your rollout function).
        max_rollout_attempts: tries per rollout when its worker is lost. Default: 3.
        sharding: the trainer group's weights: ``"none"`` (every rank holds the whole model), ``"fsdp"``
            (FSDP2 shards the frozen base over the ranks, one decoder layer per unit; the LoRA adapter stays
            whole on each) or ``"auto"`` (FSDP2 when the base's weight files take more than half of one
            GPU; never on CPU-only ranks). Default: ``"auto"``.
        pause_during_step: hold requests while a step trains and every replica loads its checkpoint (True,
            the default), or keep serving the last checkpoint during a step and switch the replicas to the new
            one one at a time, each drained of its requests first (False: the asynchronous pipeline; the
            replicas' weights are their own, so any layout can). Default: True.
    """

    def __init__(self, *, address: str | None = None, path: str | Path = ".art", inference_replicas: int = 1,
                 trainer_workers: int = 1, rollout_workers: int = 8, rollouts_per_worker: int = 4,
                 inference: str = "transformers", cpus_per_replica: float = 1, cpus_per_rank: float = 1,
                 cpus_per_rollout_worker: float = 0.25, gpus_per_replica: float | None = None,
                 gpus_per_rank: float | None = None, num_threads: int | None = None,
                 resources: dict[str, dict[str, float]] | None = None, gateway_host: str = "127.0.0.1",
                 api_key: str | None = None, runtime_env: dict[str, Any] | None = None,
                 max_rollout_attempts: int = 3, sharding: str = "auto", vllm: VLLMOptions | None = None,
                 transformers: TransformersOptions | None = None, pause_during_step: bool = True) -> None:
        for name, value in (("inference_replicas", inference_replicas), ("trainer_workers", trainer_workers),
                            ("rollout_workers", rollout_workers), ("rollouts_per_worker", rollouts_per_worker)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if inference not in ("transformers", "vllm"):
            raise ConfigError(f"inference={inference!r} is not available on RayBackend: use 'transformers' or 'vllm'")
        if vllm is not None and inference != "vllm":
            raise ConfigError("vllm= options need inference='vllm'")
        checked_transformers = transformers_options(transformers, inference)
        vllm_options = _vllm_options(vllm) if inference == "vllm" else None
        if sharding not in ("none", "fsdp", "auto"):
            raise ConfigError(f"sharding={sharding!r} is not available: use 'none', 'fsdp' or 'auto'")
        unknown = set(resources or {}) - set(_ROLES)
        if unknown:
            raise ConfigError(f"resources has unknown role(s) {sorted(unknown)}: use {', '.join(_ROLES)}")
        self.address = address
        self.path = Path(path)
        self.inference_replicas, self.trainer_workers = inference_replicas, trainer_workers
        self.rollout_workers, self.rollouts_per_worker = rollout_workers, rollouts_per_worker
        self.inference = inference
        self.cpus_per_replica, self.cpus_per_rank = cpus_per_replica, cpus_per_rank
        self.cpus_per_rollout_worker = cpus_per_rollout_worker
        self.gpus_per_replica, self.gpus_per_rank = gpus_per_replica, gpus_per_rank
        self.num_threads = num_threads
        self.resources = resources or {}
        # Not `self.api_key`: that name is the contract's api_key(model) method, which an attribute would hide.
        self.gateway_host, self._api_key = gateway_host, api_key
        self.runtime_env = runtime_env
        self.max_rollout_attempts = max_rollout_attempts
        self.sharding = sharding
        self.vllm = vllm_options
        self.transformers = checked_transformers
        self.pause_during_step = pause_during_step
        self._models: ModelTable[_Slot] = ModelTable(self.path, "RayBackend")
        self._env_before: dict[str, str | None] | None = None
        self._started = False
        self._short_temp: Path | None = None  # a folder for Ray's sockets made by this backend (see _ray_temp_dir)

    async def __aenter__(self) -> RayBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the Backend contract (the rest is ServesModels') --------------------------------------------

    async def register(self, model: ModelSpec) -> int:
        from transformers import AutoTokenizer

        from ...gateway import Gateway, GatewaySettings, RecordStore
        from ...models import resolve_base_model
        from ...training.checkpoints import check_adapter_shape, latest_checkpoint, remove_interrupted_writes
        from .replicas import EngineReplica, ReplicaRouter
        from .trainer_group import TrainerGroup

        self._models.check_new(model)
        self._models.check_folder(model)
        ray = self._ray()
        base_dir = str(resolve_base_model(model.base_model))  # the driver's copy, for the gateway's tokenizer
        model_dir = self.model_dir(model)
        remove_interrupted_writes(model_dir)  # a killed process's half-written checkpoint: nothing writes now
        latest = latest_checkpoint(model_dir)
        if latest:
            check_adapter_shape(latest.path, model.lora, model=model.name)
        step = latest.step if latest else 0
        checkpoint = ({p.name: p.read_bytes() for p in latest.path.iterdir() if p.is_file()} if latest else None)
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0

        trainer = await TrainerGroup.start(
            workers=self.trainer_workers, base_dir=model.base_model, lora=model.lora, checkpoint=checkpoint,
            num_threads=self.num_threads, cpus_per_rank=self.cpus_per_rank,
            gpus_per_rank=self.gpus_per_rank if self.gpus_per_rank is not None else gpus,
            extra=self.resources.get("trainer", {}), sharding=self.sharding)
        adapter = await trainer.adapter()  # the replicas serve exactly the weights the trainer starts from
        replica_actor = ray.remote(EngineReplica)
        replicas = [replica_actor.options(
            num_cpus=self.cpus_per_replica,
            num_gpus=self.gpus_per_replica if self.gpus_per_replica is not None else gpus,
            resources=self.resources.get("replica") or None, scheduling_strategy="SPREAD",
        ).remote(base_dir=model.base_model, adapter=adapter, lora=model.lora.model_dump(), step=step,
                 engine=self.inference, num_threads=self.num_threads,
                 vllm=self.vllm.model_dump(mode="json") if self.vllm else None,
                 transformers=self.transformers.engine_kwargs())
            for _ in range(self.inference_replicas)]
        await asyncio.gather(*(r.start.remote() for r in replicas))  # loaded (raises if one failed)
        tokenizer = await HELPERS.run(AutoTokenizer.from_pretrained, base_dir)
        router = ReplicaRouter(replicas, tokenizer, step=step)
        settings = GatewaySettings(model_name=model.name, base_model_name=Path(model.base_model).name,
                                   records_path=model_dir / "records.jsonl", host=self.gateway_host,
                                   api_key=self._api_key)
        gateway = await Gateway(router, settings, RecordStore(settings.records_path)).start()
        host = self.gateway_host
        if host in ("0.0.0.0", "", "::"):  # workers on other nodes reach this node by its address
            host = ray.util.get_node_ip_address()
        steps = StepRunner(name=model.name, model_dir=model_dir, step=step,
                           work=_RaySteps(trainer, router, one_at_a_time=not self.pause_during_step),
                           hold=gateway.control, engine_label="Ray replicas'", pause_during_step=self.pause_during_step)
        self._models.add(model, _Slot(router, trainer, gateway, f"http://{host}:{gateway.port}", {}, steps))
        return step

    async def train_step(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                         return_gradients: bool = False) -> dict[str, Any]:
        """``train``, returning more: ``metrics``, ``step``, ``shares`` (group indices per rank) and, when
        ``return_gradients``, each rank's summed LoRA gradients (name -> array) before the optimizer step."""
        outcome = await self._models.get(model).steps.run(groups, config, None, return_gradients=return_gradients)
        return {"metrics": outcome.result.metrics, "step": outcome.result.step, **outcome.extra}

    async def aclose(self) -> None:
        """Stop the gateways, the actors and, when this backend started it, the local Ray cluster."""
        if self._models.closed:
            return
        slots = self._models.close()
        if not slots and not self._started:
            self._remove_short_temp()
            return  # never reached Ray (it may not even be installed)
        import ray

        for slot in slots:
            await slot.gateway.aclose()
            await slot.router.aclose()
            await slot.trainer.aclose()
            for actor in [*slot.router.all_replicas, *(w for p in slot.pools.values() for w in p.workers)]:
                ray.kill(actor)  # our own actors, by handle
        if self._started:
            ray.shutdown()  # disconnects; also stops the processes of a cluster this driver started
        self._remove_short_temp()
        if self._env_before is not None:  # undo what starting the local cluster set (see _ray)
            for name, value in self._env_before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _reread_ray_auth_settings()

    def _remove_short_temp(self) -> None:
        """Remove the short folder this backend made for Ray's sockets outside its path, and the link to it."""
        if self._short_temp is None:
            return
        shutil.rmtree(self._short_temp, ignore_errors=True)
        link = self.path / "ray"
        if link.is_symlink():
            link.unlink()
        self._short_temp = None

    # -- beyond the contract: rollouts on workers -----------------------------------------------------

    async def gather(self, model: ModelSpec, rollout: str, tasks: Sequence[Any], *, n: int) -> list[TrajectoryGroup]:
        """``n`` rollouts of each task on the rollout workers, as one group per task (in task order).

        Args:
            model: the model (``model.spec``).
            rollout: ``"package.module:function"``, an ``async def fn(model, task) -> Trajectory``
                importable on every node.
            tasks: JSON-serialisable task descriptions handed to ``fn``.
            n: rollouts per task (the group size).

        Returns:
            The groups; rollouts that failed are listed in ``group.exceptions`` (see ``rollout_stats``).
        """
        from .rollouts import RolloutPool, RolloutWorker, import_rollout

        slot = self._models.get(model)
        pool = slot.pools.get(rollout)
        if pool is None:
            import_rollout(rollout)  # a typo fails here, with the path, not in every worker
            ray = self._ray()
            actor = ray.remote(RolloutWorker).options(
                num_cpus=self.cpus_per_rollout_worker, resources=self.resources.get("rollout") or None,
                scheduling_strategy="SPREAD", max_concurrency=self.rollouts_per_worker + 1)
            spec = model.model_dump(mode="json")
            pool = RolloutPool(lambda: actor.remote(rollout=rollout, gateway_url=slot.worker_url,
                                                    api_key=self._api_key, spec=spec, step=slot.steps.step),
                               workers=self.rollout_workers, per_worker=self.rollouts_per_worker,
                               max_attempts=self.max_rollout_attempts)
            slot.pools[rollout] = pool
        return await pool.gather(list(tasks), n=n, step=slot.steps.step)

    def rollout_stats(self, model: ModelSpec, rollout: str) -> RolloutStats:
        """What the last ``gather`` of ``rollout`` did: succeeded, failed with a lost worker, retried..."""
        pool = self._models.get(model).pools.get(rollout)
        if pool is None:
            raise LifecycleError(f"no rollout of {rollout!r} was gathered on this backend yet")
        return pool.stats

    def router(self, model: ModelSpec) -> ReplicaRouter:
        """The model's replica router (the engine behind its gateway): replicas, routing counts, steps."""
        return self._models.get(model).router

    def trainer_group(self, model: ModelSpec) -> TrainerGroup:
        """The model's trainer group (its rank actors)."""
        return self._models.get(model).trainer

    # -- helpers --------------------------------------------------------------------------------------

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError as exc:
            raise ConfigError("RayBackend needs Ray: pip install 'art-core[distributed]'") from exc
        if not self._started:
            if ray.is_initialized():
                pass  # the caller connected (e.g. to a test cluster): use it, and leave it connected
            elif self.address is None:
                temp, self._short_temp = _ray_temp_dir(self.path / "ray")
                # Ray enables token auth for a new local cluster (setting RAY_AUTH_MODE in this process) and
                # would save the token in ~/.ray; keep it under the run's folder, and restore both on close.
                self._env_before = {name: os.environ.get(name) for name in _AUTH_ENV}
                if not any(self._env_before.values()):
                    token = temp / "auth_token"
                    token.touch(mode=0o600)
                    token.write_text(_local_cluster_token())
                    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
                with _application_sigterm_kept():
                    ray.init(_temp_dir=str(temp), include_dashboard=False, runtime_env=self.runtime_env,
                             log_to_driver=False)
                self._started = True
            else:
                with _application_sigterm_kept():
                    ray.init(address=self.address, runtime_env=self.runtime_env, log_to_driver=False)
                self._started = True
        return ray


def _reread_ray_auth_settings() -> None:
    """Make this process's Ray read its auth settings from the (restored) environment again.

    ``ray.init`` caches them (its RayConfig and token loader): without this, a later ``ray.init`` to another
    cluster in the same process (a ``RayBackend(address=...)`` after a local one closed) authenticates as the
    local cluster did, and its actors die before they start. The two calls are Ray's own test helper's
    (``ray/_private/authentication_test_utils.reset_auth_token_state``); a Ray without them caches nothing.
    """
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")  # first: the token is dropped only once the config no longer asks for it
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def _application_sigterm_kept() -> Iterator[None]:
    """Keep the application's own SIGTERM handler across ``ray.init``.

    ``ray.init`` makes SIGTERM ``sys.exit`` the process (in the main thread). Where the application handles SIGTERM
    itself (``art-core serve``'s event loop: stop accepting, finish the train calls, close the backend), that
    handler is put back; with the default action, Ray's stays (it runs ``ray.shutdown`` at exit).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(before):  # a Python handler of the application's (not SIG_DFL, SIG_IGN, or one set in C)
            signal.signal(signal.SIGTERM, before)


def _vllm_options(options: VLLMOptions | None) -> VLLMOptions:
    """The vLLM replicas' options, checked on this node (the driver's) so a missing venv fails here, early."""
    from .._engines import VLLMOptions, inference_choice

    options = options or VLLMOptions()
    inference_choice("vllm").check(options)
    return options


_SOCKET_PATH_ROOM = 107 - len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
"""Characters left for Ray's temp folder: its sockets live below it, and a Unix socket path has 107 at most."""


def _ray_temp_dir(wanted: Path) -> tuple[Path, Path | None]:
    """The local cluster's temp folder: ``wanted`` (``<path>/ray``), or, when that is too long a path for
    Ray's Unix sockets, a short folder under the system's temp folder that ``wanted`` links to. Also returns the
    short folder when it was made now (the backend removes it, and the link, on close; Ray's logs go with it)."""
    import logging
    import tempfile

    wanted = wanted.absolute()
    if len(str(wanted.resolve())) <= _SOCKET_PATH_ROOM:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted.resolve(), None
    if wanted.is_symlink() and wanted.resolve().is_dir():
        return wanted.resolve(), None  # a short folder linked by a run that did not close: reused, left alone
    short = Path(tempfile.mkdtemp(prefix="art-ray-"))
    if len(str(short)) > _SOCKET_PATH_ROOM:
        raise ConfigError(f"Ray's sockets need a temp folder path of at most {_SOCKET_PATH_ROOM} characters; "
                          f"{wanted} and {short} are longer: use a shorter path= or set TMPDIR to a short folder")
    wanted.parent.mkdir(parents=True, exist_ok=True)
    if wanted.exists():
        raise ConfigError(f"{wanted} exists and its path is too long for Ray's sockets; remove it or use a "
                          "shorter path=")
    wanted.symlink_to(short, target_is_directory=True)
    logging.getLogger(__name__).info("Ray's files are in %s (linked from %s: that path is too long for Ray's "
                                     "sockets)", short, wanted)
    return short, short


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).write_bytes(data)
