"""The merge that vLLM's worker runs for ``adapters="merged"`` (``engines/_vllm_ext/art_vllm_merge.py``).

The module needs only torch and safetensors, so it runs here without vLLM: the merged weights it hands to
vLLM's ``reload_weights`` are loaded into a transformers model and compared with PEFT's forward pass of the
same adapter. The server round trip (reload, prefix-cache reset, the step served) is covered by
``tests/backends/test_vllm_loop.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from art_core.engines._vllm_ext.art_vllm_merge import AdapterError, merged, read_deltas
from random_adapters import ALL_LINEAR, write_random_adapter

TARGETS = ALL_LINEAR


def _adapter(model_dir: Path, folder: Path, **lora: object) -> Path:
    """A LoRA on every linear layer, with non-zero B so that it changes the outputs."""
    return write_random_adapter(model_dir, folder, targets=TARGETS, **lora)


def _base(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, torch.Tensor]]]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        weights = {key: handle.get_tensor(key) for key in handle.keys()}
    return {k: tuple(v.shape) for k, v in weights.items()}, iter(weights.items())


@pytest.mark.parametrize("lora", [{"r": 4, "lora_alpha": 8}, {"r": 8, "lora_alpha": 4, "use_rslora": True}],
                         ids=["plain", "rslora"])
def test_merged_weights_give_peft_logits(tiny_model_dir: Path, tmp_path: Path, lora: dict[str, object]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = _adapter(tiny_model_dir, tmp_path / "adapter", **lora)
    shapes, weights = _base(tiny_model_dir)
    deltas = read_deltas(adapter, shapes)
    assert len(deltas) == 2 * len(TARGETS)  # 2 layers

    served = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
    missing, unexpected = served.load_state_dict(dict(merged(weights, deltas)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32"),
                                          adapter).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, plain = (m(ids).logits.log_softmax(-1) for m in (reference, served, base))
    gap = (want - got).abs().max().item()
    print(f"\nmerged vs PEFT log-probs: max abs diff {gap:.1e} (adapter moves them by "
          f"{(want - plain).abs().max().item():.1e})")
    assert gap < 1e-5
    assert (want - plain).abs().max().item() > 1e-2  # the adapter does change the model


def test_unmergeable_adapters_are_refused_before_any_weight_changes(tiny_model_dir: Path, tmp_path: Path) -> None:
    shapes, _ = _base(tiny_model_dir)
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_deltas(tmp_path / "nothing", shapes)

    dora = _adapter(tiny_model_dir, tmp_path / "dora", r=4, lora_alpha=8, use_dora=True)
    with pytest.raises(AdapterError, match=r"uses use_dora.*adapters='lora'"):
        read_deltas(dora, shapes)

    # An adapter of another model: the same names, other shapes.
    plain = _adapter(tiny_model_dir, tmp_path / "plain", r=4, lora_alpha=8)
    other = {name: (shape[0] * 2, *shape[1:]) for name, shape in shapes.items()}
    with pytest.raises(AdapterError, match="do not fit the base weight"):
        read_deltas(plain, other)
    with pytest.raises(AdapterError, match="which the base checkpoint does not have"):
        read_deltas(plain, {"model.embed_tokens.weight": shapes["model.embed_tokens.weight"]})

    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_deltas(plain, shapes)


def test_a_partial_reload_takes_whole_packed_layers(tiny_model_dir: Path) -> None:
    from art_core.engines._vllm_ext.art_vllm_merge import BaseCheckpoint, layer_tensors

    base = BaseCheckpoint(tiny_model_dir)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    names = layer_tensors({"model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"},
                          base.shapes, packed)
    # v_proj comes with q_proj and k_proj (one qkv_proj in vLLM), biases included; up_proj with gate_proj.
    attention = {f"model.layers.1.self_attn.{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias")}
    assert set(names) == attention | {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert names == [name for name in base.shapes if name in names]  # in the checkpoint's order
    assert layer_tensors(set(), base.shapes, packed) == []
    # Read once, then the same tensors (views of the file, not copies) every time.
    first, again = base.tensors(names), base.tensors(names)
    assert all(a is b for (_, a), (_, b) in zip(first, again, strict=True))
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as handle:
        assert all(torch.equal(tensor, handle.get_tensor(name)) for name, tensor in first)
    with pytest.raises(AdapterError, match="no model.layers.0.mlp.gate_proj"):
        layer_tensors({"model.layers.0.mlp.up_proj.weight"},
                      {k: v for k, v in base.shapes.items() if "gate_proj" not in k}, packed)
