"""Reading a request body safely: size and nesting are bounded *before* the bytes become Python
objects, and what JSON parsers accept but nothing downstream can store is refused.

- size: `Content-Length` is checked before reading, and the stream is cut off at the limit (a
  chunked body has no length to check);
- depth: Python's `json` recurses per nesting level and raises `RecursionError` around 1,000
  levels (a 500 before this module existed); bodies are scanned for their depth first. The scan
  is skipped when the body has fewer brackets than the limit, which is every ordinary request, so
  the hot path pays two `bytes.count` calls;
- `NaN` / `Infinity` (Python's `json` accepts them, JSON does not, and neither does a JSONB
  column) and lone UTF-16 surrogates (`"\\ud800"`, which no UTF-8 encoder can write to the pool)
  are 400s.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from clawr1.gateway.errors import APIError

# A JSON string token (escapes included) or one bracket: strings are skipped whole, so brackets
# inside them never count. An unterminated string runs to the end of the body (the parser refuses
# it later): were it to fail instead, the scan would retry at every later quote, quadratic time.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one beyond a double's range (`1e400`) would silently be `inf`,
    which no reply, SSE event or stored step can carry as JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (numbers must be finite)")
    return value


# Built once: `json.loads` with hooks builds a decoder and its C scanner on every call.
_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most `max_bytes` (413 beyond, without reading the rest into memory)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise APIError(400, "the client closed the connection before sending the whole body",
                       code="incomplete_body") from exc
    return b"".join(chunks)


def depth_of(raw: bytes, limit: int) -> int:
    """Nesting depth of a JSON text, or of its first `limit + 1` levels (enough to refuse it)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0  # it cannot nest deeper than it has brackets
    depth = deepest = 0
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token[0] == 0x22:  # a string
            continue
        if token in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The parsed body (an empty body is `{}`), or a 400 that says what is wrong with it."""
    if not raw.strip():
        return {}
    if depth_of(raw, max_depth) > max_depth:
        raise APIError(400, f"request body nests deeper than {max_depth} levels", code="invalid_json")
    try:
        # Decoded here, strictly: `json.loads` on bytes would guess UTF-16/32 and let raw UTF-8
        # surrogates through (surrogatepass). JSON on the wire is UTF-8 (RFC 8259).
        text = raw.decode("utf-8-sig")  # a BOM is tolerated, as `json.loads` on bytes did
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}",
                       code="invalid_json") from exc
    try:
        value = _decoder.decode(text)  # `json.loads(text, parse_constant=..., parse_float=...)`
    except ValueError as exc:  # JSONDecodeError, and the constants refused above
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if ("\\ud" in text or "\\uD" in text) and _has_surrogate(value):
        raise APIError(400, "request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text",
                       code="invalid_json")
    return value


def _has_surrogate(value: Any) -> bool:
    """Only reached when the raw body has a `\\ud..` escape: most of those are valid pairs (emoji)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    return parse_json(await read_body(request, max_bytes), max_depth)
