"""Prefix sharing: running a group's common prompt once gives the same log-probs and gradients."""

from __future__ import annotations

import pytest
import torch

from art_core import CallRecord, SFTConfig, TrainConfig, Trajectory, TrajectoryGroup
from art_core.config import LoraSettings
from art_core.training.batching import PackedGroups, PrefixGroup, plan_micro_batches
from art_core.training.forward import SharedPrefix, micro_batch_logprobs
from art_core.training.samples import trajectory_samples
from art_core.training.trainer import GRPOTrainer, load_policy


def _group(seed: int, prompt_len: int = 40, completions: tuple[int, ...] = (7, 3, 9, 5),
           system: list[int] | None = None) -> TrajectoryGroup:
    """A group of random tokens; ``system``: tokens its prompt starts with (a system prompt shared by groups)."""
    g = torch.Generator().manual_seed(seed)
    prompt = (system or []) + torch.randint(10, 1000, (prompt_len,), generator=g).tolist()
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


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_prompt_every_group_starts_with_runs_once_per_step(tiny_model_dir, beta):
    """Groups behind one system prompt: it runs once for the step (the root prefix), each group's task after it
    on the root's cache; the step's loss and updated weights are those of running every sequence whole (with a
    KL term too: the reference model's prefixes nest the same way)."""
    system = torch.randint(10, 1000, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    groups = [_group(4, prompt_len=12, system=system), _group(5, prompt_len=7, completions=(4, 8, 6), system=system),
              _group(6, prompt_len=9, completions=(5, 2), system=system)]
    samples = [[s for t in g for s in trajectory_samples(t)] for g in groups]
    plan = plan_micro_batches(samples, token_budget=4096)
    assert [pg.root_length for pg in plan] == [24, 24, 24]
    assert [len(pg.prefix_ids) for pg in plan] == [36, 31, 33]
    distinct = [_group(7), _group(8)]  # random prompts: nothing common to share
    assert [pg.root_length for pg in plan_micro_batches(
        [[s for t in g for s in trajectory_samples(t)] for g in distinct], token_budget=4096)] == [0, 0]

    results = []
    for share in (True, False):
        torch.manual_seed(0)
        model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
        for p in model.parameters():  # a non-zero adapter, so LoRA gradients flow through every path
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        trainer = GRPOTrainer(model, tokenizer)
        metrics = trainer.train_step(groups, TrainConfig(share_prefix=share, micro_batch_tokens=16, tis_cap=None,
                                                         beta=beta))
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((metrics, weights))
    (m_shared, w_shared), (m_full, w_full) = results
    whole = sum(len(s.token_ids) for g in samples for s in g)
    suffixes = sum(len(s.token_ids) - len(pg.prefix_ids) for g, pg in zip(samples, plan) for s in g)
    assert m_full["forward_tokens"] == whole
    assert m_shared["forward_tokens"] == 24 + (12 + 7 + 9) + suffixes  # the root once, then each group's task
    assert abs(m_shared["loss"] - m_full["loss"]) < 1e-6
    for name in w_full:
        torch.testing.assert_close(w_shared[name], w_full[name], atol=1e-6, rtol=1e-5)


class _KeepGradients:
    """A one-process ``StepSync`` that keeps a copy of the step's summed gradients (the step then applies them)."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def sum(self, values: list[float]) -> list[float]:
        return values

    def gradients(self, params) -> None:
        self.kept = [p.grad.detach().clone() for p in params]


@pytest.mark.parametrize(("system_tokens", "beta"), [(24, 0.0), (24, 0.1), (0, 0.0)])
def test_packed_groups_train_as_each_sequence_run_whole(tiny_model_dir, system_tokens, beta):
    """Small groups are packed: their prompts run as one batch (on the root prefix when they share one) and their
    completions share a micro-batch, each row behind its own prompt. The step's log-probs, loss and gradient are
    those of running every sequence whole (with a KL term too: the reference model's prompts are packed the same
    way); a budget too small to pack into fewer micro-batches leaves the groups apart."""
    system = torch.randint(10, 1000, (system_tokens,), generator=torch.Generator().manual_seed(9)).tolist()
    tasks = [n + (0 if system else 20) for n in (12, 7, 9)]  # without a root, each prompt long enough to share
    groups = [_group(4, prompt_len=tasks[0], system=system),
              _group(5, prompt_len=tasks[1], completions=(4, 8, 6), system=system),
              _group(6, prompt_len=tasks[2], completions=(5, 2), system=system)]
    samples = [[s for t in g for s in trajectory_samples(t)] for g in groups]
    (packed,) = plan_micro_batches(samples, token_budget=4096, pack_groups=True)
    assert isinstance(packed, PackedGroups) and len(packed.micro_batches) == 1
    assert packed.root_length == system_tokens and [len(p) for p in packed.prefixes] == [
        system_tokens + n for n in tasks]
    (mb,) = packed.micro_batches
    assert sorted(mb.prefix_rows.tolist()) == [0] * 4 + [1] * 3 + [2] * 2
    assert all(isinstance(pg, PrefixGroup) for pg in plan_micro_batches(samples, token_budget=64, pack_groups=True))

    results = []
    for share, pack in ((True, True), (False, True), (True, False)):  # packed, whole sequences, groups apart
        torch.manual_seed(0)
        model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
        for p in model.parameters():  # a non-zero adapter, so LoRA gradients flow through every path
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        sync = _KeepGradients()
        metrics = GRPOTrainer(model, tokenizer).train_step(
            groups, TrainConfig(share_prefix=share, pack_groups=pack, tis_cap=None, beta=beta), sync=sync)
        results.append((metrics, sync.kept))
    (m_packed, g_packed), (m_whole, g_whole), (m_apart, g_apart) = results
    assert m_packed["micro_batches"] == 1 and m_whole["micro_batches"] == m_apart["micro_batches"] == 3
    assert m_apart["forward_tokens"] == m_packed["forward_tokens"]
    suffixes = sum(len(s.token_ids) - len(prompt) for g, prompt in zip(samples, packed.prefixes) for s in g)
    assert m_packed["forward_tokens"] == system_tokens + sum(tasks) + suffixes  # real tokens, padding not counted
    assert abs(m_packed["loss"] - m_whole["loss"]) < 1e-6
    assert abs(m_packed["entropy"] - m_whole["entropy"]) < 1e-5
    assert g_whole and any(float(g.abs().max()) > 0 for g in g_whole)
    for packed_grad, apart_grad, whole_grad in zip(g_packed, g_apart, g_whole, strict=True):
        torch.testing.assert_close(packed_grad, whole_grad, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(apart_grad, whole_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("sft", [False, True])
def test_a_step_with_bf16_base_matmuls_moves_the_adapter_as_fp32_does(tiny_model_dir, sft):
    """``base_matmul_dtype="bfloat16"``: the step's loss and its change to every LoRA weight agree with the fp32
    step's to bf16 rounding (not bit for bit: the copy was used), the adapter stays fp32, the base is untouched."""
    groups = [_group(4, prompt_len=12), _group(5, prompt_len=7, completions=(4, 8, 6))]
    results = []
    for dtype in (None, "bfloat16"):
        torch.manual_seed(0)
        model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = GRPOTrainer(model, tokenizer)
        config = (SFTConfig(learning_rate=1e-3, base_matmul_dtype=dtype) if sft else
                  TrainConfig(learning_rate=1e-3, micro_batch_tokens=64, tis_cap=None, base_matmul_dtype=dtype))
        metrics = trainer.train_step(groups, config)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n not in trained)
        results.append((metrics["loss"], {n: p.detach() - before[n] for n, p in model.named_parameters()
                                          if n in trained}))
    (loss32, moves32), (loss16, moves16) = results
    assert abs(loss16 - loss32) < 0.02 * abs(loss32) + 1e-3  # GRPO's on-policy loss value is the ratio-1 one
    flat32 = torch.cat([m.flatten() for m in moves32.values()])
    flat16 = torch.cat([moves16[n].flatten() for n in moves32])
    assert not torch.equal(flat16, flat32)
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) > 0.99


def test_a_prefix_must_extend_its_parent(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    root = SharedPrefix(model, [11, 12, 13, 14], grad=False)
    child = SharedPrefix(model, [11, 12, 13, 14, 15, 16], grad=False, parent=root)
    whole = SharedPrefix(model, [11, 12, 13, 14, 15, 16], grad=False)
    torch.testing.assert_close(child.last_logits, whole.last_logits, atol=1e-5, rtol=1e-5)
    for bad in ([11, 12, 13, 14], [11, 12, 99, 14, 15]):
        with pytest.raises(ValueError, match="does not extend its parent"):
            SharedPrefix(model, bad, grad=False, parent=root)


def test_chunked_head_equals_full_logits(tiny_model_dir):
    """The LM head + log-softmax on chunks of trained positions gives the full [B, T, V] logits' log-probs,
    entropies and LoRA gradients (fp32, within 1e-6), with and without a shared prefix, in several chunks."""
    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    samples = [s for t in _group(4, prompt_len=20, completions=(9, 4, 12, 6)) for s in trajectory_samples(t)]
    for share in (True, False):
        (pg,) = plan_micro_batches([samples], token_budget=4096, share_prefix=share)
        (mb,) = pg.micro_batches
        g = torch.linspace(-1.0, 1.0, mb.input_ids.shape[1])  # a different upstream gradient per position

        model.zero_grad(set_to_none=True)
        prefix = SharedPrefix(model, pg.prefix_ids, grad=True) if pg.prefix_ids else None
        out = micro_batch_logprobs(model, mb, prefix, with_entropy=True, chunk_size=5)
        (out.logprobs * mb.trained * g).sum().backward()
        if prefix:
            prefix.backward()
        g_chunked = _grads(model)

        model.zero_grad(set_to_none=True)
        prefix = SharedPrefix(model, pg.prefix_ids, grad=True) if pg.prefix_ids else None
        full = micro_batch_logprobs(model, mb, prefix, with_entropy=True, chunk_size=None)  # the [B, T, V] logits
        (full.logprobs * mb.trained * g).sum().backward()
        if prefix:
            prefix.backward()
        g_full = _grads(model)

        assert (out.logprobs[mb.trained == 0] == 0).all()
        assert mb.trained.sum() > 12 and (mb.trained == 0).any()  # several chunks, and untrained positions
        torch.testing.assert_close(out.logprobs.detach(), full.logprobs.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(out.entropy, full.entropy, atol=0, rtol=1e-5)  # a stat: a 49k-term fp32 sum
        assert g_full.keys() == g_chunked.keys() and g_full
        for name in g_full:
            torch.testing.assert_close(g_chunked[name], g_full[name], atol=1e-6, rtol=1e-5)  # summation order


def test_chunked_token_logprobs_gradient_matches_autograd():
    """``d logp / d h`` computed in the forward pass equals autograd's through log_softmax (float64)."""
    from art_core.training.forward import chunked_token_logprobs

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, 50, (11,), generator=gen)
    upstream = torch.randn(11, dtype=torch.float64, generator=gen)
    lp, entropy = chunked_token_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True)
    (grad,) = torch.autograd.grad((lp * upstream).sum(), hidden)
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    ref = logp.gather(-1, targets[:, None])[:, 0]
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), hidden)
    torch.testing.assert_close(lp, ref.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1).detach(), atol=1e-12, rtol=0)
    try:
        chunked_token_logprobs(hidden, weight.requires_grad_(), targets)
    except ValueError as exc:
        assert "LM head" in str(exc)
    else:
        raise AssertionError("a trainable head must be refused")


def test_native_gqa_attention_changes_nothing_but_memory(tiny_model_dir):
    """Within ``native_gqa_attention`` the tiny Qwen2 (2 query heads per K/V head) gives the logits and LoRA
    gradients of transformers' own SDPA path, with padding in the batch; the model's setting is restored."""
    from art_core.training.forward import native_gqa_attention

    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    config = model.config
    assert config._attn_implementation == "sdpa" and config.num_key_value_heads < config.num_attention_heads
    ids = torch.randint(10, 1000, (3, 17), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # a padded row: transformers passes a mask, and repeats K/V without the switch
    runs = []
    for native in (False, True):
        model.zero_grad(set_to_none=True)
        if native:
            with native_gqa_attention(model):
                logits = model(input_ids=ids, attention_mask=mask).logits
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[mask > 0].float().logsumexp(-1).sum()).backward()
        runs.append((logits.detach(), _grads(model)))
    assert model.config._attn_implementation == "sdpa"
    (plain, g_plain), (native, g_native) = runs
    torch.testing.assert_close(native[mask > 0], plain[mask > 0], atol=1e-6, rtol=0)
    for name in g_plain:
        torch.testing.assert_close(g_native[name], g_plain[name], atol=1e-6, rtol=1e-5)


def test_lean_activations_give_the_same_bits(tiny_model_dir, monkeypatch):
    """The memory savings of the training forward (``SwiGLU`` with down_proj's input recomputed, one copy of a
    shared prefix's K/V in attention) leave the log-probs and every LoRA gradient bit for bit as plain autograd
    gives them, behind a shared prefix with a padded row; the MLPs' ``forward`` is the class's again after."""
    from contextlib import contextmanager

    from art_core.training import forward, lean_forward

    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    samples = [s for t in _group(3) for s in trajectory_samples(t)]
    for s in samples:
        s.advantage = 1.0
    plan = plan_micro_batches([samples], token_budget=4096, share_prefix=True)
    (mb,) = plan[0].micro_batches
    assert len(set(mb.attention_mask.sum(1).tolist())) > 1  # rows of different lengths: padding in the batch
    prefix_attention = lean_forward._PrefixAttention.apply
    calls = []
    monkeypatch.setattr(lean_forward._PrefixAttention, "apply", lambda *a: calls.append(1) or prefix_attention(*a))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        prefix = SharedPrefix(model, plan[0].prefix_ids, grad=True)
        out = micro_batch_logprobs(model, mb, prefix)
        (out.logprobs * mb.trained).sum().backward()
        prefix.backward()
        return out.logprobs.detach(), _grads(model)

    lean_lp, lean_grads = run()
    assert len(calls) == model.config.num_hidden_layers  # every layer's attention kept one prefix K/V copy

    @contextmanager
    def plain(model, prefix_length=0):
        with forward.native_gqa_attention(model):
            yield

    monkeypatch.setattr(forward, "lean_forward", plain)  # the prefix's forward and the micro-batches' alike
    plain_lp, plain_grads = run()
    assert torch.equal(lean_lp, plain_lp)
    assert lean_grads.keys() == plain_grads.keys() and lean_grads
    for name in plain_grads:
        assert torch.equal(lean_grads[name], plain_grads[name]), name
    assert not any("forward" in vars(m) for m in model.modules())


def test_bf16_base_matmuls_warn_once_on_a_cpu_that_emulates_bf16(tiny_model_dir, monkeypatch):
    """Where /proc/cpuinfo shows no AVX512-BF16 or AMX-BF16, bf16 GEMMs are slower than fp32's: the first step
    that asks for them says so. This machine has native bf16, so the CPU check is faked (what cannot run here)."""
    import warnings

    from art_core.training import trainer as trainer_module

    def emulated_warnings(trainer: GRPOTrainer) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(groups, TrainConfig(base_matmul_dtype="bfloat16"))
        return sum("emulated and slower than float32" in str(w.message) for w in caught)

    groups = [_group(4, prompt_len=12)]
    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: False)
    trainer = GRPOTrainer(*load_policy(tiny_model_dir, LoraSettings(), device="cpu"))
    assert [emulated_warnings(trainer), emulated_warnings(trainer)] == [1, 0]  # once per trainer
    monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda: True)
    assert emulated_warnings(GRPOTrainer(*load_policy(tiny_model_dir, LoraSettings(), device="cpu"))) == 0


def test_no_forward_of_ours_uses_the_deprecated_cache_name(tiny_model_dir):
    """transformers 5 renamed a forward's ``past_key_values`` to ``cache`` and warns on the old name (gone in 5.40):
    a training step through every prefix path (the root, packed groups' prompts, their micro-batches) and a decode
    batch (prefill, rows joining, steps) pass the KV cache by the installed release's name, so none warns."""
    import warnings

    from art_core.engines._batch import RunningBatch

    system = torch.randint(10, 1000, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    groups = [_group(4, prompt_len=12, system=system), _group(5, prompt_len=7, completions=(4, 8, 6), system=system)]
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # past the once-per-location registry
        GRPOTrainer(model, tokenizer).train_step(groups, TrainConfig(micro_batch_tokens=16, pack_groups=True))
        with torch.no_grad():
            batch = RunningBatch(model, pad_id=0)
            batch.add([system[:5]], copies=[2])
            batch.step(torch.tensor([11, 12]))
            batch.add([system[:9]], copies=[1])
            batch.step(torch.tensor([13, 14, 15]))
    assert batch.logits is not None and batch.logits.shape[0] == 3
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []
