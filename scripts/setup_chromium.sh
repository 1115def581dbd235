#!/usr/bin/env bash
# Headless Chromium for the tracker UI tests (tests/tracking/test_mlflow_ui.py, test_trackio.py: they load the
# MLflow and Trackio pages and read what a person would see). Debian's `chromium` package, installed when it is
# missing and this user can (root, apt-get); otherwise those tests skip and say why. Idempotent: nothing is done
# when a Chromium is on PATH (~15 s the first time on a fresh machine).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_chromium: no chromium, and installing it needs root and apt-get: the tracker UI tests will skip" >&2
    exit 0
fi
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
        >/dev/null; then
    echo "setup_chromium: apt-get could not install chromium: the tracker UI tests will skip" >&2
fi
