"""Whether the gateway may start as configured: loopback by default, API keys before any other
address, TLS files that exist (`check_exposure`). Running it is `clawr1.entrypoints.serve`."""

from __future__ import annotations

import ipaddress

from clawr1.core.config import Config


class UnsafeBindError(ValueError):
    """The gateway cannot start safely as configured: a non-loopback address without API keys (an
    open model server), or TLS files that are not there."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config) -> str:
    """Refuse to expose an unauthenticated gateway, or to start with TLS files that are not there;
    say how it is protected."""
    gw = config.gateway
    for path in (gw.tls_cert, gw.tls_key):
        if path is not None and not path.is_file():
            raise UnsafeBindError(f"gateway TLS file {path} does not exist")
    keys = len(gw.api_keys) + sum(len(k) for k in config.tenants.keys.values())
    if not keys:
        if not is_loopback(gw.host):
            raise UnsafeBindError(f"refusing to bind {gw.host} without API keys: set gateway.api_keys (or "
                                  "tenants.keys) or bind 127.0.0.1")
        return f"no API keys configured: serving on {gw.host} (loopback) only"
    tenants = f" for {len(config.tenants.keys)} named tenant(s) and the default one" if config.tenants.keys else ""
    transport = "HTTPS" if gw.tls_cert else ("plain HTTP: set gateway.tls_cert and tls_key to encrypt"
                                             if not is_loopback(gw.host) else "plain HTTP on loopback")
    return f"{keys} API key(s) required{tenants}; {transport}"
