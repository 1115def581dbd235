"""Engine replicas as Ray actors, and the router that puts them behind the one gateway.

    gateway (driver) --Engine protocol--> ReplicaRouter --least loaded, sticky per rollout--> EngineReplica x N

The gateway renders prompts and records token ids; a replica only samples tokens. The router is an
``Engine`` like any other, so the gateway does not know there are replicas: it picks, for each request,
the replica the request's rollout already uses (its prefix cache holds the rollout's history) or else
the one with the fewest requests in flight.

A checkpoint reaches the replicas in one of two ways. With the pause policy (``RayBackend``'s default) the
gateway holds requests while every replica loads it at once, and resumes when all serve it. Without it
(``RayBackend(pause_during_step=False)``, the asynchronous pipeline) the replicas switch one at a time: the
router stops routing to one replica, waits for its requests in flight to finish on the old adapter, loads the
new one there, then moves to the next, so the others serve throughout and never all stop at once. A request
runs wholly on one replica, hence on one adapter, and its record's ``adapter_step`` says which.

A replica that dies (its node is lost) is dropped; its requests in flight are re-run on another replica
(nothing was recorded for them yet: the gateway records after the engine returns).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..._threads import HELPERS
from ...engines.base import EngineOutput, SamplingParams, check_adapter_path, routing_key
from ...errors import EngineError

__all__ = ["EngineReplica", "ReplicaRouter", "adapter_files"]

logger = logging.getLogger(__name__)

_STICKY_ROLLOUTS = 10_000  # rollouts remembered for stickiness; the oldest are forgotten first


def adapter_files(folder: Path) -> dict[str, bytes]:
    """The files of a PEFT adapter folder (config and weights; not the optimizer), to ship by value."""
    check_adapter_path(folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and p.name.startswith("adapter_")}


class EngineReplica:
    """One inference engine in a Ray actor (wrapped with ``ray.remote`` by ``RayBackend``).

    Call ``start()`` once before anything else: it loads the engine (a transformers model in this
    process, or a vLLM server subprocess of this actor's node started through ``LocalBackend``'s own
    ``inference_choice("vllm")``).

    Args:
        base_dir: the base model: a registered name or a folder on the replica's node.
        adapter: adapter files (``adapter_files``) to serve at start, or None for a fresh adapter.
        lora: the adapter's shape (``LoraSettings`` as a dict), used when ``adapter`` is None.
        step: the checkpoint step ``adapter`` is.
        engine: ``"transformers"`` or ``"vllm"``.
        num_threads: torch threads for this replica (None: torch's default).
        scratch: a folder on the replica's node for adapters received and engine logs (default: a temporary folder).
        vllm: ``VLLMOptions`` as a dict (``engine="vllm"``): the vLLM venv on this node, dtype, extra arguments.
        transformers: ``TransformersEngine`` keyword arguments (``TransformersOptions.engine_kwargs()``).
    """

    def __init__(self, *, base_dir: str, adapter: dict[str, bytes] | None, lora: dict[str, Any], step: int,
                 engine: str = "transformers", num_threads: int | None = None, scratch: str | None = None,
                 vllm: dict[str, Any] | None = None, transformers: dict[str, Any] | None = None) -> None:
        import torch

        if engine not in ("transformers", "vllm"):
            raise EngineError(f"replica engine {engine!r} is not available: use 'transformers' or 'vllm'")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._own_scratch = scratch is None  # a folder made here is removed by aclose; one given is the caller's
        self._scratch = Path(scratch or tempfile.mkdtemp(prefix="art-replica-"))
        self._scratch.mkdir(parents=True, exist_ok=True)
        self._kind, self._base_dir, self._lora, self._vllm = engine, base_dir, lora, vllm or {}
        self._transformers = transformers or {}
        self._adapter_dir = self._write(adapter, step) if adapter else None
        self._step = step
        self.engine: Any = None

    async def start(self) -> int:
        """Load the engine (once); returns the step it serves."""
        if self.engine is not None:
            return int(self.engine.adapter_step)
        if self._kind == "vllm":
            self.engine = await self._start_vllm()
        else:
            await HELPERS.run(self._start_transformers)
        return int(self.engine.adapter_step)

    def _start_transformers(self) -> None:
        import torch

        from ...config import LoraSettings
        from ...engines.transformers import TransformersEngine
        from ...models import resolve_base_model
        from ...training.loading import load_policy

        device = "cuda" if torch.cuda.is_available() else "cpu"
        policy, tokenizer = load_policy(resolve_base_model(self._base_dir), LoraSettings.model_validate(self._lora),
                                        device=device, adapter_dir=self._adapter_dir)
        policy.eval()
        self.engine = TransformersEngine(policy, tokenizer, adapter_step=self._step, **self._transformers)

    async def _start_vllm(self) -> Any:
        import torch
        from transformers import AutoTokenizer

        from ...config import LoraSettings
        from ...models import resolve_base_model
        from .._engines import EngineContext, VLLMOptions, inference_choice
        from ..base import ModelSpec

        base = resolve_base_model(self._base_dir)
        device = "cuda:0" if torch.cuda.is_available() else "cpu"  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
        tokenizer = await HELPERS.run(AutoTokenizer.from_pretrained, base)
        spec = ModelSpec(name="replica", project="ray", base_model=str(base),
                         lora=LoraSettings.model_validate(self._lora))
        # The replica has no trainer beside it: vLLM has its device alone and never sleeps.
        ctx = EngineContext(spec=spec, base_dir=base, policy=None, tokenizer=tokenizer, step=self._step,
                            adapter_dir=self._adapter_dir, trainer_device="none", inference_device=device,
                            trainer_shares=False, vllm=VLLMOptions(**self._vllm), log_dir=self._scratch / "logs")
        serving = await inference_choice("vllm").start(ctx)
        if self._adapter_dir is not None and serving.engine.adapter_step != self._step:
            await serving.engine.load_adapter(self._adapter_dir, self._step)
        return serving.engine

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        return await self.engine.generate(prompt_token_ids, params)

    async def load_adapter(self, files: dict[str, bytes], step: int) -> int:
        """Hot-load adapter ``files`` as checkpoint ``step`` (no base reload). Returns the step now served.

        The files are written under the scratch folder for the engine to read; once it serves them, the folders
        of older checkpoints are removed (all but the one served just before, which vLLM may still read for
        requests in flight), so a long run keeps two checkpoints on the replica's disk, not one per step.
        """
        folder = self._write(files, step)
        await self.engine.load_adapter(folder, step)
        keep = {folder, self._adapter_dir}
        self._adapter_dir = folder
        for old in self._scratch.glob("step-*"):
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)
        return self.engine.adapter_step

    async def adapter_step(self) -> int:
        return self.engine.adapter_step

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def health(self) -> dict[str, Any]:
        import ray

        return {**await self.engine.health(), "node_id": ray.get_runtime_context().get_node_id()}

    async def logprobs_of(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities of ``token_ids[1:]`` under the adapter served now (to verify what a replica serves).

        Raises:
            EngineError: a vLLM replica (score through ``generate`` with ``logprobs`` instead).
        """
        import torch

        if self._kind != "transformers":
            raise EngineError("logprobs_of needs a transformers replica; this one runs vLLM")

        def score() -> list[float]:
            model = self.engine.model
            with torch.no_grad():
                ids = torch.tensor([token_ids], device=model.device)
                logits = model(input_ids=ids).logits.float()  # [1, T, V]
                logps = torch.log_softmax(logits[0, :-1], dim=-1)
                return logps.gather(1, ids[0, 1:, None])[:, 0].tolist()

        return await HELPERS.run(score)

    async def aclose(self) -> None:
        """Stop the engine and remove the temporary folder made at start (``ray.kill`` runs no finalizer)."""
        try:
            if self.engine is not None:
                await self.engine.aclose()
        finally:
            if self._own_scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)

    def _write(self, files: dict[str, bytes], step: int) -> Path:
        folder = self._scratch / f"step-{step:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return folder


class ReplicaRouter:
    """An ``Engine`` that spreads requests over ``EngineReplica`` actors: least loaded, sticky per rollout.

    Args:
        replicas: actor handles of ``EngineReplica``.
        tokenizer: the model's tokenizer (the gateway renders prompts with it).
        step: the checkpoint step every replica serves at start.
    """

    def __init__(self, replicas: list[Any], tokenizer: Any, *, step: int) -> None:
        if not replicas:
            raise EngineError("a ReplicaRouter needs at least one replica")
        self.tokenizer = tokenizer
        self._replicas = list(replicas)
        self._load = [0] * len(replicas)  # requests in flight per replica
        self._served = [step] * len(replicas)  # step each replica confirmed serving
        self._alive = [True] * len(replicas)
        self._switching: int | None = None  # the replica taken out of routing to load a checkpoint
        self._drained = asyncio.Event()  # set when the switching replica has no request in flight
        self._sticky: OrderedDict[str, int] = OrderedDict()  # rollout id -> replica index
        self.routed = [0] * len(replicas)
        """Requests sent to each replica (for tests and metrics)."""
        self.sticky_hits = 0
        """Requests sent to the replica their rollout already used."""

    # -- the Engine protocol --------------------------------------------------------------------------

    @property
    def adapter_step(self) -> int:
        """The newest step a live replica serves: the checkpoint published last (while replicas switch one at a
        time, the others still serve the one before; each request's output says which served it)."""
        steps = [s for s, alive in zip(self._served, self._alive) if alive]
        return max(steps) if steps else -1

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        key = routing_key.get()
        while True:
            i = self._pick(key)
            self._load[i] += 1
            self.routed[i] += 1
            try:
                return await self._replicas[i].generate.remote(prompt_token_ids, params)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                # Nothing was recorded for this request yet: run it again on a replica still alive.
                self._drop(i, exc)
            finally:
                self._load[i] -= 1
                if i == self._switching and self._load[i] == 0:
                    self._drained.set()

    async def load_adapter(self, path: Path, step: int) -> None:
        """Ship the adapter in ``path`` to every replica through the object store; each hot-loads it."""
        await self.load_adapter_files(adapter_files(Path(path)), step)

    async def load_adapter_files(self, files: dict[str, bytes], step: int, *, one_at_a_time: bool = False) -> None:
        """Hot-load adapter ``files`` as ``step`` on every live replica; returns once each confirmed it.

        Args:
            files: the adapter's files (``adapter_files``).
            step: the checkpoint step they are.
            one_at_a_time: switch the replicas in turn, each out of routing and drained first, while the others
                serve (see the module docstring); False loads them all at once (the gateway holds requests).
        """
        import ray

        ref = ray.put(files)  # one copy in the object store, fetched once per node
        live = self._live()
        if not one_at_a_time or len(live) == 1:  # one replica: its engine swaps the adapter between requests
            steps = await asyncio.gather(*(self._replicas[i].load_adapter.remote(ref, step) for i in live),
                                         return_exceptions=True)
            for i, served in zip(live, steps):
                self._loaded(i, served)
            return
        for i in live:
            self._switching = i
            self._drained.clear()
            try:
                if self._load[i] > 0:
                    await self._drained.wait()  # its requests in flight finish on the adapter they started on
                served: Any
                try:
                    served = await self._replicas[i].load_adapter.remote(ref, step)
                except Exception as exc:
                    served = exc
                self._loaded(i, served)
            finally:
                self._switching = None

    @property
    def switching(self) -> int | None:
        """The replica out of routing while it loads a checkpoint (``one_at_a_time``), or None."""
        return self._switching

    def _loaded(self, i: int, served: Any) -> None:
        if isinstance(served, BaseException):
            self._drop(i, served)
        else:
            self._served[i] = int(served)

    async def pause(self) -> None:
        await self._each("pause")

    async def resume(self) -> None:
        await self._each("resume")

    async def health(self) -> dict[str, Any]:
        live = self._live()
        replies = await asyncio.gather(*(self._replicas[i].health.remote() for i in live), return_exceptions=True)
        return {"engine": "ray-replicas", "adapter_step": self.adapter_step, "replicas": len(self._replicas),
                "alive": len(live), "in_flight": [self._load[i] for i in live], "routed": list(self.routed),
                "replica_health": [r if isinstance(r, dict) else {"error": repr(r)} for r in replies]}

    async def aclose(self) -> None:
        await asyncio.gather(*(self._replicas[i].aclose.remote() for i in self._live()), return_exceptions=True)

    # -- replicas -------------------------------------------------------------------------------------

    @property
    def replicas(self) -> list[Any]:
        """Handles of the live replicas."""
        return [self._replicas[i] for i in self._live()]

    @property
    def all_replicas(self) -> list[Any]:
        """Handles of every replica started, live or lost."""
        return list(self._replicas)

    def _live(self) -> list[int]:
        return [i for i, alive in enumerate(self._alive) if alive]

    def replica_of(self, rollout_id: str) -> int | None:
        """The replica a rollout's calls go to (None: not seen, or forgotten)."""
        return self._sticky.get(rollout_id)

    def _pick(self, key: str | None) -> int:
        live = self._live()
        if not live:
            raise EngineError("every engine replica died: nothing left to sample with (see the Ray logs)")
        open_ = [i for i in live if i != self._switching] or live  # the last one left waits at its own queue
        if key is not None:
            i = self._sticky.get(key)
            if i is not None and i in open_:
                self._sticky.move_to_end(key)
                self.sticky_hits += 1
                return i
        i = min(open_, key=lambda j: (self._load[j], self.routed[j]))
        if key is not None:
            self._sticky[key] = i
            if len(self._sticky) > _STICKY_ROLLOUTS:
                self._sticky.popitem(last=False)
        return i

    def _drop(self, i: int, exc: BaseException) -> None:
        if self._alive[i]:
            logger.warning("engine replica %d is lost (%s); routing its requests to the others", i, exc)
        self._alive[i] = False

    async def _each(self, method: str) -> None:
        live = self._live()
        results = await asyncio.gather(*(getattr(self._replicas[i], method).remote() for i in live),
                                       return_exceptions=True)
        for i, result in zip(live, results):
            if isinstance(result, BaseException):
                self._drop(i, result)
