"""Random PEFT LoRA adapters for tests: saved folders whose adapter visibly moves the model's outputs."""

from __future__ import annotations

from pathlib import Path

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(base_dir: Path, folder: Path, *, targets: list[str], seed: int = 1, **lora: object) -> Path:
    """Save a LoRA on ``targets`` of the model in ``base_dir`` to ``folder``, with B drawn from N(0, 0.2).

    PEFT initialises B to zero (an adapter that changes nothing); a random B makes the adapter change the
    outputs, so that a test can tell whether it was applied. ``lora``: more ``LoraConfig`` fields (``r``,
    ``lora_alpha``, ``use_rslora``...). The global RNG is left as it was.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", target_modules=targets, **lora))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)
    return folder
