"""Supervised fine-tuning, ours vs TRL's ``SFTTrainer``: one epoch over the same chats with tool calls.

The work: ``--chats`` (default 200) chats an agent with three tools would produce, generated here from a
seed (``make_chats``): a system prompt and the tool schemas, a user request, then one of four shapes: one
tool call, its result and an answer; two calls in turn; two calls in parallel; or a direct answer. Both
sides train the same base model (the embedded SmolLM2-135M-Instruct, its chat template with tool calls:
``art_core/models/templates.py``) in fp32 on CPU, with the same LoRA adapter (r=8, alpha=16, dropout 0, on
q,k,v,o,gate,up,down, initialised to the same values: ``_same_work.reset_adapter``), on the same loss: the token-level
mean negative log-likelihood of every assistant token (text, tool calls and the closing ``<|im_end|>``),
nothing of the system, user or tool turns. 8 chats per optimizer step, AdamW at lr 1e-4, a linear schedule
from the first step down to zero at the end of the epoch (no warm-up), gradient clipping at norm 1.0, no
weight decay, one epoch, the chats in the generated order (already shuffled by the seed) on both sides.

How TRL gets the assistant-only loss: ``SFTConfig(assistant_only_loss=True)`` on a conversational dataset
(``messages`` + ``tools`` columns). That path needs a chat template with ``{% generation %}`` markers, which
SmolLM2's has not, so TRL is given a copy of ours with the markers around each assistant turn's content and
its ``<|im_end|>`` (``training_template``): the same text, with the spans TRL's mask is read from. We use this
path and not TRL's prompt-completion one (``completion_only_loss``) because a chat with tool calls has several
assistant turns with tool results between them, and prompt-completion trains only the last completion; the
assistant-only path trains every assistant turn, as ours does with ``assistant_turns="all"``. The script
checks, before timing, that TRL's prepared dataset holds exactly our token ids and our trained-token mask for
every chat (the ``tokens`` fingerprint must match), and prints both sides' first-step loss.

Settings that are not TRL's defaults, for the sake of the same work: ``gradient_checkpointing=False``
(SFTConfig defaults to True, which would recompute the forward and lower TRL's memory; ours does not
checkpoint), ``bf16=False`` (fp32, as ours on CPU), ``train_sampling_strategy="sequential"`` (the order is
already seeded; both sides must see the same first batch for the loss check), no packing and no
padding-free batches (TRL's padding-free needs flash attention, which CPUs lack; ours pads too). Both sides
run every batch of 8 chats as one padded forward (ours: ``micro_batch_tokens`` above a batch's tokens; TRL:
``per_device_train_batch_size=8``, no gradient accumulation). What ours does differently, and this
benchmark measures: the system prompt and tool schemas every chat of a batch starts with are run once
(``share_prefix``), its forward keeps only what the backward needs, and its LoRA layers are fused.

What is timed: the whole epoch. Ours: ``GRPOTrainer.train_step(groups, SFTConfig(...))``, what
``model.train_sft`` runs on a ``LocalBackend`` once the data is written to disk (rendering the chats with the
chat template, planning micro-batches, every forward/backward and optimizer step; not the checkpoint written
after). TRL: its dataset preparation inside ``SFTTrainer(...)`` (chat template, tokenisation, labels) plus
``trainer.train()``. Model loading is setup on both sides, not timed. Each optimizer step is timed on its own
too, with how much CPU the *other* processes used meanwhile (from /proc/stat): TRL's between its
``on_step_end`` callbacks, ours' between the progress calls after each micro-batch (one per step; the
preparation is taken off the first step and the last optimizer update added to the last).

Timing on a shared 2-core machine: while any other process runs, 2-thread torch slows down by 2-10x, so a
step is only as good as the machine was quiet during it. Each side runs ``--rounds`` times, each run in its
own subprocess (so peak memory is per side), interleaved (ours, TRL, then TRL, ours...). For each step index,
the time used is the median of its quiet runs (others < 0.1 core) if it had any, else its fastest run (other
processes only ever add time); an epoch's time is the sum over its steps plus its fastest preparation. The
JSON says how many steps were timed quiet (``quiet_steps``); the median whole-epoch wall times are printed too.

Memory: peak RSS of the whole process (``ru_maxrss``: loading, data, the whole epoch), per side.

Run (heavy: a few minutes per side and round on 2 cores):
    cd /work/main && PYTHONPATH=core python tests/benchmarks/sft_vs_trl.py [--chats 200 --rounds 2]

The last line printed is one JSON object with ``sft_speedup_vs_trl`` (TRL's epoch / ours) and
``sft_peak_rss_ratio_vs_trl`` (ours / TRL's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _same_work import (  # noqa: E402 (beside this script)
    busy_cpu_seconds,
    reset_adapter,
    resolve_model,
    run_side_process,
)

SEED = 0
CHATS = 200
BATCH = 8  # chats per optimizer step, on both sides
SPEED_GOAL = 2.0  # ours at least this many times faster than TRL (issue 26)
MEMORY_GOAL = 0.5  # and peak RSS at most this fraction of TRL's (issue 26)
SIDES = ("ours", "trl")
ABLATION = "ours_no_prefix_share"  # run alone with --side (see main): where our speed comes from
QUIET_OTHERS_CORES = 0.1  # a step is "quiet" when other processes used less CPU than this during it

LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATE, MAX_GRAD_NORM = 1e-4, 1.0
MICRO_BATCH_TOKENS = 16384  # above any batch of 8 of these chats: one forward per step, as TRL's
FIRST_LOSS_TOLERANCE = 1e-4  # relative; the two sides sum the same terms in a different order


# --------------------------------------------------------------------------------------------------
# The shared data
# --------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = ("You are a travel assistant. Use the tools to look things up instead of guessing, "
                 "and answer in one or two sentences once you have what you need.")

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between two currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "description": "ISO code, e.g. EUR"},
            "to_currency": {"type": "string", "description": "ISO code, e.g. USD"}},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Cheapest direct flight between two cities on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"}},
            "required": ["origin", "destination", "date"]}}},
]

_CITIES = ["Paris", "Lisbon", "Oslo", "Tokyo", "Lima", "Nairobi", "Toronto", "Hanoi", "Madrid", "Seoul",
           "Cairo", "Denver", "Prague", "Dublin", "Quito", "Perth"]
_CURRENCIES = {"EUR": 1.0, "USD": 1.08, "GBP": 0.86, "JPY": 162.0, "CAD": 1.47, "KRW": 1450.0}
_SKIES = ["sunny", "cloudy", "light rain", "windy", "snow showers", "clear"]


class _Chat:
    """Builds one OpenAI-format chat; tool-call arguments are JSON text, as OpenAI's API sends them."""

    def __init__(self, user: str) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                               {"role": "user", "content": user}]
        self._calls = 0

    def call(self, *calls: tuple[str, dict[str, Any], str]) -> None:
        """One assistant turn making ``calls`` (name, arguments, the tool's result), then their results."""
        ids = [f"call_{self._calls + i}" for i in range(len(calls))]
        self._calls += len(calls)
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a, _) in zip(ids, calls)]})
        self.messages += [{"role": "tool", "tool_call_id": i, "content": r} for i, (_, _, r) in zip(ids, calls)]

    def answer(self, text: str) -> dict[str, Any]:
        self.messages.append({"role": "assistant", "content": text})
        return {"messages": self.messages, "tools": TOOLS}


def _weather(rng: random.Random, city: str) -> tuple[str, dict[str, Any], str, str]:
    unit = rng.choice(["celsius", "fahrenheit"])
    temp = rng.randint(-5, 33) if unit == "celsius" else rng.randint(23, 91)
    sky = rng.choice(_SKIES)
    result = json.dumps({"city": city, "temperature": temp, "unit": unit, "sky": sky})
    return "get_weather", {"city": city, "unit": unit}, result, f"{temp} degrees {unit} and {sky} in {city}"


def _conversion(rng: random.Random) -> tuple[str, dict[str, Any], str, str]:
    src, dst = rng.sample(sorted(_CURRENCIES), 2)
    amount = rng.choice([20, 50, 120, 300, 750, 1000, 2500])
    value = round(amount * _CURRENCIES[dst] / _CURRENCIES[src], 2)
    return ("convert_currency", {"amount": amount, "from_currency": src, "to_currency": dst},
            json.dumps({"amount": value, "currency": dst}), f"{amount} {src} is {value} {dst}")


def _flight(rng: random.Random, origin: str, destination: str) -> tuple[str, dict[str, Any], str, str]:
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    price, hour = rng.randint(60, 900), rng.randint(6, 21)
    result = json.dumps({"flight": f"XA{rng.randint(100, 999)}", "departs": f"{date}T{hour:02d}:15",
                         "price_eur": price})
    return ("search_flights", {"origin": origin, "destination": destination, "date": date}, result,
            f"the cheapest direct flight from {origin} to {destination} on {date} leaves at {hour:02d}:15 "
            f"and costs {price} EUR")


def make_chats(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` chats in OpenAI's fine-tuning format (``{"messages": [...], "tools": [...]}``), from ``seed``.

    Shapes, drawn per chat: one tool call then an answer (45%), two calls in turn (20%), two calls in one
    turn (20%), a direct answer (15%). Every chat starts with the same system prompt and tools, as an
    agent's runs do.
    """
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        shape = rng.random()
        a, b = rng.sample(_CITIES, 2)
        if shape < 0.45:
            kind = rng.choice(["weather", "money", "flight"])
            if kind == "weather":
                name, args, result, fact = _weather(rng, a)
                chat = _Chat(rng.choice([f"What's the weather like in {a} right now?",
                                         f"Should I pack an umbrella for {a} today?"]))
            elif kind == "money":
                name, args, result, fact = _conversion(rng)
                chat = _Chat(f"How much is {args['amount']} {args['from_currency']} in {args['to_currency']}?")
            else:
                name, args, result, fact = _flight(rng, a, b)
                chat = _Chat(f"Find me a direct flight from {a} to {b} on {args['date']}.")
            chat.call((name, args, result))
            chats.append(chat.answer(f"Right now {fact}." if kind == "weather" else f"Done: {fact}."))
        elif shape < 0.65:
            f_name, f_args, f_result, f_fact = _flight(rng, a, b)
            w_name, w_args, w_result, w_fact = _weather(rng, b)
            chat = _Chat(f"I'm thinking of flying {a} to {b} on {f_args['date']}. Is there a flight, and "
                         "how's the weather there?")
            chat.call((f_name, f_args, f_result))
            chat.call((w_name, w_args, w_result))
            chats.append(chat.answer(f"Yes: {f_fact}. At the moment it is {w_fact}."))
        elif shape < 0.85:
            first, second = _weather(rng, a), _weather(rng, b)
            chat = _Chat(f"Compare the weather in {a} and {b}.")
            chat.call(first[:3], second[:3])
            chats.append(chat.answer(f"{first[3][0].upper()}{first[3][1:]}, while it is {second[3]}."))
        else:
            chat = _Chat(rng.choice([f"Which tools can you use to help me plan a trip to {a}?",
                                     "Thanks, that's all for today!", f"Can you book a hotel in {a}?"]))
            chats.append(chat.answer(rng.choice([
                "I can check the weather, convert currencies and search direct flights. What do you need?",
                "You're welcome, have a good trip!",
                "I can't book hotels, but I can search flights, check the weather or convert money for you."])))
    return chats


def training_template(template: str) -> str:
    """``template`` with ``{% generation %}`` markers around each assistant turn's content and ``<|im_end|>``.

    The rendered text is unchanged (the markers only record character spans, which Hugging Face's
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` turns into TRL's assistant mask); the
    newline after ``<|im_end|>`` stays outside, as the model never samples it.
    """
    edits = [
        ("{{- '<|im_start|>assistant\\n' + text -}}",
         "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- text -}}"),
        ("{{- '}\\n</tool_call>' -}}\n        {%- endfor -%}\n        {{- '<|im_end|>\\n' -}}",
         "{{- '}\\n</tool_call>' -}}\n        {%- endfor -%}\n        {{- '<|im_end|>' -}}{%- endgeneration -%}"
         "{{- '\\n' -}}"),
    ]
    for old, new in edits:
        if template.count(old) != 1:
            raise RuntimeError(f"the chat template changed: {old!r} is no longer found exactly once in it; "
                               "update training_template")
        template = template.replace(old, new)
    return template


def _fingerprint(rows: list[tuple[list[int], list[bool]]]) -> str:
    """Token ids and trained-token mask of every chat, as one short hash both sides can compare."""
    return hashlib.sha256(json.dumps([[ids, [int(m) for m in mask]] for ids, mask in rows]).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------------------------------
# One side, in its own process
# --------------------------------------------------------------------------------------------------

class StepClock:
    """Times consecutive optimizer steps: wall time, and the CPU other processes used meanwhile (in cores)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.start()

    def start(self) -> None:
        self._mark = (time.perf_counter(), time.process_time(), busy_cpu_seconds())

    def tick(self) -> None:
        t0, cpu0, busy0 = self._mark
        self.start()
        t1, cpu1, busy1 = self._mark
        seconds = t1 - t0
        others = max(0.0, busy1 - busy0 - (cpu1 - cpu0))
        self.steps.append({"seconds": seconds, "others_cores": others / seconds if seconds > 0 else 0.0})


def _ours(model_dir: Path, chats: list[dict[str, Any]], *, share_prefix: bool = True) -> dict[str, Any]:
    """One epoch through our trainer's SFT objective (``share_prefix=False``: the ablation, without prefix sharing)."""
    from art_core.config import LoraSettings, SFTConfig
    from art_core.training.samples import trajectory_samples
    from art_core.training.trainer import GRPOTrainer, load_policy
    from art_core.types import Trajectory, TrajectoryGroup

    model, tokenizer = load_policy(model_dir, LoraSettings(), device="cpu")
    adapter = reset_adapter(model, SEED)
    trainer = GRPOTrainer(model, tokenizer)
    trajectories = [Trajectory(messages=c["messages"], tools=c["tools"]) for c in chats]
    tokens = _fingerprint([(s.token_ids, s.trained) for t in trajectories
                           for s in trajectory_samples(t, tokenizer, assistant_turns="all")])
    config = SFTConfig(learning_rate=LEARNING_RATE, epochs=1, batch_size=BATCH, lr_schedule="linear",
                       warmup_ratio=0.0, assistant_turns="all", max_grad_norm=MAX_GRAD_NORM, weight_decay=0.0,
                       micro_batch_tokens=MICRO_BATCH_TOKENS, share_prefix=share_prefix)
    clock = StepClock()
    # One micro-batch per optimizer step here, so the progress call after each micro-batch marks a step (just
    # before its optimizer update; the last update falls in the tail added to the last step below).
    t0 = time.perf_counter()
    clock.start()
    metrics = trainer.train_step([TrajectoryGroup(trajectories)], config, progress=lambda done, total: clock.tick())
    epoch_s = time.perf_counter() - t0
    steps = clock.steps
    if len(steps) != metrics["optimizer_steps"]:
        raise RuntimeError(f"{len(steps)} micro-batches for {metrics['optimizer_steps']:.0f} optimizer steps: "
                           "raise MICRO_BATCH_TOKENS so that each step is one forward, as TRL's")
    prepare_s = metrics["seconds_prepare"]  # rendering and planning every batch, done before the first step
    steps[0]["seconds"] -= prepare_s
    steps[-1]["seconds"] += epoch_s - prepare_s - sum(s["seconds"] for s in steps)
    return {"adapter": adapter, "tokens": tokens, "prepare_s": prepare_s, "epoch_s": epoch_s, "steps": steps,
            "first_loss": metrics["loss_first"], "first_grad_norm": math.nan,
            "optimizer": "torch.optim.AdamW", "forward_tokens": metrics["forward_tokens"]}


def _trl(model_dir: Path, chats: list[dict[str, Any]], scratch: str) -> dict[str, Any]:
    """One epoch through TRL's SFTTrainer."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = training_template(tokenizer.chat_template)
    # Tools as JSON text: Arrow would otherwise merge the three schemas into one struct with null fields.
    dataset = Dataset.from_list([{"messages": c["messages"], "tools": json.dumps(c["tools"])} for c in chats])
    args = SFTConfig(
        output_dir=scratch, report_to="none", logging_strategy="steps", logging_steps=1, save_strategy="no",
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False, assistant_only_loss=True, packing=False, padding_free=False,
        max_length=None, train_sampling_strategy="sequential", shuffle_dataset=False,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, num_train_epochs=1,
        learning_rate=LEARNING_RATE, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, seed=SEED, dataloader_num_workers=0,
    )
    peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    prepare_s: list[float] = []
    losses: list[torch.Tensor] = []

    class Timed(SFTTrainer):
        def _prepare_dataset(self, *a: Any, **k: Any) -> Any:  # timed: part of TRL's epoch (ours renders inside)
            t0 = time.perf_counter()
            out = super()._prepare_dataset(*a, **k)
            prepare_s.append(time.perf_counter() - t0)
            return out

        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())  # no sync: read at the end
            return loss

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.tick()

    trainer = Timed(model=str(model_dir), args=args, train_dataset=dataset, processing_class=tokenizer,
                    peft_config=peft_config, callbacks=[Clock()])
    adapter = reset_adapter(trainer.model, SEED)
    prepared = trainer.train_dataset
    rows = [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in prepared]
    tokens = _fingerprint(rows)
    lengths = [len(ids) for ids, _ in rows]  # TRL pads each batch to its longest chat
    forward_tokens = sum(len(lengths[i:i + BATCH]) * max(lengths[i:i + BATCH]) for i in range(0, len(rows), BATCH))
    t0 = time.perf_counter()
    trainer.train()
    epoch_s = time.perf_counter() - t0 + sum(prepare_s)
    grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"adapter": adapter, "tokens": tokens, "prepare_s": sum(prepare_s), "epoch_s": epoch_s,
            "steps": clock.steps, "first_loss": float(losses[0]), "losses": [float(x) for x in losses],
            "first_grad_norm": grad_norms[0] if grad_norms else math.nan,
            "optimizer": f"{type(trainer.optimizer).__name__} ({args.optim})", "forward_tokens": forward_tokens}


def run_side(side: str, model_dir: Path, *, chats: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    data = make_chats(chats)
    with tempfile.TemporaryDirectory(prefix="sft-bench-") as scratch:
        if side == "trl":
            result = _trl(model_dir, data, scratch)
        else:
            result = _ours(model_dir, data, share_prefix=side != ABLATION)
    data_hash = hashlib.sha256(json.dumps(data).encode()).hexdigest()[:12]
    return {"side": side, "data": data_hash, **result,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux


# --------------------------------------------------------------------------------------------------
# The driver: interleaved subprocesses, then the report
# --------------------------------------------------------------------------------------------------

def _spawn(side: str, model_dir: Path, *, chats: int, threads: int) -> dict[str, Any]:
    options = ["--model", str(model_dir), "--chats", str(chats), "--threads", str(threads)]
    return run_side_process(__file__, side, options, threads=threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a local Hugging Face model folder, or a name art_core.models knows "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--chats", type=int, default=CHATS, help=f"chats in the epoch (default {CHATS})")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each side (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (default 2)")
    # Internal: run one side (the driver's subprocesses); by hand, ``--side ours_no_prefix_share --result-file F``
    # runs the ablation, whose steps compare with ours' steps of the same index.
    parser.add_argument("--side", choices=(*SIDES, ABLATION), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:
        result = run_side(args.side, Path(args.model), chats=args.chats, threads=args.threads)
        Path(args.result_file).write_text(json.dumps(result))
        return

    model_dir = resolve_model(args.model)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        for side in SIDES if round_index % 2 == 0 else SIDES[::-1]:  # ABBA: a drifting load hits no side more
            result = _spawn(side, model_dir, chats=args.chats, threads=args.threads)
            runs[side].append(result)
            quiet = sum(s["others_cores"] < QUIET_OTHERS_CORES for s in result["steps"])
            print(f"round {round_index + 1} {side:<5} epoch {result['epoch_s']:7.1f} s "
                  f"({len(result['steps'])} steps, {quiet} quiet; prepare {result['prepare_s']:.1f} s), "
                  f"first loss {result['first_loss']:.6f}, peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)

    for key in ("data", "adapter", "tokens"):
        seen = {r[key] for rs in runs.values() for r in rs}
        if len(seen) != 1:
            raise RuntimeError(f"the sides did not train on the same {key}: fingerprints {sorted(seen)}")
    report(runs, model_name=args.model, chats=args.chats, threads=args.threads, rounds=args.rounds)


def _epoch_estimate(side_runs: list[dict[str, Any]]) -> tuple[float, int, int]:
    """An epoch's time from its steps' quiet runs (their median) or, for a step with none, its fastest run.

    Returns (seconds, quiet steps, steps).
    """
    counts = {len(r["steps"]) for r in side_runs}
    if len(counts) != 1:
        raise RuntimeError(f"runs of one side took different numbers of steps: {sorted(counts)}")
    total, quiet_steps = min(r["prepare_s"] for r in side_runs), 0
    for i in range(counts.pop()):
        measured = [r["steps"][i] for r in side_runs]
        quiet = [m["seconds"] for m in measured if m["others_cores"] < QUIET_OTHERS_CORES]
        quiet_steps += bool(quiet)
        total += statistics.median(quiet) if quiet else min(m["seconds"] for m in measured)
    return total, quiet_steps, len(side_runs[0]["steps"])


def report(runs: dict[str, list[dict[str, Any]]], *, model_name: str, chats: int, threads: int, rounds: int) -> None:
    """Print the table, the checks, and (last) the JSON line."""
    estimate = {side: _epoch_estimate(runs[side]) for side in SIDES}
    epoch = {side: estimate[side][0] for side in SIDES}
    wall = {side: statistics.median(r["epoch_s"] for r in runs[side]) for side in SIDES}
    peak = {side: max(r["peak_rss_mib"] for r in runs[side]) for side in SIDES}
    first = {side: runs[side][0]["first_loss"] for side in SIDES}
    speedup = epoch["trl"] / epoch["ours"]
    memory_ratio = peak["ours"] / peak["trl"]
    steps = estimate["ours"][2]

    print(f"\nSFT, one epoch: {chats} chats with tool calls, {BATCH} per step ({steps} steps); model {model_name}; "
          f"fp32 CPU, {threads} threads; {rounds} run(s) per side")
    header = f"{'side':<6}{'epoch s':>10}{'quiet steps':>13}{'wall s (median)':>17}{'prepare s':>11}{'peak RSS MiB':>14}"
    print(header)
    print("-" * len(header))
    for side in SIDES:
        print(f"{side:<6}{epoch[side]:>10.1f}{estimate[side][1]:>8}/{estimate[side][2]:<4}{wall[side]:>17.1f}"
              f"{min(r['prepare_s'] for r in runs[side]):>11.2f}{peak[side]:>14.0f}")
    print("epoch s: each step's median over its quiet runs (others < "
          f"{QUIET_OTHERS_CORES} core), or its fastest run if none was quiet, summed, plus the fastest preparation")
    print(f"\nspeedup vs TRL: {speedup:.2f}x (goal {SPEED_GOAL}x: {'met' if speedup >= SPEED_GOAL else 'NOT met'}); "
          f"median wall {wall['trl'] / wall['ours']:.2f}x")
    print(f"peak RSS vs TRL: {memory_ratio:.3f}x (goal <= {MEMORY_GOAL}x: "
          f"{'met' if memory_ratio <= MEMORY_GOAL else 'NOT met'}); TRL optimizer: {runs['trl'][0]['optimizer']}")
    loss_rel = abs(first["ours"] - first["trl"]) / abs(first["trl"])
    agree = loss_rel < FIRST_LOSS_TOLERANCE
    print(f"first-step loss (same weights, same tokens, same mask): ours {first['ours']:.6f}, TRL {first['trl']:.6f}; "
          f"relative difference {loss_rel:.1e} -> {'same loss' if agree else 'MISMATCH: not the same work'}")

    print(json.dumps({
        "sft_speedup_vs_trl": round(speedup, 3),
        "speed_goal_met": speedup >= SPEED_GOAL,
        "sft_peak_rss_ratio_vs_trl": round(memory_ratio, 3),
        "memory_goal_met": memory_ratio <= MEMORY_GOAL,
        "ours_epoch_s": round(epoch["ours"], 2),
        "trl_epoch_s": round(epoch["trl"], 2),
        "quiet_steps": {side: [estimate[side][1], estimate[side][2]] for side in SIDES},
        "speedup_vs_trl_median_wall": round(wall["trl"] / wall["ours"], 3),
        "wall_s": {side: [round(r["epoch_s"], 2) for r in runs[side]] for side in SIDES},
        "trl_prepare_s": round(min(r["prepare_s"] for r in runs["trl"]), 3),
        "ours_peak_rss_mib": round(peak["ours"]),
        "trl_peak_rss_mib": round(peak["trl"]),
        "first_step_loss": {side: first[side] for side in SIDES},
        "first_step_loss_agree": agree,
        "steps": {side: [[[round(s["seconds"], 3), round(s["others_cores"], 2)] for s in r["steps"]]
                         for r in runs[side]] for side in SIDES},
        "model": model_name,
        "chats": chats,
        "batch": BATCH,
        "torch_threads": threads,
        "rounds": rounds,
    }))


if __name__ == "__main__":
    main()
