"""The transformers engine: in-process sampling with continuous batching.

One decode loop runs while there is work. Each step it admits the requests that have arrived since the
last one (their prompts are prefilled and their rows join the running batch), samples one token for
every row, hands each finished request back at once, and drops finished rows from the batch
(``engines/_batch.py`` keeps the KV cache, masks and positions). A short answer therefore never waits
for a long one, and a request that arrives mid-generation starts at the next step instead of waiting for
the whole batch. Each row keeps its own temperature, top-p, seed, stop strings and token limit, so
requests with different settings share a batch (``model.generate`` takes one setting for the whole batch).

Each distinct prompt of an admission is prefilled once (a GRPO group sends one prompt many times), and a
prompt seen again since the weights last changed is not prefilled at all (``engines/_prefix.py``); each
layer's keys and values live in pre-allocated buffers, so a step writes its column in place. On CPU in float32,
``packed_weights=True`` runs the linear layers through oneDNN with weights packed once (``engines/_packed.py``):
the matrix products are most of a step, and PyTorch's default path for them is ~1.8x slower at 8 rows; off by
default, since the different summation order moves log-probs past 1e-5. ``packed_weights="bfloat16"`` packs
them in bfloat16 (the output embedding stays float32): GEMMs about twice as fast on a CPU with native bf16, a step less:
the engine then samples from a slightly different policy than the float32 trainer, and the log-probs it
records are that policy's own, which the trainer's importance weights correct for.

The loop runs on a thread of the engine's own (``art-decode``, see ``art_core._threads``), never on the event
loop's default pool, which the user's code can fill with calls waiting for this very engine.

``stream`` hands each request its tokens at the step that sampled them (one call into the event loop per
request per step); a reader that stops abandons the request, and its rows leave the batch at the next step.

What it reports is what the trainer needs: completion ids up to and including the stop token, and the
log-probability of each sampled token under the model's raw distribution (before temperature and top-p),
which is what the trainer's forward pass computes.

Rows whose ``params.json_schema`` is set are constrained to it (``engines/_structured.py``, llguidance):
each step their logits are masked to the tokens that keep the JSON valid; rows without a schema are left
alone, so constrained and free rows share a batch. The reported logprob stays the raw one (before the
mask, as before temperature and top-p): it is what the trainer's forward pass recomputes.

When the engine shares its PEFT model with a ``GRPOTrainer`` (``LocalBackend``), a training step
updates the served weights in place: ``mark_adapter_step`` then records the new step, with no reload.
The module has one user at a time (``art_core/_ownership.py``): the step may start only while the engine
is paused, and a decode attempted while the step holds the module fails with an error saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from .._ownership import module_ownership, torch_threads
from .._threads import HELPERS, OwnThreads
from ..errors import ArtError, EngineError
from ._adapter_swap import load_into_active_adapter
from ._batch import RunningBatch
from ._packed import PackedWeights, packed_linears
from ._prefix import PrefixCache
from ._structured import JsonSchemaGuide, advance, allowed_tokens
from .base import EngineOutput, SamplingParams, TokenDelta, check_adapter_path

__all__ = ["TransformersEngine"]


@dataclass
class _Request:
    """One ``generate`` call: its prompt, its settings and, once admitted, its ``params.n`` rows."""

    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[list[EngineOutput]] | None
    """Settled from the decode thread; None for ``generate_batch`` (results are collected instead)."""
    queued_at: float
    deltas: asyncio.Queue[list[TokenDelta] | BaseException] | None = None
    """For ``stream``: each step's new tokens are put here (from the decode thread, via the event loop)."""
    rows: list[_Row] = field(default_factory=list)
    admitted_at: float = 0.0
    adapter_step: int = 0

    @property
    def abandoned(self) -> bool:
        """The caller went away (its future was cancelled): its rows can stop."""
        return self.future is not None and self.future.done()


@dataclass
class _Row:
    request: _Request
    index: int
    """Which of the request's ``n`` choices this row samples."""
    generator: torch.Generator | None
    matcher: Any = None
    """llguidance matcher when the row follows a JSON schema or grammar (``params.json_schema``/``grammar``)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish: Literal["stop", "length"] | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params


class TransformersEngine:
    """Batched sampling from a (PEFT-wrapped) causal LM, in this process.

    Args:
        model: the causal LM; a ``PeftModel`` when adapters are served.
        tokenizer: its tokenizer, with the chat template.
        max_batch_rows: most sequences decoded together (a request with n=8 takes 8 rows).
        adapter_step: the checkpoint step the model's weights correspond to.
        prefix_cache_mb: memory for the states of recently prefilled prompts (``engines/_prefix.py``): a prompt
            seen again since the weights last changed skips its prefill. 0 turns it off.
        packed_weights: on CPU in float32, decode through oneDNN with the linear weights reordered once into its
            layout (``engines/_packed.py``). True (or ``"float32"``): ~1.8x faster steps at 8 rows, for a second
            copy of those weights in memory (0.54 GB for SmolLM2-135M), and log-probs that differ from the
            default path's by rounding (up to ~4e-5 on SmolLM2-135M, so a seeded row can sample another token).
            ``"bfloat16"``: the copies in bfloat16 (half the memory) but the output embedding's, which stays
            float32 so that logits and log-probs keep float32 precision; faster again on a CPU with native bf16
            (AVX512-BF16 or AMX), slower without. The sampling policy then differs from the float32 model's
            (log-probs by ~1e-2); what is recorded is the sampling policy's own log-probs, which is what the
            trainer's truncated importance weights need. Default False: PyTorch's matrix products, no extra
            memory.
        num_threads: torch threads for the decode loop (set on the engine's own thread while it decodes); None:
            the process's setting. Where a training step runs in the same process at the same time (the
            asynchronous pipeline's separate-module layout), splitting the cores between the two keeps their
            OpenMP threads from contending for the same cores (``LocalBackend`` does so by default). The
            attribute may be changed at any time: a running decode loop takes the new count at its next step.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_rows: int = 64, adapter_step: int = 0,
                 prefix_cache_mb: int = 256, packed_weights: PackedWeights = False,
                 num_threads: int | None = None) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads={num_threads}: give at least 1, or None for the process's setting")
        self.model = model
        self.num_threads = num_threads
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._adapter_step = adapter_step
        eos = getattr(model.generation_config, "eos_token_id", None) if getattr(model, "generation_config", None) else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.stop_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self._queue: list[_Request] = []
        self._queue_lock = threading.Lock()  # the event loop appends, the decode thread takes
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        # The decode loop and adapter swaps run on a thread of the engine's own, never on the event loop's default
        # pool: user code fills that one (a graph's synchronous nodes waiting for this very engine: _threads.py).
        self._decode_thread = OwnThreads("art-decode")
        self._serving: asyncio.Event | None = None  # cleared while paused
        self._idle: asyncio.Event | None = None  # set when no decode loop is running
        self._closed = False
        self._guide: JsonSchemaGuide | None = None  # built on the first request with a JSON schema
        self._prefix = PrefixCache(prefix_cache_mb * 2**20)
        self._packed = packed_linears(packed_weights)
        self.stats = {"batches": 0, "rows": 0, "tokens": 0, "steps": 0, "max_rows": 0, "prefills": 0}
        """Counters since start: admissions (each prefills the requests that were waiting and adds their rows
        to the running batch), sequences decoded, tokens sampled, decode steps, most rows decoded at once,
        prompts run through the model (each distinct prompt of an admission once, none found in the prefix cache)."""
        self.running_rows = 0
        """Rows in the batch being decoded now (a row leaves the step after it finishes or its caller goes away)."""
        # A trainer sharing this module may take it only while this engine is paused (art_core/_ownership.py).
        module_ownership(model).engine_serving(self, True)

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

        return await HELPERS.run(load)

    # -- the Engine protocol --------------------------------------------------------------------------

    @property
    def adapter_step(self) -> int:
        return self._adapter_step

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        """Sample ``params.n`` completions; waits while the engine is paused."""
        request = await self._enqueue(prompt_token_ids, params, None)
        assert request.future is not None
        return await request.future

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Sample ``params.n`` completions, each token handed out at the step that sampled it.

        Closing the iterator (or cancelling its reader) abandons the request: its rows leave the batch
        at the next step, and the tokens already handed out are all it sampled.
        """
        queue: asyncio.Queue[list[TokenDelta] | BaseException] = asyncio.Queue()
        request = await self._enqueue(prompt_token_ids, params, queue)
        assert request.future is not None
        try:
            finished = 0
            while finished < params.n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    finished += delta.finish_reason is not None
                    yield delta
        finally:
            request.future.cancel()  # abandoned (a no-op once settled): the decode loop drops its rows

    async def _enqueue(self, prompt_token_ids: list[int], params: SamplingParams,
                       deltas: asyncio.Queue[list[TokenDelta] | BaseException] | None) -> _Request:
        self._ensure_worker()
        if not prompt_token_ids:
            raise EngineError("the prompt is empty: render the chat template before calling the engine")
        if params.json_schema is not None or params.grammar is not None:
            # Compile now: a schema or grammar llguidance refuses fails this request only (ConstraintError).
            await HELPERS.run(self._json_guide().check, params.json_schema, grammar=params.grammar)
        future: asyncio.Future[list[EngineOutput]] = asyncio.get_running_loop().create_future()
        request = _Request(list(prompt_token_ids), params, future, time.perf_counter(), deltas)
        with self._queue_lock:
            self._queue.append(request)
        assert self._wakeup is not None
        self._wakeup.set()
        return request

    async def load_adapter(self, path: Path, step: int) -> None:
        """Load a PEFT adapter from ``path`` and serve it from the next request on, without reloading the base.

        Requests being decoded finish on the old adapter first; new ones wait for the swap. An adapter of the
        served one's shape (the next checkpoint) is copied into its tensors (``load_into_active_adapter``);
        any other is loaded beside it, then the old one is deleted.
        """
        check_adapter_path(Path(path))
        was_serving = self._serving is None or self._serving.is_set()
        await self.pause()  # stop admitting, or a steady stream of requests would keep the loop busy forever

        def swap() -> None:
            from peft import PeftModel

            name = f"step-{step}"
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=name)
            elif not load_into_active_adapter(self.model, Path(path)):  # not the served adapter's shape
                previous = self.model.active_adapter
                self.model.load_adapter(str(path), adapter_name=name)
                self.model.set_adapter(name)
                if previous != name and previous in self.model.peft_config:
                    self.model.delete_adapter(previous)
            self.model.eval()

        try:
            await self._decode_thread.run(swap)
            # Only the prompt states: the swap copies into the adapter's tensors (bumping their version counters)
            # or adds new modules, so the packed copies of the base weights, untouched, stay valid.
            self._prefix.clear()
        except Exception as exc:
            raise EngineError(f"could not load the adapter in {path} as step {step}: {exc}") from exc
        else:
            self._adapter_step = step
        finally:
            if was_serving:
                await self.resume()

    def mark_adapter_step(self, step: int) -> None:
        """Record that the shared weights now are checkpoint ``step`` (in-process training updated them)."""
        self._prefix.clear()  # packed weights follow the weights' version counters (engines/_packed.py)
        self._adapter_step = step

    def weights_changed(self) -> None:
        """Forget what was computed from the weights: cached prompt states and packed weight copies.

        Call it after editing the served weights in place behind autograd's back (``weight.data += ...``,
        as PEFT's ``merge_adapter`` does) while the engine is paused; changes made the usual ways (optimizer
        steps, ``load_state_dict``, ``load_adapter``) are seen without it.
        """
        self._prefix.clear()
        if self._packed is not None:
            self._packed.clear()

    async def pause(self) -> None:
        """Let the requests being decoded finish; new ones wait until ``resume()``."""
        self._ensure_worker()
        assert self._serving is not None
        self._serving.clear()
        await self._wait_idle()
        self._prefix.clear()  # the weights may change while paused (a training step, an adapter swap)
        module_ownership(self.model).engine_serving(self, False)  # a trainer sharing the module may take it now

    async def resume(self) -> None:
        self._ensure_worker()
        assert self._serving is not None and self._wakeup is not None
        module_ownership(self.model).engine_serving(self, True)
        self._serving.set()
        self._wakeup.set()

    async def health(self) -> dict[str, Any]:
        return {"engine": "transformers", "adapter_step": self._adapter_step, "queued": len(self._queue), **self.stats,
                "running_rows": self.running_rows,
                # linear layers decoding through packed copies (packed_weights; 0: off, or nothing decoded yet)
                "packed_layers": len(self._packed) if self._packed is not None else 0,
                "num_threads": self.num_threads,  # the decode's torch threads (None: the process's)
                "paused": bool(self._serving and not self._serving.is_set()), "closed": self._closed}

    async def aclose(self) -> None:
        self._closed = True
        module_ownership(self.model).engine_serving(self, False)
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        self._decode_thread.close()  # a decode loop still running sees _closed at its next step and ends
        with self._queue_lock:
            queued, self._queue = self._queue, []
        for request in queued:
            if request.future is not None and not request.future.done():
                request.future.set_exception(EngineError("the engine was closed before this request ran"))

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
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._serving.wait()
            if not self._queue:
                continue
            self._idle.clear()
            try:
                # Runs while there is work; requests that arrive meanwhile join it (see _take_queued).
                await self._decode_thread.run(self._decode, [], self._take_queued, partial(_settle_soon, loop),
                                              partial(_publish_soon, loop))
            finally:
                self._idle.set()

    def _take_queued(self, free_rows: int, batch_empty: bool) -> list[_Request]:
        """Queued requests that fit in ``free_rows`` (called by the decode thread between steps)."""
        assert self._serving is not None
        taken: list[_Request] = []
        if self._closed or not self._serving.is_set():
            return taken
        with self._queue_lock:
            while self._queue and (self._queue[0].params.n <= free_rows or (batch_empty and not taken)):
                request = self._queue.pop(0)
                if request.abandoned:
                    continue
                taken.append(request)
                free_rows -= request.params.n
        return taken

    # -- the decode loop ------------------------------------------------------------------------------

    def generate_batch(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[list[EngineOutput]]:
        """Sample completions for several prompts in one decode loop (blocking; bypasses the queue).

        Returns:
            For each prompt, its ``params.n`` outputs.
        """
        now = time.perf_counter()
        requests = [_Request(list(prompt), p, None, now) for prompt, p in zip(prompts, params)]
        results: dict[int, list[EngineOutput] | BaseException] = {}
        self._decode(requests, lambda free, empty: [], lambda request, outcome: results.update({id(request): outcome}),
                     lambda request, deltas: None)
        for outcome in results.values():
            if isinstance(outcome, BaseException):
                raise outcome
        return [results[id(r)] for r in requests]  # type: ignore[misc]

    def _decode(self, first: list[_Request], take: Callable[[int, bool], list[_Request]],
                settle: Callable[[_Request, list[EngineOutput] | BaseException], None],
                publish: Callable[[_Request, list[TokenDelta]], None]) -> None:
        """``_decode_loop`` while holding the module (``art_core/_ownership.py``).

        While a training step holds the module this engine decodes (a trainer sharing it), the module is not
        touched: every request of the loop, and every queued one, is settled with the ownership's ``EngineError``.
        """
        with contextlib.ExitStack() as holding:
            holding.enter_context(torch_threads(self.num_threads))
            try:
                holding.enter_context(module_ownership(self.model).decoding())
            except EngineError as refused:
                for request in [*first, *_drain(take, self.max_batch_rows)]:
                    settle(request, refused)
                return
            self._decode_loop(first, take, settle, publish)

    @torch.no_grad()
    def _decode_loop(self, first: list[_Request], take: Callable[[int, bool], list[_Request]],
                     settle: Callable[[_Request, list[EngineOutput] | BaseException], None],
                     publish: Callable[[_Request, list[TokenDelta]], None]) -> None:
        """Decode until no row is left and ``take`` gives nothing more; ``settle`` gets each request's result.

        ``publish`` gets each step's new tokens of every streamed request (one call per request per step).

        ``take(free_rows, batch_empty)`` is asked for more requests before every step. A failure fails
        every request in the loop (one bad batch must not take the engine down) and ends the loop.
        """
        model = self.model
        was_training = model.training
        model.eval()
        threads = torch.get_num_threads()  # what _decode set for this loop; followed if the attribute changes
        batch = RunningBatch(model, self.pad_id, self._prefix)
        rows: list[_Row] = []
        waiting = list(first)
        # The linear layers run through oneDNN-packed weights only inside this block (engines/_packed.py).
        packed = self._packed.active(model) if self._packed is not None else contextlib.nullcontext()
        with packed:
            try:
                while True:
                    if not rows or batch.can_join:
                        waiting = waiting or take(self.max_batch_rows - len(rows), not rows)
                        if waiting:
                            rows += self._admit(batch, waiting)
                            waiting = []
                    self.running_rows = len(rows)
                    if not rows:
                        return
                    if self._closed:
                        raise EngineError("the engine was closed while this request ran")
                    if self.num_threads is not None and self.num_threads != threads:
                        threads = self.num_threads
                        torch.set_num_threads(threads)  # this thread only; _decode's torch_threads restores it
                    assert batch.logits is not None
                    next_ids = self._sample(rows, batch.logits)
                    self.stats["steps"] += 1
                    self._publish(rows, publish)
                    for request in {id(r.request): r.request for r in rows if r.finish}.values():
                        if all(r.finish for r in request.rows):
                            settle(request, self._outputs(request))
                    keep = [i for i, r in enumerate(rows) if not r.finish and not r.request.abandoned]
                    if len(keep) < len(rows):
                        batch.keep(keep)
                        rows, next_ids = [rows[i] for i in keep], next_ids[keep]
                    self.running_rows = len(rows)
                    if rows:
                        batch.step(next_ids)
            except BaseException as exc:
                error = exc if isinstance(exc, ArtError) else EngineError(f"generation failed: {exc!r}")
                if error is not exc:
                    error.__cause__ = exc
                unsettled = {id(r.request): r.request for r in rows} | {id(r): r for r in waiting}
                for request in unsettled.values():
                    settle(request, error)
                if not isinstance(exc, Exception):
                    raise
            finally:
                self.running_rows = 0
                model.train(was_training)

    @staticmethod
    def _publish(rows: list[_Row], publish: Callable[[_Request, list[TokenDelta]], None]) -> None:
        """Hand each streamed request the tokens its rows sampled this step."""
        new: dict[int, list[TokenDelta]] = {}
        for row in rows:
            request = row.request
            if request.deltas is None:
                continue
            top = row.top[-1:] if request.params.top_logprobs else None
            new.setdefault(id(request), []).append(TokenDelta(
                row.index, row.tokens[-1:], row.logprobs[-1:], top, row.finish, request.adapter_step))
        for row in rows:
            deltas = new.pop(id(row.request), None)
            if deltas is not None:
                publish(row.request, deltas)

    def _admit(self, batch: RunningBatch, requests: list[_Request]) -> list[_Row]:
        """Prefill ``requests`` into the batch (each prompt once, then copied to its n rows); their new rows."""
        now, step = time.perf_counter(), self._adapter_step
        rows: list[_Row] = []
        for request in requests:
            request.admitted_at, request.adapter_step = now, step
            p = request.params
            constrained = p.json_schema is not None or p.grammar is not None
            for k in range(p.n):
                # Any integer seed: torch takes 64 bits, so a large one is folded (small ones are unchanged).
                generator = (torch.Generator().manual_seed((p.seed * 1_000_003 + k) % 2**64)
                             if p.seed is not None else None)
                matcher = self._json_guide().matcher(p.json_schema, grammar=p.grammar) if constrained else None
                request.rows.append(_Row(request, k, generator, matcher))
            rows += request.rows
        prefilled = batch.prefilled
        batch.add([r.prompt for r in requests], [r.params.n for r in requests])
        self.stats["prefills"] += batch.prefilled - prefilled
        self.stats["batches"] += 1
        self.stats["rows"] += len(rows)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(batch))
        return rows

    def _outputs(self, request: _Request) -> list[EngineOutput]:
        timings = {"queue": request.admitted_at - request.queued_at,
                   "generate": time.perf_counter() - request.admitted_at}
        self.stats["tokens"] += sum(len(r.tokens) for r in request.rows)
        return [EngineOutput(r.tokens, r.logprobs, r.finish or "length", r.top if request.params.top_logprobs else None,
                             request.adapter_step, timings) for r in request.rows]

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(logits, dim=-1).cpu()  # [R, V] raw: what the trainer computes
        chosen = torch.full((len(rows),), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
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


def _drain(take: Callable[[int, bool], list[_Request]], rows: int) -> list[_Request]:
    """Every request ``take`` still has (it gives at least one per call while any is queued)."""
    taken: list[_Request] = []
    while more := take(rows, True):
        taken += more
    return taken


def _choose(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature <= 0:
        return int(logprobs.argmax())
    scaled = torch.softmax(logprobs / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = scaled.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # smallest set whose mass reaches top_p
        scaled = torch.zeros_like(scaled).scatter(0, order[keep], sorted_p[keep])
    # Inverse-CDF sampling: one uniform draw against the cumulative mass. Exact, and ~30x faster on CPU than
    # torch.multinomial over a 50k vocabulary (which draws a whole vector of randoms per call). Zero-mass
    # tokens have empty intervals, so they are never picked; float64 keeps the tail intervals exact.
    cdf = scaled.double().cumsum(0)
    u = torch.rand((1,), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)


def _settle_soon(loop: asyncio.AbstractEventLoop, request: _Request,
                 outcome: list[EngineOutput] | BaseException) -> None:
    """Hand a result from the decode thread to the waiting coroutine, on its event loop."""

    def settle() -> None:
        future = request.future
        if future is None or future.done():  # the caller may have gone away
            return
        if request.deltas is not None:  # streamed: the tokens went out already; only a failure is news
            if isinstance(outcome, BaseException):
                request.deltas.put_nowait(outcome)
            future.set_result([])
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
        loop.call_soon_threadsafe(settle)


def _publish_soon(loop: asyncio.AbstractEventLoop, request: _Request, deltas: list[TokenDelta]) -> None:
    """Hand a step's tokens from the decode thread to the streaming reader, in order, on its event loop."""
    queue = request.deltas
    if queue is None or (request.future is not None and request.future.done()):
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is reading any more
        loop.call_soon_threadsafe(queue.put_nowait, deltas)
