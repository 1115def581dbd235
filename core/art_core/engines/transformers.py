"""The transformers engine: in-process sampling that batches concurrent requests.

Requests that arrive while a batch runs wait for the next one, and each batch is one decode loop over
all its rows: one prefill, then one forward step per token for every row together. Each row keeps its
own temperature, top-p, seed, stop strings and token limit, so requests with different settings share a
batch (``model.generate`` takes one setting for the whole batch, which would split them).

What it reports is what the trainer needs: completion ids up to and including the stop token, and the
log-probability of each sampled token under the model's raw distribution (before temperature and top-p),
which is what the trainer's forward pass computes.

Rows whose ``params.json_schema`` is set are constrained to it (``engines/_structured.py``, llguidance):
each step their logits are masked to the tokens that keep the JSON valid; rows without a schema are left
alone, so constrained and free rows share a batch. The reported logprob stays the raw one (before the
mask, as before temperature and top-p): it is what the trainer's forward pass recomputes.

When the engine shares its PEFT model with a ``GRPOTrainer`` (``LocalBackend``), a training step
updates the served weights in place: ``mark_adapter_step`` then records the new step, with no reload.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import EngineError
from ._structured import JsonSchemaGuide, advance, allowed_tokens
from .base import EngineOutput, SamplingParams, check_adapter_path

__all__ = ["TransformersEngine"]


@dataclass
class _Row:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    matcher: Any = None
    """llguidance matcher when the row follows a JSON schema or grammar (``params.json_schema``/``grammar``)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish: Literal["stop", "length"] | None = None


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[list[EngineOutput]]
    queued_at: float


class TransformersEngine:
    """Batched sampling from a (PEFT-wrapped) causal LM, in this process.

    Args:
        model: the causal LM; a ``PeftModel`` when adapters are served.
        tokenizer: its tokenizer, with the chat template.
        max_batch_rows: most sequences decoded together (a request with n=8 takes 8 rows).
        adapter_step: the checkpoint step the model's weights correspond to.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_rows: int = 64, adapter_step: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._adapter_step = adapter_step
        eos = getattr(model.generation_config, "eos_token_id", None) if getattr(model, "generation_config", None) else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.stop_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self._queue: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._serving: asyncio.Event | None = None  # cleared while paused
        self._idle: asyncio.Event | None = None  # set when no batch is running
        self._closed = False
        self._guide: JsonSchemaGuide | None = None  # built on the first request with a JSON schema
        self.stats = {"batches": 0, "rows": 0, "tokens": 0}
        """Counters since start: decode loops run, sequences decoded, tokens sampled."""

    @classmethod
    async def from_pretrained(cls, model_dir: str | Path, *, adapter_dir: Path | None = None, adapter_step: int = 0,
                              device: str | None = None, **kwargs: Any) -> TransformersEngine:
        """Load a model folder (and optionally a PEFT adapter) and serve it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        def load() -> TransformersEngine:
            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
            if adapter_dir is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, check_adapter_path(Path(adapter_dir)),
                                                  adapter_name=f"step-{adapter_step}")
            return cls(model, tokenizer, adapter_step=adapter_step if adapter_dir is not None else 0, **kwargs)

        return await asyncio.to_thread(load)

    # -- the Engine protocol --------------------------------------------------------------------------

    @property
    def adapter_step(self) -> int:
        return self._adapter_step

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        """Sample ``params.n`` completions; waits while the engine is paused."""
        self._ensure_worker()
        if not prompt_token_ids:
            raise EngineError("the prompt is empty: render the chat template before calling the engine")
        if params.json_schema is not None or params.grammar is not None:
            # Compile now: a schema or grammar llguidance refuses fails this request only (ConstraintError).
            await asyncio.to_thread(self._json_guide().check, params.json_schema, grammar=params.grammar)
        future: asyncio.Future[list[EngineOutput]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(list(prompt_token_ids), params, future, time.perf_counter()))
        assert self._wakeup is not None
        self._wakeup.set()
        return await future

    async def load_adapter(self, path: Path, step: int) -> None:
        """Load a PEFT adapter from ``path`` and serve it from the next batch on, without reloading the base."""
        check_adapter_path(Path(path))
        await self._wait_idle()

        def swap() -> None:
            from peft import PeftModel

            name = f"step-{step}"
            if isinstance(self.model, PeftModel):
                previous = self.model.active_adapter
                self.model.load_adapter(str(path), adapter_name=name)
                self.model.set_adapter(name)
                if previous != name and previous in self.model.peft_config:
                    self.model.delete_adapter(previous)
            else:
                self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
            self.model.eval()

        try:
            await asyncio.to_thread(swap)
        except Exception as exc:
            raise EngineError(f"could not load the adapter in {path} as step {step}: {exc}") from exc
        self._adapter_step = step

    def mark_adapter_step(self, step: int) -> None:
        """Record that the shared weights now are checkpoint ``step`` (in-process training updated them)."""
        self._adapter_step = step

    async def pause(self) -> None:
        """Let the running batch finish; new requests wait until ``resume()``."""
        self._ensure_worker()
        assert self._serving is not None
        self._serving.clear()
        await self._wait_idle()

    async def resume(self) -> None:
        self._ensure_worker()
        assert self._serving is not None and self._wakeup is not None
        self._serving.set()
        self._wakeup.set()

    async def health(self) -> dict[str, Any]:
        return {"engine": "transformers", "adapter_step": self._adapter_step, "queued": len(self._queue), **self.stats,
                "paused": bool(self._serving and not self._serving.is_set()), "closed": self._closed}

    async def aclose(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(EngineError("the engine was closed before this request ran"))
        self._queue.clear()

    # -- batching -------------------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._closed:
            raise EngineError("this engine is closed")
        if self._worker is None:
            self._wakeup, self._serving, self._idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
            self._serving.set()
            self._idle.set()
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="transformers-engine")

    async def _wait_idle(self) -> None:
        if self._idle is not None:
            await self._idle.wait()

    async def _run(self) -> None:
        assert self._wakeup is not None and self._serving is not None and self._idle is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._serving.wait()
            while self._queue and self._serving.is_set():
                batch, rows = [], 0
                while self._queue and (not batch or rows + self._queue[0].params.n <= self.max_batch_rows):
                    pending = self._queue.pop(0)
                    batch.append(pending)
                    rows += pending.params.n
                self._idle.clear()
                started = time.perf_counter()
                try:
                    results = await asyncio.to_thread(
                        self.generate_batch, [p.prompt for p in batch], [p.params for p in batch])
                except Exception as exc:  # one bad batch fails its requests, not the engine
                    error = exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc}")
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(error)
                    continue
                finally:
                    self._idle.set()
                finished = time.perf_counter()
                for p, outputs in zip(batch, results):
                    timed = [_with_timings(o, queue=started - p.queued_at, generate=finished - started)
                             for o in outputs]
                    if not p.future.done():  # the caller may have gone away
                        p.future.set_result(timed)

    # -- the decode loop ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[list[EngineOutput]]:
        """Sample completions for several prompts in one decode loop (blocking).

        Returns:
            For each prompt, its ``params.n`` outputs.
        """
        rows: list[_Row] = []
        for prompt, p in zip(prompts, params):
            for k in range(p.n):
                generator = None
                if p.seed is not None:
                    generator = torch.Generator().manual_seed(p.seed * 1_000_003 + k)
                constrained = p.json_schema is not None or p.grammar is not None
                matcher = self._json_guide().matcher(p.json_schema, grammar=p.grammar) if constrained else None
                rows.append(_Row(prompt, p, generator, matcher))
        step = self._adapter_step
        self._decode(rows)
        self.stats["batches"] += 1
        self.stats["rows"] += len(rows)
        self.stats["tokens"] += sum(len(r.tokens) for r in rows)
        out, i = [], 0
        for p in params:
            out.append([EngineOutput(r.tokens, r.logprobs, r.finish or "length",
                                     r.top if p.top_logprobs else None, step) for r in rows[i:i + p.n]])
            i += p.n
        return out

    def _decode(self, rows: list[_Row]) -> None:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            width = max(len(r.prompt) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):  # left padding: every prompt ends where decoding starts
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                attention[i, width - len(r.prompt):] = 1
            ids, attention = ids.to(device), attention.to(device)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [R, W]: pads must not shift positions
            out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                        logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1].float()  # [R, V]
            longest = max(r.params.max_tokens for r in rows)
            for _ in range(longest):
                next_ids = self._sample(rows, logits)  # [R]
                if all(r.finish for r in rows):
                    break
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
                positions = positions[:, -1:] + 1
                out = model(input_ids=next_ids[:, None].to(device), attention_mask=attention,
                            position_ids=positions, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1].float()
        finally:
            model.train(was_training)

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(logits, dim=-1).cpu()  # [R, V] raw: what the trainer computes
        chosen = torch.full((len(rows),), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            if row.finish:
                continue  # finished rows ride along (static batch) with a pad token
            candidates = logprobs[i]  # [V]
            if row.matcher is not None:  # sample among the tokens the schema allows; report the raw logprob
                allowed = allowed_tokens(row.matcher, candidates.numel())  # [V] bool
                candidates = candidates.masked_fill(~allowed, float("-inf"))
            token = _choose(candidates, row.params, row.generator)
            if row.matcher is not None:
                advance(row.matcher, token)
            chosen[i] = token
            row.tokens.append(token)
            row.logprobs.append(logprobs[i, token].item())
            if row.params.top_logprobs:
                values, indices = logprobs[i].topk(row.params.top_logprobs)
                row.top.append(dict(zip(indices.tolist(), values.tolist())))
            if token in self.stop_ids or self._hit_stop_string(row):
                row.finish = "stop"
            elif len(row.tokens) >= row.params.max_tokens:
                row.finish = "length"
        return chosen

    def _json_guide(self) -> JsonSchemaGuide:
        if self._guide is None:
            config = getattr(self.model, "config", None)
            # The mask must cover every id the tokenizer can produce and every logit the model emits.
            vocab_size = max(getattr(config, "vocab_size", 0) or 0, len(self.tokenizer))
            self._guide = JsonSchemaGuide(self.tokenizer, vocab_size=vocab_size, stop_ids=self.stop_ids)
        return self._guide

    def _hit_stop_string(self, row: _Row) -> bool:
        if not row.params.stop:
            return False
        # Decode only the tail: a stop string ends within the last few tokens.
        tail = self.tokenizer.decode(row.tokens[-16:], skip_special_tokens=True)
        return any(s in tail for s in row.params.stop)


def _choose(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature <= 0:
        return int(logprobs.argmax())
    scaled = torch.softmax(logprobs / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = scaled.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # smallest set whose mass reaches top_p
        scaled = torch.zeros_like(scaled).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(scaled, 1, generator=generator))


def _with_timings(output: EngineOutput, **timings: float) -> EngineOutput:
    from dataclasses import replace

    return replace(output, timings={**output.timings, **timings})
