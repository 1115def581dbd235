"""The decode loop's oneDNN-packed linear layers (``engines/_packed.py``): same tokens and log-probs as the plain
layers, scoped to the decode, re-packed when the weights change, out of the way of gradients."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from art_core.engines import _packed as packed_module
from art_core.engines._packed import PackedLinears, packed_linears, packing_available
from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN")

PROMPTS = [[1, 9707, 11, 1122, 359, 346, 47], [1, 504, 2114, 281, 253, 2], [1, 3702, 30, 2, 198, 1]]


def _sampled(engine: TransformersEngine, tokens: int = 24):
    # Greedy: the random tiny model's distributions are near-uniform over 49k tokens (top probability ~4e-5),
    # so a seeded draw lands near a boundary between two tokens often enough for rounding to pick the
    # neighbour. (On SmolLM2, seeded draws: see engines/_packed.py.)
    params = [SamplingParams(max_tokens=tokens, temperature=0) for _ in PROMPTS]
    return [out for outs in engine.generate_batch(PROMPTS, params) for out in outs]


def _assert_same(packed, plain) -> float:
    worst = 0.0
    for a, b in zip(packed, plain, strict=True):
        assert a.token_ids == b.token_ids
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    assert worst < 1e-5
    return worst


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _lora_matrices(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's LoRA A and B matrices (found by their parameters' names, independently of ``_packed``'s search)."""
    modules = dict(model.named_modules())
    return [modules[name.rsplit(".", 1)[0]] for name, _ in model.named_parameters() if "lora_" in name]


async def test_packed_decode_samples_what_the_plain_layers_sample(tiny_model_dir):
    packed = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=True)
    plain = TransformersEngine(packed.model, packed.tokenizer, packed_weights=False)
    try:
        worst = _assert_same(_sampled(packed), _sampled(plain))
        print(f"packed vs plain linear layers: max |logprob gap| = {worst:.2e}")
        assert packed._packed is not None and packed._packed.packs == len(_linears(packed.model))
        # Only within the decode: afterwards the model's layers are plain nn.Linear again.
        assert not any("forward" in m.__dict__ for m in packed.model.modules())
        _sampled(packed)
        assert packed._packed.packs == len(_linears(packed.model))  # unchanged weights are not packed again
    finally:
        await packed.aclose()
        await plain.aclose()


async def test_a_training_step_on_the_shared_model_is_seen_by_the_next_decode(tiny_model_dir):
    base = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=True)
    model = get_peft_model(base.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    packed = TransformersEngine(model, base.tokenizer, packed_weights=True)
    plain = TransformersEngine(model, base.tokenizer, packed_weights=False)
    try:
        _sampled(packed)
        packs = packed._packed.packs
        # One optimizer step on the adapter, as LocalBackend's trainer takes on the shared model.
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        model(input_ids=torch.tensor([PROMPTS[0]])).logits.logsumexp(-1).mean().backward()
        optimizer.step()
        model.eval()
        packed.mark_adapter_step(1)  # as LocalBackend does (it drops the prompt states; the packed copies stay)
        # Stale copies would score with the old adapter: the log-probs must be the new model's.
        for prompt, out in zip(PROMPTS, _sampled(packed), strict=True):
            ids = torch.tensor([prompt + out.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            rescored = logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]]
            assert (rescored - torch.tensor(out.logprobs)).abs().max().item() < 1e-5
        assert packed._packed.packs == packs  # nothing packed again: the base is unchanged, LoRA's own are plain
        assert not set(_lora_matrices(model)) & set(packed._packed._packed)
    finally:
        for engine in (base, packed, plain):
            await engine.aclose()


@pytest.mark.parametrize("pack_adapter", [False, True], ids=["adapter-plain", "adapter-packed"])
async def test_a_checkpoint_swap_keeps_the_base_packed(tiny_model_dir, tmp_path, pack_adapter):
    """``load_adapter`` of the next checkpoint keeps the base weights' packed copies (a swap copies into the
    adapter's tensors, whose version counters say so) and decodes with the new adapter: rows sampled after the
    swap score as a fresh load of that checkpoint scores them. LoRA's own matrices are left plain, so nothing is
    packed again; with them packed (``pack_adapter=True``, for side-by-side measurements), exactly those are."""
    from peft import PeftModel
    from test_transformers_engine import _save_adapter
    from transformers import AutoModelForCausalLM

    for seed, folder in ((0, "a"), (1, "b")):
        _save_adapter(tiny_model_dir, tmp_path / folder, seed=seed)
    packed = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=True,
                                                      adapter_dir=tmp_path / "a", adapter_step=1)
    packed._packed = PackedLinears(pack_adapter=pack_adapter)
    try:
        _sampled(packed)
        packs = packed._packed.packs
        await packed.load_adapter(tmp_path / "b", step=2)
        outputs = _sampled(packed)
        lora_matrices = _lora_matrices(packed.model)
        assert len(lora_matrices) == 2 * 2 * 2  # q_proj and v_proj of the tiny model's 2 layers, A and B each
        assert packed._packed.packs == packs + (len(lora_matrices) if pack_adapter else 0)  # base copies kept
        assert bool(set(lora_matrices) & set(packed._packed._packed)) == pack_adapter
        fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "b").eval()
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            torch.testing.assert_close(torch.tensor(out.logprobs), _rescored(fresh, prompt, out.token_ids),
                                       atol=1e-5, rtol=0)
    finally:
        await packed.aclose()


async def test_weights_changed_drops_copies_an_edit_through_data_did_not_announce(tiny_model_dir):
    packed = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=True)
    plain = TransformersEngine(packed.model, packed.tokenizer, packed_weights=False)
    try:
        _sampled(packed)
        with torch.no_grad():
            for layer in _linears(packed.model):
                layer.weight.data += 0.05 * torch.randn_like(layer.weight)  # no version bump (as PEFT's merge)
        packed.weights_changed()
        _assert_same(_sampled(packed), _sampled(plain))
    finally:
        await packed.aclose()
        await plain.aclose()


async def test_gradients_inside_the_scope_go_through_the_plain_layers(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=False)
    model, ids = engine.model, torch.tensor([PROMPTS[0]])
    try:
        model.zero_grad()
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        packed = PackedLinears()
        with packed.active(model):
            model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        assert packed.packs == 0
        for p, grad in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, grad)
    finally:
        await engine.aclose()


async def test_nothing_is_packed_with_onednn_turned_off(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights=True)
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            _sampled(engine, tokens=4)
        assert engine._packed is not None and engine._packed.packs == 0
    finally:
        await engine.aclose()


def _rescored(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's log-probs from one forward over the whole sequence (no KV cache)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]]


async def test_bfloat16_packing_records_the_log_probs_of_the_policy_it_samples(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", packed_weights="bfloat16")
    try:
        outputs = _sampled(engine)
        packed = engine._packed
        assert packed is not None and packed.dtype == torch.bfloat16
        head = engine.model.get_output_embeddings()
        dtypes = {module: entry[1].dtype for module, entry in packed._packed.items()}
        assert len(dtypes) == len(_linears(engine.model))
        assert dtypes.pop(head) == torch.float32  # logits keep float32 precision
        assert set(dtypes.values()) == {torch.bfloat16}
        worst_own = worst_fp32 = 0.0
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            recorded = torch.tensor(out.logprobs)
            with packed.active(engine.model):  # the sampling policy: the same bf16 layers, without the cache
                worst_own = max(worst_own, (_rescored(engine.model, prompt, out.token_ids) - recorded).abs().max().item())
            worst_fp32 = max(worst_fp32, (_rescored(engine.model, prompt, out.token_ids) - recorded).abs().max().item())
        print(f"bf16 packing: |recorded - same policy| <= {worst_own:.1e}, |recorded - float32 model| <= {worst_fp32:.1e}")
        assert worst_own < 1e-3  # what the trainer's importance weights take as the behaviour policy
        assert 1e-5 < worst_fp32 < 0.1  # a policy of its own (bf16 matmuls), close to the float32 model's
    finally:
        await engine.aclose()


def test_a_packed_weights_setting_that_does_not_exist_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="packed_weights='float16'.*'bfloat16'"):
        packed_linears("float16")  # type: ignore[arg-type]
    monkeypatch.setattr(packed_module, "cpu_has_native_bf16", lambda: False)  # a CPU without AVX512-BF16 / AMX
    with pytest.warns(UserWarning, match="emulated.*packed_weights=True"):
        packed_linears("bfloat16")
