"""What a checkpoint costs the transformers engine that serves it, old way against new, side by side in one run.

The engine of a Ray replica, or of ``LocalBackend`` serving during steps, takes every checkpoint of a run: one
copy of the adapter's weights into the adapter it serves, then decoding with them. Measured on SmolLM2-135M with
the default ``LoraSettings`` (r=8 on every linear layer: 420 matrices) and one torch thread, a replica's share in
the benchmarks' Ray layout. The checkpoints are two random adapters of that shape (``tests/random_adapters.py``),
served in turn:

(a) The copy (``engines/_adapter_swap.py``): straight into the tensors PEFT's ``get_peft_model_state_dict`` views
    (now) against PEFT's ``set_peft_model_state_dict`` on the same checkpoint (before). CPU ms per checkpoint,
    reading the folder included.
(b) Decoding with ``packed_weights=True`` (``engines/_packed.py``), LoRA's own ``lora_A`` and ``lora_B`` left
    plain (now) against packed too (before, ``PackedLinears(pack_adapter=True)``): CPU seconds to answer the demo's
    step load (4 questions x 8 answers of 12 tokens, at once) right after a checkpoint (the packed side re-packs
    the adapter's matrices then) and again with the same checkpoint.

Rounds alternate between the sides; medians. Every round asks new questions, so no prompt state is reused. The
last line is a JSON object: ``swap_ms_copy``, ``swap_ms_peft``, ``swap_speedup``, ``decode_s_plain``,
``decode_s_packed``, ``decode_speedup``, ``after_checkpoint_s_plain``, ``after_checkpoint_s_packed``,
``after_checkpoint_speedup``.

    python tests/benchmarks/adapter_swap.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from art_core.config import LoraSettings
from art_core.engines._adapter_swap import load_into_active_adapter
from art_core.engines._packed import PackedLinears
from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.models import resolve_base_model
from art_core.training.loading import load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the random adapters the suite uses
from random_adapters import ALL_LINEAR, write_random_adapter  # noqa: E402

QUESTIONS, ANSWERS, TOKENS = 4, 8, 12


def _cpu_ms(fn: Any) -> float:
    start = time.process_time()
    fn()
    return 1000 * (time.process_time() - start)


def _peft_load(policy: Any, path: Path) -> None:
    """The copy as it was: PEFT's own loader, after the same checks' reading of the folder."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(path / "adapter_model.safetensors")
    get_peft_model_state_dict(policy, adapter_name=policy.active_adapter)  # the shape check both sides make
    set_peft_model_state_dict(policy, state, adapter_name=policy.active_adapter)


async def _decode(engine: TransformersEngine, tokenizer: Any, first: int) -> float:
    """CPU seconds for the step load on questions ``first``.. (new prompts: no cached prompt state)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=1.0, n=ANSWERS, seed=first)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {first + q} + {q + 7}?"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
               for q in range(QUESTIONS)]
    start = time.process_time()
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.process_time() - start


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    base, lora = resolve_base_model(args.base_model), LoraSettings()
    folder = Path(tempfile.mkdtemp(prefix="art-swap-bench-"))
    # Two checkpoints of one adapter's shape (the default LoraSettings), with different weights; the first served.
    checkpoints = [write_random_adapter(base, folder / name, targets=ALL_LINEAR, seed=seed, r=lora.rank,
                                        lora_alpha=lora.alpha) for seed, name in ((0, "a"), (1, "b"))]
    policy, tokenizer = load_policy(base, lora, device="cpu", adapter_dir=checkpoints[0])
    policy.eval()
    swap: dict[str, list[float]] = {"copy": [], "peft": []}
    for r in range(args.rounds * 4):
        path = checkpoints[r % 2]
        if r % 4 < 2:
            swap["copy"].append(_cpu_ms(lambda p=path: load_into_active_adapter(policy, p)))
        else:
            swap["peft"].append(_cpu_ms(lambda p=path: _peft_load(policy, p)))
    # Two engines on the one model: their packed copies are their own (the base's packed once per engine).
    plain = TransformersEngine(policy, tokenizer, packed_weights=True)
    packed = TransformersEngine(policy, tokenizer, packed_weights=True)
    packed._packed = PackedLinears(pack_adapter=True)
    after: dict[str, list[float]] = {"plain": [], "packed": []}
    steady: dict[str, list[float]] = {"plain": [], "packed": []}
    question = 0
    try:
        for engine in (plain, packed):  # warm: the base's packed copies made once, outside the rounds
            await _decode(engine, tokenizer, question)
        for r in range(args.rounds):
            for side, engine in (("plain", plain), ("packed", packed))[:: 1 if r % 2 == 0 else -1]:
                await engine.load_adapter(checkpoints[r % 2], step=r + 1)
                question += QUESTIONS
                after[side].append(await _decode(engine, tokenizer, question))
                question += QUESTIONS
                steady[side].append(await _decode(engine, tokenizer, question))
    finally:
        await plain.aclose()
        await packed.aclose()
    med = {f"swap_ms_{k}": statistics.median(v) for k, v in swap.items()}
    med |= {f"decode_s_{k}": statistics.median(v) for k, v in steady.items()}
    med |= {f"after_checkpoint_s_{k}": statistics.median(v) for k, v in after.items()}
    print(f"a checkpoint copied in: {med['swap_ms_copy']:.1f} ms of CPU straight into the tensors, "
          f"{med['swap_ms_peft']:.1f} ms through set_peft_model_state_dict")
    print(f"decoding {QUESTIONS}x{ANSWERS} answers of {TOKENS} tokens: {med['decode_s_plain']:.2f} s with LoRA's "
          f"matrices plain, {med['decode_s_packed']:.2f} s packed; right after a checkpoint "
          f"{med['after_checkpoint_s_plain']:.2f} s and {med['after_checkpoint_s_packed']:.2f} s")
    return {**{k: round(v, 4) for k, v in med.items()},
            "swap_speedup": round(med["swap_ms_peft"] / med["swap_ms_copy"], 3),
            "decode_speedup": round(med["decode_s_packed"] / med["decode_s_plain"], 3),
            "after_checkpoint_speedup": round(med["after_checkpoint_s_packed"] / med["after_checkpoint_s_plain"], 3),
            "rounds": args.rounds, "samples": {"swap_ms": swap, "decode_s": steady, "after_checkpoint_s": after}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base-model", default="smollm2-135m-instruct")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
