"""The gateway package's public surface."""

from __future__ import annotations

import subprocess
import sys

import art_core.gateway


def test_all_is_sorted_and_importable():
    assert art_core.gateway.__all__ == sorted(art_core.gateway.__all__)
    for name in art_core.gateway.__all__:
        assert getattr(art_core.gateway, name) is not None


def test_gateway_imports_without_torch():
    # The gateway sees only token ids and a tokenizer object: it must not need torch or transformers
    # (art_core.gateway.app imports every route module).
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from art_core.gateway import Gateway, GatewaySettings, create_app, RecordStore, ExchangeRecord; "
            "import art_core.gateway.app; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
