"""What a gateway with no keys refuses from web pages.

With no agent keys (the `clawr1 up` default) the gateway binds loopback only and trusts whoever
reaches it: the processes of this machine. A web page the user has open is not one of them, yet
its browser can reach 127.0.0.1 two ways:

- a cross-site "simple" request: a form POST, or `fetch` with a `text/plain` body, needs no CORS
  preflight, so a page on any site could pin a version, roll back, or post feedback and hints.
  The browser names the page's origin (`Origin`, `Sec-Fetch-Site`); such a request that would
  change something is refused;
- DNS rebinding: the page's own name made to resolve to 127.0.0.1, so its requests are
  same-origin and may read replies (the dashboard's conversations). They still carry the page's
  name as `Host`; an open gateway answers only loopback names.

A gateway with keys needs neither rule for its API: a page has no key. The dashboard's login
cookie is `SameSite=Strict`, which stops cross-site pages but not same-site ones (another port of
this host, a sibling subdomain), so the dashboard's forms refuse any page but its own
(`cross_site`) with keys too. Programs (SDKs, curl, agents) send no `Origin` and name the host
they dialled.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from clawr1.gateway.errors import APIError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def refusal(method: str, headers: Mapping[str, str]) -> APIError | None:
    """Why an open gateway refuses this request from a browser, or None. `headers`: lower-cased
    names (`host`, `origin`, `sec-fetch-site` are read)."""
    host = headers.get("host")
    if host is not None and not _loopback(host):
        return APIError(403, f"this gateway has no keys, so it answers loopback names only, not Host {host[:100]!r}; "
                             "to serve other names, set gateway.api_keys", code="host_not_allowed")
    return cross_site(method, headers, "on a gateway with no keys")


def cross_site(method: str, headers: Mapping[str, str], where: str) -> APIError | None:
    """Why a request that would change something comes from another site's or origin's page, or
    None. `where`: what the page may not change things on, for the message."""
    if method.upper() in SAFE_METHODS:
        return None
    # A browser's own word first (pages cannot set `Sec-Fetch-Site`); browsers without it (before
    # 2020-2023) are judged by `Origin`.
    origin, site = headers.get("origin"), headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site") or (site is None and origin is not None
                                                and _foreign(origin, headers.get("host") or "")):
        return APIError(403, f"a web page ({origin or site}) may not change anything {where}", code="cross_site_refused")
    return None


def _foreign(origin: str, host: str) -> bool:
    """A page's origin other than this gateway's: another scheme://host:port, or `null` (what a
    sandboxed frame or a local file sends). A value no browser sends (some HTTP libraries put
    their own) is not a page's."""
    if origin.strip() == "null":
        return True
    parts = urlsplit(origin.strip())
    return bool(parts.scheme and parts.netloc) and parts.netloc.lower() != host.lower()


@functools.lru_cache(maxsize=256)  # a gateway sees a handful of host names, on every request
def _loopback(host: str) -> bool:
    """`localhost`, `*.localhost`, or a loopback address, with or without a port."""
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
