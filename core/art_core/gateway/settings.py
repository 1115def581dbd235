"""The gateway's settings: where it listens, who may call it, what it serves and how much it accepts."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import ConfigDict, Field, model_validator

from ..config import CheckedSettings

__all__ = ["GatewaySettings", "is_loopback_host"]

MiB = 1024 * 1024


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); False for any other host."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything: treat it as exposed


class GatewaySettings(CheckedSettings):
    """How the gateway serves the model being trained.

    Raises:
        ConfigError: a value is invalid, or ``host`` is not a loopback address and no ``api_key`` is set.
            Every problem is listed in the one error.
    """

    settings_name = "gateway settings"
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    """Loopback by default: only this machine can reach the gateway."""
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port; ``Gateway.base_url`` tells which one was bound."""
    api_key: str | None = Field(None, min_length=1)
    """Bearer token every route requires when set. Required when ``host`` is not a loopback address."""
    model_name: str = Field("agent", min_length=1)
    """The trained model's name, as clients send it in ``model`` (``"agent"`` or ``"agent@<step>"``)."""
    base_model_name: str = Field("smollm2-135m-instruct", min_length=1)
    """The base model's name; accepted as ``model`` only while no adapter is loaded (step 0)."""
    max_request_bytes: int = Field(4 * MiB, ge=1024)
    """4 MiB: a long agent conversation with tool schemas is far below it; larger bodies get 413."""
    max_tokens_limit: int = Field(4096, ge=1)
    """Largest ``max_tokens`` a request may ask for; more gets 400 (it would tie up the engine)."""
    default_max_tokens: int = Field(1024, ge=1)
    """Used when a request sets no ``max_tokens``: bounds a small model that never stops. Clipped to the limit."""
    records_path: Path | None = None
    """JSONL file every answered choice is appended to before the response is sent; None keeps them in memory only."""
    fsync_records: bool = False
    """Also fsync each record before answering. Off: a flush already survives a crash of this process, and
    fsync adds ~0.1-10 ms per record (disk-dependent) to every request; on when a power cut or kernel crash
    must not lose answered calls either."""
    max_records_in_memory: int = Field(10_000, ge=1)
    """In-memory index size; the oldest records are evicted (they stay in ``records_path`` when set)."""

    @model_validator(mode="after")
    def _exposed_needs_key(self) -> GatewaySettings:
        if self.api_key is None and not is_loopback_host(self.host):
            raise ValueError(
                f"host {self.host!r} is not a loopback address, so the gateway would be reachable from other "
                "machines: set api_key (clients then send 'Authorization: Bearer <key>'), or use host='127.0.0.1'"
            )
        return self
