"""GatewaySettings: checked before anything starts."""

from __future__ import annotations

import pytest

from art_core.errors import ConfigError
from art_core.gateway import GatewaySettings


def test_defaults_are_loopback_without_key():
    settings = GatewaySettings()
    assert (settings.host, settings.port, settings.api_key) == ("127.0.0.1", 0, None)
    assert settings.max_request_bytes == 4 * 1024 * 1024 and settings.max_tokens_limit == 4096


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "gpu-box.example.com", "::"])
def test_exposed_host_needs_an_api_key(host: str):
    with pytest.raises(ConfigError, match="not a loopback address.*api_key"):
        GatewaySettings(host=host)
    assert GatewaySettings(host=host, api_key="s3cret").api_key == "s3cret"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_no_key(host: str):
    assert GatewaySettings(host=host).host == host


def test_unknown_and_invalid_values_are_all_reported():
    with pytest.raises(ConfigError) as info:
        GatewaySettings(prot=8000, max_tokens_limit=0)
    assert "prot" in str(info.value) and "max_tokens_limit" in str(info.value) and "2 problem" in str(info.value)


def test_frozen():
    with pytest.raises(Exception, match="frozen"):
        GatewaySettings().port = 1  # type: ignore[misc]
