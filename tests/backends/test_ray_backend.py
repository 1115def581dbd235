"""RayBackend on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``) on this machine.

One scenario, in order, on one cluster (starting Ray and its actors is most of the cost):
2 transformers replicas behind the gateway, 8 rollout workers running a LangGraph agent, a 2-rank gloo
trainer group whose summed LoRA gradients match one process, the adapter shipped to both replicas and
checked there, then a node removed mid-rollout: its rollouts are counted failed and run again, every
group comes back whole, and training goes on.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs art-core[distributed]")

from art_core import (CallRecord, LoraSettings, TrainableModel, TrainConfig, Trajectory,  # noqa: E402
                      TrajectoryGroup, TransformersOptions)
from art_core.backends.ray import RayBackend  # noqa: E402
from art_core.training.trainer import GRPOTrainer, load_policy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HERE = Path(__file__).resolve().parent
ROLLOUT = "ray_agents:solve"


@pytest.fixture(scope="module")
def scripted_dir(smollm2_dir: Path) -> Path:
    from ray_agents import script
    from scripted_model import fit_scripted_model

    return fit_scripted_model(smollm2_dir, script())


def _runtime_env() -> dict[str, Any]:
    root = HERE.parent.parent
    paths = [str(root / "core"), str(root), str(HERE.parent), str(HERE)]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1",
                         "TOKENIZERS_PARALLELISM": "false"}}


class _Recording:
    """The single-process reference: no other rank, so sums are the values; keeps the gradients."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def sum(self, values: list[float]) -> list[float]:
        return values

    def gradients(self, params: Any) -> None:
        self.recorded = [p.grad.detach().clone() for p in params]


async def test_ray_backend_scenario(cluster: Any, scripted_dir: Path, tmp_path: Path) -> None:
    import torch

    lora = LoraSettings(rank=4, alpha=8)
    model = TrainableModel(name="agent", base_model=scripted_dir, lora=lora)
    backend = RayBackend(address=cluster.address, path=tmp_path, inference_replicas=2, trainer_workers=2,
                         rollout_workers=8, rollouts_per_worker=2, num_threads=1, cpus_per_replica=1,
                         cpus_per_rank=1, runtime_env=_runtime_env(),
                         resources={"trainer": {"head": 1}})
    async with backend:
        await model.register(backend)
        router = backend.router(model.spec)
        assert len(router.replicas) == 2
        nodes = {h["node_id"] for h in (await router.health())["replica_health"]}
        assert len(nodes) == 2, "the two replicas were spread over the two nodes"

        # --- 8 rollout workers run the LangGraph agent against the one gateway ---
        groups = await backend.gather(model.spec, ROLLOUT, [{"delay": 0.0}] * 4, n=4)
        stats = backend.rollout_stats(model.spec, ROLLOUT)
        assert stats.succeeded == 16 and stats.failed_exception == 0, stats
        assert [len(g) for g in groups] == [4, 4, 4, 4]
        for group in groups:
            for t in group.trajectories:
                assert len(t.calls) == 3 and t.messages[-1].content == "The answer is 14."
                assert all(c.adapter_step == 0 and c.logprobs for c in t.calls)
                assert router.replica_of(t.metadata["rollout_id"]) in (0, 1)
        assert all(n > 0 for n in router.routed), f"both replicas served requests: {router.routed}"
        # Stickiness: the rollout id reaches the router through the gateway, so each rollout's 2nd and 3rd
        # calls go to the replica its first call went to.
        assert sum(router.routed) == 48 and router.sticky_hits == 32

        # --- a 2-rank step: gradients equal one process's; the adapter goes to both replicas ---
        before = await backend.trainer_group(model.spec).adapter()
        start_dir = tmp_path / "start-adapter"
        start_dir.mkdir()
        for name, data in before.items():
            (start_dir / name).write_bytes(data)
        # On groups of distinct sequences: the scripted model answers greedily, so every rollout of a gathered group
        # is the same sequence and its GRPO gradient is zero (what two ranks and one process sum would be rounding
        # noise, summed in different orders). The gathered groups train at the end of the scenario.
        token_groups = _token_groups(1)
        config = TrainConfig(learning_rate=1e-3)
        result = await backend.train_step(model.spec, token_groups, config, return_gradients=True)
        assert result["step"] == 1 and result["metrics"]["trained"] == 1.0
        assert all(result["shares"]), f"both ranks got groups: {result['shares']}"
        rank0, rank1 = result["gradients"]
        policy, tokenizer = load_policy(scripted_dir, lora, device="cpu", adapter_dir=start_dir)
        reference = _Recording()
        GRPOTrainer(policy, tokenizer).train_step(token_groups, config, sync=reference)
        names = [n for n, p in policy.named_parameters() if p.requires_grad]
        diff = max(float((torch.tensor(rank0[n]) - g).abs().max()) for n, g in zip(names, reference.recorded))
        scale = max(float(g.abs().max()) for g in reference.recorded)
        rank_diff = max(float(abs(rank0[n] - rank1[n]).max()) for n in names)
        print(f"LoRA gradient max abs diff, 2 ranks vs 1 process: {diff:.3e} (largest gradient {scale:.3e}); "
              f"rank 0 vs rank 1: {rank_diff:.3e}")
        assert scale > 0 and diff <= 1e-4 * scale
        assert rank_diff == 0.0

        # The new adapter is served by both replicas: their log-probs equal the checkpoint's in one process.
        ckpt = tmp_path / "default" / "models" / "agent" / "checkpoints" / "0001"
        assert (ckpt / "adapter_model.safetensors").is_file()
        assert router.adapter_step == 1 and await backend.checkpoints(model.spec) == [1]
        trained, _ = load_policy(scripted_dir, lora, device="cpu", adapter_dir=ckpt)
        ids = groups[0].trajectories[0].calls[0].prompt_token_ids + groups[0].trajectories[0].calls[0].completion_token_ids
        with torch.no_grad():
            logits = trained(input_ids=torch.tensor([ids])).logits.float()[0, :-1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        for replica in router.replicas:
            assert await replica.adapter_step.remote() == 1
            got = torch.tensor(await replica.logprobs_of.remote(ids))
            assert float((got - want).abs().max()) < 1e-4
        base_policy, _ = load_policy(scripted_dir, lora, device="cpu", adapter_dir=start_dir)
        with torch.no_grad():
            old = torch.log_softmax(base_policy(input_ids=torch.tensor([ids])).logits.float()[0, :-1], -1)
            old = old.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert float((old - want).abs().max()) > 1e-4, "the step changed the served log-probs"

        # --- a node is lost mid-rollout: its rollouts fail, are counted and run again; training goes on ---
        # The rollouts wait mid-call at a gate the test opens once the node is gone, so some are surely running
        # on it when it goes (no guess at how long they take to get there).
        gate = tmp_path / "gate"
        gate.mkdir()
        gathering = asyncio.create_task(
            backend.gather(model.spec, ROLLOUT, [{"gate": str(gate)}] * 4, n=4))
        lost_node = cluster.worker.node_id
        # The replica on the node about to be lost dies unclosed, its scratch folder left on that node's disk:
        # here the "node" is processes on this machine, so the test removes that folder itself at the end.
        replica_folders = [Path(await r.__ray_call__.remote(lambda actor: str(actor._scratch)))
                           for r in router.replicas]
        deadline = asyncio.get_running_loop().time() + 120
        while not any(gate.glob(f"started-{lost_node}-*")):
            assert asyncio.get_running_loop().time() < deadline, "no rollout reached the gate on the worker node"
            assert not gathering.done(), gathering
            await asyncio.sleep(0.05)
        await asyncio.to_thread(cluster.remove_node, cluster.worker, False)
        (gate / "open").touch()
        groups = await asyncio.wait_for(gathering, timeout=120)
        stats = backend.rollout_stats(model.spec, ROLLOUT)
        print(f"after losing a node: {stats}")
        assert stats.failed_lost_worker > 0 and stats.retried == stats.failed_lost_worker and stats.gave_up == 0
        assert stats.succeeded == 16 and [len(g) for g in groups] == [4, 4, 4, 4]
        assert all(c.adapter_step == 1 for g in groups for t in g.trajectories for c in t.calls)
        assert len(router.replicas) == 1, "the lost node's replica was dropped"
        metrics = await model.train(groups, config=config)
        assert model.step == 2 and metrics["trained"] == 1.0 and router.adapter_step == 2
        assert len(await backend.history(model.spec)) == 2

        # Each replica and rank keeps the adapters it received in a temporary folder of its own.
        actors = [*router.replicas, *backend.trainer_group(model.spec).ranks]
        scratch = [Path(await a.__ray_call__.remote(lambda actor: str(actor._scratch))) for a in actors]
        assert len(scratch) == 3 and all(folder.is_dir() for folder in scratch)
    assert not [folder for folder in scratch if folder.exists()], "closing the backend removed the actors' folders"
    for folder in set(replica_folders) - set(scratch):  # the lost node's replica's
        shutil.rmtree(folder, ignore_errors=True)


def _token_groups(seed: int) -> list[TrajectoryGroup]:
    """Four groups of three one-call trajectories with token ids only (no text), of unequal lengths and rewards."""
    import random

    rng = random.Random(seed)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(100, 5000) for _ in range(6 + 5 * g)]
        groups.append(TrajectoryGroup([
            Trajectory(messages=[], reward=float(i == g % 3) + 0.1 * i,
                       calls=[CallRecord(prompt_token_ids=prompt,
                                         completion_token_ids=[rng.randrange(100, 5000) for _ in range(4 + i + g)])])
            for i in range(3)]))
    return groups


async def test_fsdp2_trainer_group_matches_one_process(cluster: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """``sharding="fsdp"``: two ranks each hold half the base (FSDP2); the step's LoRA gradients equal one process's."""
    import torch

    lora = LoraSettings(rank=4, alpha=8)
    model = TrainableModel(name="sharded", base_model=tiny_model_dir, lora=lora)
    backend = RayBackend(address=cluster.address, path=tmp_path, inference_replicas=1, trainer_workers=2,
                         num_threads=1, cpus_per_replica=1, cpus_per_rank=1, runtime_env=_runtime_env(),
                         sharding="fsdp")
    groups = _token_groups(0)
    async with backend:
        await model.register(backend)
        assert model.api_key is None, "the contract's api_key(model): a loopback gateway wants no key"
        trainer = backend.trainer_group(model.spec)
        assert trainer.sharded
        start = tmp_path / "start"
        start.mkdir()
        for name, data in (await trainer.adapter()).items():
            (start / name).write_bytes(data)
        config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=32)
        result = await backend.train_step(model.spec, groups, config, return_gradients=True)
        assert result["step"] == 1 and all(result["shares"])
        assert backend.router(model.spec).adapter_step == 1, "the replica serves the sharded group's adapter"
    policy, tokenizer = load_policy(tiny_model_dir, lora, device="cpu", adapter_dir=start)
    reference = _Recording()
    GRPOTrainer(policy, tokenizer).train_step(groups, config, sync=reference)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    rank0, rank1 = result["gradients"]
    diff = max(float((torch.tensor(rank0[n]) - g).abs().max()) for n, g in zip(names, reference.recorded))
    scale = max(float(g.abs().max()) for g in reference.recorded)
    print(f"FSDP2 trainer group: LoRA gradient max abs diff, 2 ranks vs 1 process: {diff:.3e} "
          f"(largest gradient {scale:.3e})")
    assert scale > 0 and diff <= 1e-4 * scale
    assert all((rank0[n] == rank1[n]).all() for n in names)


async def test_replicas_take_the_transformers_engine_options(cluster: Any, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """``RayBackend(transformers=TransformersOptions(...))`` reaches each replica's engine: with packed weights, its
    decode runs through the packed copies, before and after a step's adapter is loaded."""
    model = TrainableModel(name="packed", base_model=tiny_model_dir, lora=LoraSettings(rank=4, alpha=8))
    backend = RayBackend(address=cluster.address, path=tmp_path, num_threads=1, cpus_per_replica=1,
                         cpus_per_rank=1, runtime_env=_runtime_env(),
                         transformers=TransformersOptions(packed_weights=True, max_batch_rows=4))
    async with backend:
        await model.register(backend)
        router = backend.router(model.spec)
        [replica] = (await router.health())["replica_health"]
        assert replica["packed_layers"] == 0, "nothing decoded yet: no copy packed"
        chat = [{"role": "user", "content": "Hi"}]
        first = await model.sample(chat, n=2, max_tokens=4, temperature=1.0)
        [replica] = (await router.health())["replica_health"]
        # 2 layers x (q, k, v, o, gate, up, down), and the output embedding (LoRA's own matrices stay plain)
        linears = 2 * 7 + 1
        assert replica["packed_layers"] == linears and replica["max_rows"] == 2
        first[0].reward, first[1].reward = 1.0, 0.0
        await model.train([TrajectoryGroup(first)], config=TrainConfig(learning_rate=1e-3))
        [after] = await model.sample(chat, n=1, max_tokens=4)
        [replica] = (await router.health())["replica_health"]
        assert replica["adapter_step"] == 1 and after.calls[0].adapter_step == 1
        assert replica["packed_layers"] == linears


async def test_a_replica_keeps_two_checkpoints_on_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A replica writes each checkpoint it receives to its scratch folder for its engine to read; once the engine
    serves it, older folders go, the one served just before staying (vLLM may still read it for requests in
    flight): two on disk at any time, not one per step. ``EngineReplica`` runs in this process here: it is a
    plain class until ``RayBackend`` wraps it with ``ray.remote``."""
    from art_core.backends.ray.replicas import EngineReplica, adapter_files

    lora = LoraSettings(rank=4, alpha=8)
    policy, _ = load_policy(tiny_model_dir, lora, device="cpu")
    policy.save_pretrained(tmp_path / "checkpoint")
    files = adapter_files(tmp_path / "checkpoint")
    scratch = tmp_path / "scratch"
    replica = EngineReplica(base_dir=str(tiny_model_dir), adapter=files, lora=lora.model_dump(), step=0,
                            scratch=str(scratch))
    try:
        assert await replica.start() == 0
        for step in (1, 2, 3):
            assert await replica.load_adapter(files, step) == step
            assert sorted(p.name for p in scratch.glob("step-*")) == [f"step-{s:04d}" for s in (step - 1, step)]
    finally:
        await replica.aclose()
    assert scratch.is_dir()  # a folder the caller gave is the caller's to remove
