"""``fused_lora``: PEFT's LoRA layers as two GEMMs and an accumulate give PEFT's values and gradients."""

from __future__ import annotations

import torch

import gc

import pytest

from art_core._cpu import onednn_packing_available
from art_core.config import LoraSettings
from art_core.training.fused_lora import BaseWeight, LoraLinear, base_matmuls, fused_lora
from art_core.training.trainer import load_policy


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _randomised(model) -> None:
    for p in model.parameters():
        if p.requires_grad:  # LoRA B starts at zero, which would hide a wrong B path
            torch.nn.init.normal_(p, std=0.05)


def test_lora_linear_gradients_match_finite_differences():
    """``LoraLinear``'s hand-written backward against numerical gradients (float64), with and without a bias."""
    torch.manual_seed(0)
    for bias in (torch.randn(5, dtype=torch.float64), None):
        x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(5, 4, dtype=torch.float64)
        lora_a = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
        lora_b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, a, b: LoraLinear.apply(x, weight, bias, a, b, 1.5),
                                        (x, lora_a, lora_b))
        expected = x @ weight.t() + (bias if bias is not None else 0) + 1.5 * (x @ lora_a.t()) @ lora_b.t()
        torch.testing.assert_close(LoraLinear.apply(x, weight, bias, lora_a, lora_b, 1.5), expected)


def test_fused_lora_gives_pefts_logits_and_gradients(tiny_model_dir):
    """The tiny Qwen2 (biased q/k/v projections) with every LoRA layer fused: PEFT's logits and LoRA gradients
    to float rounding; the layers' ``forward`` is the class's again after the block."""
    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    _randomised(model)
    ids = torch.randint(10, 1000, (3, 17), generator=torch.Generator().manual_seed(5))
    runs = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        with fused_lora(model) if fused else torch.enable_grad():
            patched = sum("forward" in vars(m) for m in model.modules())
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        runs.append((logits.detach(), _grads(model), patched))
    (plain, g_plain, none), (fused, g_fused, patched) = runs
    layers = model.config.num_hidden_layers * len(model.peft_config["default"].target_modules)
    assert none == 0 and patched == layers
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert g_fused.keys() == g_plain.keys() and g_plain
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], atol=1e-6, rtol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())


def test_fused_lora_leaves_what_it_cannot_fuse_to_peft(tiny_model_dir):
    """LoRA dropout is left to PEFT's layers; without autograd (the path taken under ``no_grad``) the fused layers
    give PEFT's logits, and a disabled adapter still gives the base model's."""
    model, _ = load_policy(tiny_model_dir, LoraSettings(dropout=0.1), device="cpu")
    with fused_lora(model):
        assert not any("forward" in vars(m) for m in model.modules())

    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    _randomised(model)
    ids = torch.randint(10, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with fused_lora(model), model.disable_adapter():
            fused_disabled = model(input_ids=ids).logits
        peft = model(input_ids=ids).logits
        with fused_lora(model):
            adapted = model(input_ids=ids).logits
    assert torch.equal(fused_disabled, base)
    torch.testing.assert_close(adapted, peft, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adapted, base)  # the adapter does act when enabled


def test_a_bf16_base_changes_only_the_base_products():
    """``LoraLinear`` given a bf16 copy of W: the base product, forward and backward, is bf16's (exact to bf16
    inputs, rounded once to bf16), the LoRA path and its gradients are the fp32 path's bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(6, 64)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    lora_a, lora_b = torch.randn(4, 64) * 0.1, torch.randn(48, 4) * 0.1
    upstream = torch.randn(6, 48)
    runs = []
    for base in (None, BaseWeight(weight, torch.bfloat16, packed=False)):
        xs, a, b = (t.clone().requires_grad_(True) for t in (x, lora_a, lora_b))
        out = LoraLinear.apply(xs, weight, bias, a, b, 2.0, base)
        out.backward(upstream)
        runs.append((out.detach(), xs.grad, a.grad, b.grad))
    (out32, gx32, ga32, gb32), (out16, gx16, ga16, gb16) = runs
    lora = 2.0 * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    base_exact = x.bfloat16().double() @ weight.bfloat16().double().t()  # bf16 inputs, exact products
    base16 = out16.double() - bias.double() - lora
    assert ((base16 - base_exact).abs() <= base_exact.abs() * 2**-8 + 1e-4).all()  # one bf16 rounding
    assert (out16 - out32).abs().max() > 1e-3  # bf16 was used: fp32 agrees to ~1e-5
    torch.testing.assert_close(out16, out32, atol=0.1, rtol=0.02)
    grad_base_exact = upstream.bfloat16().double() @ weight.bfloat16().double()
    grad_base16 = gx16.double() - 2.0 * (upstream.double() @ lora_b.double()) @ lora_a.double()
    assert ((grad_base16 - grad_base_exact).abs() <= grad_base_exact.abs() * 2**-8 + 1e-4).all()
    assert torch.equal(ga16, ga32) and torch.equal(gb16, gb32)  # the LoRA gradients never see the base copy


def test_base_matmuls_keep_one_copy_per_weight_for_as_long_as_it_lives(tiny_model_dir):
    """Within ``base_matmuls``: one bf16 copy per fused layer, made at the first forward and reused after, remade
    when its weight changes in place, dropped with the weight; logits within bf16 rounding of fp32's; outside the
    block the model computes in fp32 again."""
    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    _randomised(model)
    ids = torch.randint(10, 1000, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), fused_lora(model):
        fp32 = model(input_ids=ids).logits
    copies: dict = {}
    layers = model.config.num_hidden_layers * len(model.peft_config["default"].target_modules)
    with fused_lora(model), base_matmuls(torch.bfloat16, copies):
        low = model(input_ids=ids).logits
        made = {key: entry[2] for key, entry in copies.items()}
        model(input_ids=ids).logits.sum().backward()
        assert len(copies) == layers and all(copies[key][2] is made[key] for key in made)  # reused
        q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        with torch.no_grad():
            q_proj.mul_(1.0)  # an in-place change (as a merge makes): the copy is remade
        model(input_ids=ids)
        assert copies[id(q_proj)][2] is not made[id(q_proj)]
    assert all(entry[2].dtype == torch.bfloat16 for entry in copies.values())
    assert (low - fp32).abs().max() > 1e-4
    torch.testing.assert_close(low, fp32, atol=0.05, rtol=0.05)
    with torch.no_grad(), fused_lora(model):
        assert torch.equal(model(input_ids=ids).logits, fp32)  # the block is over: fp32 products again
    del model, q_proj
    gc.collect()
    assert copies == {}


@pytest.mark.skipif(not onednn_packing_available(), reason="this PyTorch has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepacked_base_gives_the_unpacked_copy_products_to_rounding(dtype):
    """``BaseWeight(packed=True)``: the forward product and the input gradient through oneDNN's blocked copies
    equal the plain copy's (fp32: to float rounding; bf16: both round the output to bf16, so to one bf16 ulp);
    the LoRA gradients do not see the base at all."""
    torch.manual_seed(0)
    x, upstream = torch.randn(7, 64), torch.randn(7, 48)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    lora_a, lora_b = torch.randn(4, 64) * 0.1, torch.randn(48, 4) * 0.1
    runs = []
    for packed in (False, True):
        xs, a, b = (t.clone().requires_grad_(True) for t in (x, lora_a, lora_b))
        out = LoraLinear.apply(xs, weight, bias, a, b, 2.0, BaseWeight(weight, dtype, packed=packed))
        out.backward(upstream)
        runs.append((out.detach(), xs.grad, a.grad, b.grad))
    (out_plain, gx_plain, ga_plain, gb_plain), (out_packed, gx_packed, ga_packed, gb_packed) = runs
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2**-7}
    torch.testing.assert_close(out_packed, out_plain, **tolerance)
    torch.testing.assert_close(gx_packed, gx_plain, **tolerance)
    torch.testing.assert_close(ga_packed, ga_plain, **tolerance)  # through x's gradient only in the loss above
    assert torch.equal(gb_packed, gb_plain) or dtype == torch.bfloat16


@pytest.mark.skipif(not onednn_packing_available(), reason="this PyTorch has no oneDNN")
def test_prepacked_base_matmuls_run_through_onednn_and_train_as_the_plain_layers(tiny_model_dir):
    """``base_matmuls(None, copies, packed=True)``: every fused layer's base products run through oneDNN's packed
    copies (the profiler sees its operator; one packed copy per layer, fp32), and the logits and LoRA gradients
    equal the plain fp32 layers' to float rounding."""
    torch.manual_seed(0)
    model, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    _randomised(model)
    ids = torch.randint(10, 1000, (2, 11), generator=torch.Generator().manual_seed(3))

    def step(**matmuls) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with fused_lora(model), base_matmuls(**matmuls):
                logits = model(input_ids=ids).logits
                logits.logsumexp(-1).mean().backward()
        return logits.detach(), _grads(model), [event.key for event in prof.key_averages()]

    plain_logits, plain_grads, plain_ops = step(dtype=None, copies={})
    copies: dict = {}
    packed_logits, packed_grads, packed_ops = step(dtype=None, copies=copies, packed=True)
    layers = model.config.num_hidden_layers * len(model.peft_config["default"].target_modules)
    assert len(copies) == layers
    assert all(entry[2].packed and entry[2].dtype == torch.float32 for entry in copies.values())
    assert "mkldnn::_linear_pointwise" in packed_ops and "mkldnn::_linear_pointwise" not in plain_ops
    torch.testing.assert_close(packed_logits, plain_logits, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == plain_grads.keys() and plain_grads
    for name in plain_grads:
        torch.testing.assert_close(packed_grads[name], plain_grads[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.skipif(not onednn_packing_available(), reason="this PyTorch has no oneDNN")
@pytest.mark.parametrize("block_dtype", [None, torch.bfloat16])
def test_a_prepacked_block_runs_the_lm_head_on_a_packed_copy_in_its_own_dtype(block_dtype):
    """In a ``base_matmuls(packed=True)`` block the chunked LM head (``chunked_token_logprobs``) takes both its
    products on a oneDNN-packed copy of the head, in the head's own dtype even in a bf16 block (the log-probs the
    loss and the importance ratios read stay fp32's): log-probs, entropy and input gradient equal the plain
    head's to float rounding; outside the block no copy is made."""
    from art_core.training.forward import chunked_token_logprobs

    torch.manual_seed(0)
    hidden, weight = torch.randn(9, 32), torch.randn(200, 32)
    targets = torch.randint(0, 200, (9,))
    copies: dict = {}

    def run(block: dict | None) -> tuple[tuple[torch.Tensor, ...], list[str]]:
        h = hidden.clone().requires_grad_(True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if block is None:
                logprobs, entropy = chunked_token_logprobs(h, weight, targets, chunk_size=4, with_entropy=True)
            else:
                with base_matmuls(copies=copies, **block):
                    logprobs, entropy = chunked_token_logprobs(h, weight, targets, chunk_size=4, with_entropy=True)
            logprobs.sum().backward()
        return (logprobs.detach(), entropy, h.grad), [event.key for event in prof.key_averages()]

    plain, plain_ops = run(None)
    assert copies == {} and "mkldnn::_linear_pointwise" not in plain_ops
    packed, packed_ops = run({"dtype": block_dtype, "packed": True})
    assert [(entry[2].dtype, entry[2].packed) for entry in copies.values()] == [(torch.float32, True)]
    assert "mkldnn::_linear_pointwise" in packed_ops
    for got, want in zip(packed, plain, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
