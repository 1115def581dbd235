"""The transformers engine on a tiny random model: exact decoding, logprobs, batching, pause, adapters."""

from __future__ import annotations

import asyncio

import pytest
import torch
from peft import LoraConfig, get_peft_model

from art_core.engines.base import Engine, SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.errors import ArtError

PROMPTS = [[1, 9707, 11, 1122, 359, 346, 47], [1, 504, 2114, 281, 253, 2], [1, 3702, 30, 2, 198, 1]]


@pytest.fixture
async def engine(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    yield engine
    await engine.aclose()


def _worst_logprob_gap(engine, prompt: list[int], outs) -> float:
    """Largest |engine logprob - logprob from a fresh forward pass| over the sampled tokens of ``outs``."""
    worst = 0.0
    for out in outs:
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(input_ids=ids).logits[0, :-1].float(), -1)
        n = len(prompt)
        rescored = logp[torch.arange(n - 1, ids.shape[1] - 1), ids[0, n:]]
        worst = max(worst, (rescored - torch.tensor(out.logprobs)).abs().max().item())
    return worst


async def test_it_is_an_engine(engine):
    assert isinstance(engine, Engine)


async def test_greedy_batch_equals_model_generate_one_by_one(engine):
    outputs = engine.generate_batch(PROMPTS, [SamplingParams(max_tokens=12, temperature=0)] * len(PROMPTS))
    for prompt, (out,) in zip(PROMPTS, outputs):
        ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=sorted(engine.stop_ids), pad_token_id=engine.pad_id)
        expected = ref[0, len(prompt):].tolist()
        if engine.stop_ids & set(expected):  # generate pads after eos; we stop at it
            expected = expected[: next(i for i, t in enumerate(expected) if t in engine.stop_ids) + 1]
        assert out.token_ids == expected


async def test_logprobs_match_a_forward_pass(engine):
    (outs,) = engine.generate_batch([PROMPTS[0]], [SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=4)])
    worst = _worst_logprob_gap(engine, PROMPTS[0], outs)
    print(f"max |engine logprob - forward logprob| = {worst:.2e}")
    assert worst < 1e-4


async def test_seeds_stops_and_limits(engine):
    a = engine.generate_batch([PROMPTS[1]], [SamplingParams(max_tokens=8, seed=7, n=2)])[0]
    b = engine.generate_batch([PROMPTS[1]], [SamplingParams(max_tokens=8, seed=7, n=2)])[0]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids != a[1].token_ids  # the n choices differ
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in a if not engine.stop_ids & set(o.token_ids))
    text = engine.tokenizer.decode(a[0].token_ids[:3], skip_special_tokens=True)
    stop = text.strip()[-2:] or text
    (stopped,) = engine.generate_batch([PROMPTS[1]], [SamplingParams(max_tokens=8, seed=7, stop=(stop,))])[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    (top,) = engine.generate_batch([PROMPTS[1]], [SamplingParams(max_tokens=3, top_logprobs=4)])[0]
    assert top.top_logprobs is not None and all(len(d) == 4 for d in top.top_logprobs)


async def test_concurrent_requests_share_batches(engine):
    params = [SamplingParams(max_tokens=6, temperature=t, seed=i) for i, t in enumerate([0, 0.7, 1.0] * 4)]
    results = await asyncio.gather(*(engine.generate(PROMPTS[i % 3], p) for i, p in enumerate(params)))
    assert all(len(r) == 1 and r[0].token_ids for r in results)
    assert engine.stats["batches"] < len(params)  # batched, though settings differ per request
    assert all(r[0].timings["generate"] > 0 for r in results)


async def test_requests_wait_while_paused(engine):
    await engine.pause()
    steps = engine.stats["steps"]
    task = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=4)))
    while not (await engine.health())["queued"]:  # the engine has the request
        assert not task.done(), task
        await asyncio.sleep(0.01)
    assert not task.done() and engine.stats["steps"] == steps  # waiting, not failed, nothing decoded
    await engine.resume()
    (out,) = await asyncio.wait_for(task, 60)
    assert out.token_ids


def _save_adapter(model_dir, folder, *, seed: int, rank: int = 8) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapter = get_peft_model(base, LoraConfig(r=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    for name, p in adapter.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a large change, so greedy output must differ
    adapter.save_pretrained(folder)


def _logprobs_of(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)


async def test_load_adapter_swaps_without_reloading_the_base(engine, tiny_model_dir, tmp_path):
    """The first adapter is loaded onto the base; the next checkpoints of its shape are copied into its tensors
    (no new LoRA modules), one of another shape replaces it; each serves exactly what a fresh load would."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for seed, folder, rank in ((0, "a", 8), (1, "b", 8), (2, "c", 4)):
        _save_adapter(tiny_model_dir, tmp_path / folder, seed=seed, rank=rank)

    def fresh(folder: str) -> torch.Tensor:
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / folder)
        return _logprobs_of(reference.eval(), PROMPTS[0])

    before = (await engine.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0)))[0].token_ids
    base_weight = engine.model.model.layers[0].mlp.up_proj.weight
    await engine.load_adapter(tmp_path / "a", step=3)
    assert engine.adapter_step == 3
    after = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))
    assert after[0].adapter_step == 3 and after[0].token_ids != before
    assert engine.model.get_base_model().model.layers[0].mlp.up_proj.weight is base_weight  # base not reloaded
    torch.testing.assert_close(_logprobs_of(engine.model, PROMPTS[0]), fresh("a"), atol=1e-5, rtol=1e-5)

    lora_a = engine.model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["step-3"].weight
    await engine.load_adapter(tmp_path / "b", step=4)  # the next checkpoint: copied in place
    assert engine.adapter_step == 4 and list(engine.model.peft_config) == ["step-3"]
    assert engine.model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["step-3"].weight is lora_a
    torch.testing.assert_close(_logprobs_of(engine.model, PROMPTS[0]), fresh("b"), atol=1e-5, rtol=1e-5)
    assert (await engine.generate(PROMPTS[0], SamplingParams(max_tokens=1)))[0].adapter_step == 4

    await engine.load_adapter(tmp_path / "c", step=5)  # another rank: loaded beside, the old one dropped
    assert list(engine.model.peft_config) == ["step-5"]
    torch.testing.assert_close(_logprobs_of(engine.model, PROMPTS[0]), fresh("c"), atol=1e-5, rtol=1e-5)
    with pytest.raises(ArtError, match="adapter_config.json"):
        await engine.load_adapter(tmp_path / "missing", step=6)
    assert engine.adapter_step == 5  # still serving the last good one


def test_a_checkpoint_of_the_served_shape_is_copied_straight_into_its_tensors(tiny_model_dir, tmp_path, monkeypatch):
    """The next checkpoint goes into the served LoRA tensors themselves, not through PEFT's loader (which walks the
    whole model): each then holds the checkpoint's values, in the same memory, its version counter bumped (how
    the engine's packed weight copies learn of the change)."""
    import peft
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from art_core.engines._adapter_swap import load_into_active_adapter

    for seed, folder in ((0, "a"), (1, "b")):
        _save_adapter(tiny_model_dir, tmp_path / folder, seed=seed)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "a")
    served = {name: p for name, p in model.named_parameters() if "lora_" in name}
    memory = {name: p.data_ptr() for name, p in served.items()}
    versions = {name: p._version for name, p in served.items()}
    monkeypatch.setattr(peft, "set_peft_model_state_dict", lambda *a, **k: pytest.fail("PEFT's loader was used"))
    assert load_into_active_adapter(model, tmp_path / "b")
    checkpoint = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert len(checkpoint) == len(served) > 0
    for key, value in checkpoint.items():
        name = key.removesuffix(".weight") + ".default.weight"  # PEFT names a tensor by its adapter in the model
        assert torch.equal(served[name].detach(), value)
        assert served[name].data_ptr() == memory[name] and served[name]._version > versions[name]


async def test_the_decode_runs_with_the_engines_thread_count_and_follows_a_change(engine):
    """``num_threads`` is the torch thread count of the decode; changed while a loop runs (here by the decode
    thread itself, at a known step), it applies from the next step on; the caller's count is untouched."""
    seen: list[int] = []

    def record(module, args) -> None:
        seen.append(torch.get_num_threads())
        if len(seen) == 2:  # the prefill, then the first decode step
            engine.num_threads = 1

    caller = torch.get_num_threads()
    handle = engine.model.register_forward_pre_hook(record)
    try:
        engine.num_threads = 3
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    finally:
        handle.remove()
    assert len(seen) > 2 and seen[:2] == [3, 3] and set(seen[2:]) == {1}
    assert torch.get_num_threads() == caller
    with pytest.raises(ValueError, match="num_threads=0"):
        TransformersEngine(engine.model, engine.tokenizer, num_threads=0)


# -- continuous batching: rows join a running batch and leave it as soon as they finish -------------------

async def _wait_for_steps(engine, steps: int) -> None:
    """Wait until the engine has decoded ``steps`` more steps."""
    target = engine.stats["steps"] + steps
    while engine.stats["steps"] < target:
        await asyncio.sleep(0.001)


async def test_a_request_joins_a_running_batch_and_returns_before_it_ends(engine):
    engine.stop_ids = {-1}  # no early stop: every row runs to its max_tokens
    long_prompt, short_prompt, longer_prompt = PROMPTS[0], PROMPTS[1], PROMPTS[0] + PROMPTS[2] + PROMPTS[1]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = [engine.generate_batch([p], [greedy])[0][0].token_ids for p in (short_prompt, longer_prompt)]
    running = asyncio.create_task(engine.generate(long_prompt, SamplingParams(max_tokens=400, temperature=0)))
    await _wait_for_steps(engine, 5)
    joined = await asyncio.gather(engine.generate(short_prompt, greedy), engine.generate(longer_prompt, greedy))
    assert not running.done()  # the joiners finished while the long request was still decoding
    assert [j[0].token_ids for j in joined] == alone  # joining (and the padding it needs) changes nothing
    assert engine.stats["max_rows"] == 3 and engine.stats["batches"] == 2 + 2  # the two above, then one each
    (long,) = await running
    assert len(long.token_ids) == 400
    assert long.timings["generate"] > joined[0][0].timings["generate"]


async def test_rows_that_joined_report_the_forward_pass_logprobs(engine):
    engine.stop_ids = {-1}
    running = asyncio.create_task(engine.generate(PROMPTS[2], SamplingParams(max_tokens=60, seed=1)))
    await _wait_for_steps(engine, 3)
    (first, second), = [await engine.generate(PROMPTS[0], SamplingParams(max_tokens=12, seed=2, n=2))]
    await running
    worst = _worst_logprob_gap(engine, PROMPTS[0], [first, second])
    print(f"rows that joined mid-batch: max |engine logprob - forward logprob| = {worst:.2e}")
    assert worst < 1e-4
    assert first.token_ids != second.token_ids  # n=2 rows share a prefill, not their samples


async def test_a_short_answer_does_not_wait_for_a_long_one_in_its_batch(engine):
    engine.stop_ids = {-1}
    done_order: list[str] = []

    async def run(name: str, tokens: int) -> None:
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=tokens, temperature=0))
        done_order.append(name)

    await asyncio.gather(run("long", 300), run("short", 2))
    assert done_order == ["short", "long"]
    assert engine.stats["batches"] == 1  # both were admitted together


async def test_an_abandoned_request_stops_decoding(engine):
    engine.stop_ids = {-1}
    task = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=100_000, temperature=0)))
    await _wait_for_steps(engine, 3)
    task.cancel()
    await asyncio.wait_for(engine.pause(), 30)  # returns only once the decode loop has let the row go
    assert engine.stats["steps"] < 1000


async def test_stream_hands_out_each_token_at_the_step_that_sampled_it(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, top_logprobs=2)
    whole = await engine.generate(PROMPTS[0], params)
    seen: dict[int, list] = {0: [], 1: []}
    steps_at = []
    async for delta in engine.stream(PROMPTS[0], params):
        assert len(delta.token_ids) == len(delta.logprobs) == len(delta.top_logprobs) == 1  # one token a step
        seen[delta.choice].append(delta)
        steps_at.append(engine.stats["steps"])
    for out, deltas in zip(whole, seen.values(), strict=True):  # seeded: the same completions as generate()
        assert [d.token_ids[0] for d in deltas] == out.token_ids
        assert [d.logprobs[0] for d in deltas] == pytest.approx(out.logprobs)
        assert [d.top_logprobs[0] for d in deltas] == out.top_logprobs
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [out.finish_reason]
    assert len(set(steps_at)) > 1  # handed out over the decode, not all at its end


async def test_closing_a_stream_frees_its_rows_at_the_next_step(engine):
    stream = engine.stream(PROMPTS[1], SamplingParams(max_tokens=5000, temperature=0))
    async for _ in stream:
        break
    await stream.aclose()
    await engine.pause()  # returns once the decode loop is idle: the rows were dropped
    assert engine.running_rows == 0 and engine.stats["steps"] < 1000
    await engine.resume()


def test_the_sampler_draws_from_the_tempered_top_p_distribution():
    """Inverse-CDF sampling: frequencies follow softmax(logprobs / T), cut to top-p, and zero-mass tokens never come."""
    from art_core.engines.transformers import _choose

    logprobs = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]), -1)
    generator = torch.Generator().manual_seed(0)
    draws = 20_000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
                   SamplingParams(temperature=1.0, top_p=0.8)):
        probs = torch.softmax(logprobs / params.temperature, -1)
        if params.top_p < 1.0:  # the smallest set of most likely tokens whose mass reaches top_p, renormalised
            ordered, order = probs.sort(descending=True)
            keep = order[(ordered.cumsum(0) - ordered) < params.top_p]
            probs = torch.zeros_like(probs).index_fill(0, keep, 1.0) * probs
            probs /= probs.sum()
        counts = torch.bincount(torch.tensor([_choose(logprobs, params, generator) for _ in range(draws)]),
                                minlength=len(probs)).double()
        expected = probs.double() * draws
        assert counts[-1] == 0 and (counts[expected == 0] == 0).all()
        # Each count within 5 binomial standard deviations of its expectation.
        sd = (draws * probs.double() * (1 - probs.double())).sqrt()
        assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), (params, counts.tolist(), expected.tolist())
