"""``fused_lora``: PEFT's LoRA layers as two GEMMs and an accumulate give PEFT's values and gradients."""

from __future__ import annotations

import torch

from art_core.config import LoraSettings
from art_core.training.fused_lora import LoraLinear, fused_lora
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
