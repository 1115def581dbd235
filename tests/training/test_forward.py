"""Prefix sharing: running a group's common prompt once gives the same log-probs and gradients."""

from __future__ import annotations

import torch

from art_core import CallRecord, TrainConfig, Trajectory, TrajectoryGroup
from art_core.config import LoraSettings
from art_core.training.batching import plan_micro_batches
from art_core.training.forward import SharedPrefix, micro_batch_logprobs
from art_core.training.samples import trajectory_samples
from art_core.training.trainer import GRPOTrainer, load_policy


def _group(seed: int, prompt_len: int = 40, completions: tuple[int, ...] = (7, 3, 9, 5)) -> TrajectoryGroup:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, 1000, (prompt_len,), generator=g).tolist()
    trajectories = []
    for i, n in enumerate(completions):
        completion = torch.randint(10, 1000, (n,), generator=g).tolist()
        trajectories.append(Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=completion)],
                                       reward=float(i)))
    return TrajectoryGroup(trajectories)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_shared_prefix_matches_full_sequences(tiny_model_dir):
    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    for p in model.parameters():  # a non-zero adapter, so LoRA gradients flow through every path
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    samples = [s for t in _group(1) for s in trajectory_samples(t)]
    for s in samples:
        s.advantage = 1.0

    def run(share: bool):
        (pg,) = plan_micro_batches([samples], token_budget=4096, share_prefix=share)
        prefix = SharedPrefix(model, pg.prefix_ids, grad=True) if pg.prefix_ids else None
        (mb,) = pg.micro_batches
        out = micro_batch_logprobs(model, mb, prefix)
        (out.logprobs * mb.trained).sum().backward()
        if prefix:
            prefix.backward()
        trained = [out.logprobs[i][mb.trained[i] > 0] for i in range(len(mb.samples))]
        order = [id(s) for s in mb.samples]
        return dict(zip(order, trained)), len(pg.prefix_ids)

    shared, prefix_len = run(True)
    g_shared = _grads(model)
    model.zero_grad(set_to_none=True)
    full, no_prefix = run(False)
    g_full = _grads(model)
    assert prefix_len == 40 and no_prefix == 0
    for key in full:
        torch.testing.assert_close(shared[key], full[key], atol=1e-5, rtol=1e-5)
    assert g_full.keys() == g_shared.keys() and g_full
    for name in g_full:
        torch.testing.assert_close(g_shared[name], g_full[name], atol=1e-5, rtol=1e-4)


def test_trainer_step_is_the_same_with_and_without_prefix_sharing(tiny_model_dir):
    groups = [_group(2), _group(3, prompt_len=25, completions=(4, 8, 6))]
    results = []
    for share in (True, False):
        torch.manual_seed(0)
        model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
        trainer = GRPOTrainer(model, tokenizer)
        metrics = trainer.train_step(groups, TrainConfig(share_prefix=share, micro_batch_tokens=16))
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((metrics, weights))
    (m_shared, w_shared), (m_full, w_full) = results
    assert m_shared["forward_tokens"] < m_full["forward_tokens"]  # the prompts ran once per group
    assert m_shared["micro_batches"] > 2  # the small budget split each group: leaves carry grads across
    assert abs(m_shared["loss"] - m_full["loss"]) < 1e-6
    for name in w_full:
        torch.testing.assert_close(w_shared[name], w_full[name], atol=1e-6, rtol=1e-5)
