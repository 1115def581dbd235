#!/usr/bin/env bash
# Build the light client virtualenv of a remote set-up: art-core[serve] + art-plugins[langgraph,openai-agents],
# no torch. tests/server/ run the agent side of `art-core serve` in it, to prove the client needs no torch.
#
# Usage:   scripts/setup_client_venv.sh
# Env:     ART_CLIENT_VENV   where to build it (default: ~/.cache/art-core/venv-client-<hash of the pyprojects>)
#          PYTHON            interpreter to build it from (default: python3)
#
# Idempotent and cached per machine: the default folder is keyed by a hash of both pyproject.toml files, so
# it is rebuilt only when the dependencies change. The packages are installed non-editable (a copy), so the
# venv holds the code of the tree it was built from: tests put the worktree first on PYTHONPATH to run
# the current code with the venv's dependencies. Prints the venv's python on the last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
key="$(cat "$repo/pyproject.toml" "$repo/core/pyproject.toml" | sha256sum | cut -c1-12)"
venv="${ART_CLIENT_VENV:-$HOME/.cache/art-core/venv-client-$key}"
stamp="$venv/.art-client-ready"
py="$venv/bin/python"

healthy() {
    [[ -x "$py" ]] && "$py" -c "import art_core, art_plugins, langgraph, agents, httpx" >/dev/null 2>&1 \
        && ! "$py" -c "import torch" >/dev/null 2>&1
}

if [[ -f "$stamp" ]] && healthy; then
    echo "client venv ready (reused): $venv" >&2
    echo "$py"
    exit 0
fi

echo "building the client venv (no torch) in $venv (about a minute)" >&2
rm -f "$stamp"
mkdir -p "$(dirname "$venv")"
[[ -x "$py" ]] || "${PYTHON:-python3}" -m venv "$venv"
"$py" -m pip install --quiet --upgrade pip
# Copies, not editable installs: the build must not depend on where the worktree lives.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp -r "$repo/core" "$tmp/core"
cp -r "$repo/art_plugins" "$repo/pyproject.toml" "$repo/README.md" "$tmp/"
"$py" -m pip install --quiet "$tmp/core[serve]" "$tmp[langgraph,openai-agents]"

if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "the client venv in $venv has torch installed: something pulled it in; see pip's output" >&2
    exit 1
fi
if ! healthy; then
    echo "client venv in $venv does not import; the error follows:" >&2
    "$py" -c "import art_core, art_plugins, langgraph, agents" >&2 || true
    exit 1
fi
date -u +%FT%TZ > "$stamp"
echo "client venv ready: $venv" >&2
echo "$py"
