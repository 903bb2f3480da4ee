"""`/dashboard`: a live web view of what the gateway served, what the judge decided and what the
trainer learnt. Server-rendered HTML; one small script refreshes the panels every few seconds.

Access: with `gateway.admin_key` set, the admin key, as `Authorization: Bearer <key>` or through
the sign-in form, which sets an HttpOnly, SameSite=Strict cookie holding an HMAC of the key (never
the key itself; stateless, so it survives restarts and dies with a key change). Agent keys never
open it: conversations are on it. With no keys at all the gateway binds loopback only and the
dashboard is open like everything else; with agent keys but no admin key it is disabled.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import uuid
from importlib import resources
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from clawr1.core.config import TENANT_NAME
from clawr1.core.records import DEFAULT_TENANT
from clawr1.engine import adapters as store
from clawr1.gateway import browsers
from clawr1.gateway.dashboard import data, views
from clawr1.gateway.errors import APIError
from clawr1.gateway.service import client_of

router = APIRouter()
COOKIE = "clawr1_dashboard"
STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
# Conversations are untrusted text: only this package's own script and stylesheet may run or apply.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin", "Cache-Control": "no-store",
}
Access = Literal["admin", "open", "login", "disabled"]


def cookie_token(admin_key: str) -> str:
    return hmac.new(admin_key.encode(), b"clawr1-dashboard-v1", hashlib.sha256).hexdigest()


def access(request: Request) -> Access:
    gateway = request.app.state.gateway
    gw = gateway.config.gateway
    if gw.admin_key is None:
        return "disabled" if gateway.agent_keys else "open"
    if gateway.is_admin(request):
        return "admin"
    if hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), cookie_token(gw.admin_key).encode()):
        return "admin"
    return "login"


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=HEADERS)


def _refused(kind: Access) -> HTMLResponse:
    return _html(views.disabled_page(), 403) if kind == "disabled" else _html(views.login_page(), 401)


def _require(request: Request) -> None:
    """For the JSON routes: OpenAI-shaped errors instead of pages."""
    kind = access(request)
    if kind == "disabled":
        raise APIError(403, "the dashboard is disabled: set gateway.admin_key", code="admin_disabled")
    if kind == "login":
        raise APIError(401, "the dashboard needs the admin key (Authorization: Bearer <admin_key>)",
                       code="invalid_api_key")


def _from_elsewhere(request: Request) -> HTMLResponse | None:
    """A form post from any page but the dashboard's own (the login cookie rides along on
    same-site requests): refused, with keys or without."""
    refused = browsers.cross_site(request.method, {k.lower(): v for k, v in request.headers.items()},
                                  "on this dashboard")
    return None if refused is None else _html(views.missing_page(refused.message, "Refused"), 403)


def _note(kind: Access) -> str:
    return "signed in with the admin key" if kind == "admin" else "open: no keys configured, loopback only"


def _tenant(request: Request) -> str | None:
    """`?tenant=NAME`: the dashboard of one tenant (its sessions, samples, adapter); else everyone's."""
    tenant = request.query_params.get("tenant") or None
    if tenant is not None and not re.fullmatch(TENANT_NAME, tenant):
        raise APIError(400, f"tenant must match {TENANT_NAME}", param="tenant")
    return tenant


async def _summary(request: Request) -> dict[str, Any]:
    state = request.app.state
    return await asyncio.to_thread(data.summary, state.gateway, _tenant(request))


@router.get("/dashboard")
async def dashboard(request: Request) -> Response:
    kind = access(request)
    if kind in ("login", "disabled"):
        return _refused(kind)
    return _html(views.main_page(await _summary(request), _note(kind)))


@router.post("/dashboard/login")
async def login(request: Request) -> Response:
    if (refused := _from_elsewhere(request)) is not None:
        return refused
    admin = request.app.state.gateway.config.gateway.admin_key
    if admin is None:  # nothing to sign in to: open, or disabled
        kind = access(request)
        return _refused(kind) if kind == "disabled" else RedirectResponse("/dashboard", 303)
    gateway, client = request.app.state.gateway, client_of(request)
    if gateway.throttle.blocked:  # guessing the admin key here costs what guessing it anywhere does
        try:
            gateway.throttle.check(client)
        except APIError as exc:
            return _html(views.login_page(exc.message), 429)
    raw = await request.body()
    if len(raw) > 4096:
        return _html(views.login_page("that form was too large"), 413)
    key = parse_qs(raw.decode("utf-8", "replace")).get("key", [""])[0]
    if not hmac.compare_digest(key.encode(), admin.encode()):
        gateway.throttle.failed(client)
        return _html(views.login_page("that is not the admin key"), 401)
    response = RedirectResponse("/dashboard", 303)
    response.set_cookie(COOKIE, cookie_token(admin), httponly=True, samesite="strict", path="/dashboard",
                        secure=request.url.scheme == "https")
    return response


@router.post("/dashboard/logout")
async def logout(request: Request) -> Response:
    if (refused := _from_elsewhere(request)) is not None:
        return refused
    response = RedirectResponse("/dashboard", 303)
    response.delete_cookie(COOKIE, path="/dashboard")
    return response


async def _admin_form(request: Request) -> dict[str, str] | Response:
    """An admin's small form post, or the page that refuses it: not signed in, from another site, or
    too large."""
    kind = access(request)
    if kind in ("login", "disabled"):
        return _refused(kind)
    if (refused := _from_elsewhere(request)) is not None:
        return refused
    raw = await request.body()
    if len(raw) > 4096:
        return _html(views.missing_page("that form was too large"), 413)
    return {k: v[0] for k, v in parse_qs(raw.decode("utf-8", "replace")).items()}


@router.post("/dashboard/versions")
async def version_action(request: Request) -> Response:
    """The admin's levers on the versions panel: pin a version, or roll back to it (what `clawr1
    pin N` and `clawr1 rollback N` do; the guard and the trainer apply them within a poll)."""
    form = await _admin_form(request)
    if isinstance(form, Response):
        return form
    gw = request.app.state.gateway
    tenant = form.get("tenant") or None
    version = form.get("version", "")
    if form.get("action") not in ("pin", "unpin", "rollback") or not (version.isdigit() or form["action"] == "unpin") \
            or (tenant is not None and not re.fullmatch(TENANT_NAME, tenant)):
        return _html(views.missing_page("not a version action"), 400)
    root, name = Path(gw.config.data_dir) / "adapters", gw.adapter_of(tenant or DEFAULT_TENANT)
    if form["action"] != "unpin" and int(version) != 0 and int(version) not in store.published(root, name):
        return _html(views.missing_page(f"{name} v{version} is not on disk"), 404)
    if form["action"] == "rollback":
        await asyncio.to_thread(store.set_control, root, name, rollback={"to": int(version), "id": uuid.uuid4().hex})
    else:
        await asyncio.to_thread(store.set_control, root, name, pinned=int(version) if form["action"] == "pin" else None)
    return RedirectResponse("/dashboard" + (f"?tenant={tenant}" if tenant else ""), 303)


@router.post("/dashboard/memory")
async def memory_action(request: Request) -> Response:
    """The admin's levers on the Memory panel: forget an entry, or turn the memory off (or on) for a
    user (what `clawr1 memory forget ID` and `clawr1 memory off --user U` do); this gateway applies
    them at once, others at their next read of the pool."""
    form = await _admin_form(request)
    if isinstance(form, Response):
        return form
    gw = request.app.state.gateway
    action, tenant, user = form.get("action"), form.get("tenant") or DEFAULT_TENANT, form.get("user", "")
    entry = form.get("id", "")
    if action not in ("forget", "off", "on") or not re.fullmatch(TENANT_NAME, tenant) \
            or (action == "forget" and not entry.isdigit()) or len(user) > 300:
        return _html(views.missing_page("not a memory action"), 400)
    if action == "forget":
        if not await asyncio.to_thread(gw.pool.forget_memory, int(entry), tenant=tenant):
            return _html(views.missing_page(f"no memory entry {entry} to forget in tenant {tenant}"), 404)
    else:
        await asyncio.to_thread(gw.pool.switch_memory, tenant, user, action == "off")
    await asyncio.to_thread(gw.memory.refresh)
    return RedirectResponse("/dashboard", 303)


@router.get("/dashboard/panels")
async def panels(request: Request) -> JSONResponse:
    """The panels' HTML, for the page's refresh (one summary for all of them)."""
    _require(request)
    return JSONResponse(views.panels(await _summary(request)), headers=HEADERS)


@router.get("/dashboard/api/summary")
async def summary(request: Request) -> JSONResponse:
    """The numbers behind the page, as JSON (for scripts; the panels render the same)."""
    _require(request)
    return JSONResponse(await _summary(request), headers=HEADERS)


@router.get("/dashboard/sessions/{session_id}")
async def session(session_id: str, request: Request, tenant: str | None = None) -> Response:
    kind = access(request)
    if kind in ("login", "disabled"):
        return _refused(kind)
    try:
        shown = await asyncio.to_thread(data.session, request.app.state.gateway, session_id, tenant)
    except KeyError:
        return _html(views.missing_page(f"no session {session_id!r}"), 404)
    except ValueError as exc:  # the id exists under several tenants
        return _html(views.missing_page(str(exc)), 400)
    return _html(views.session_page(shown, _note(kind)))


@router.get("/dashboard/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:  # a fixed list: no path ever reaches the filesystem from the URL
        raise APIError(404, f"no static file {name!r}", code="not_found")
    body = resources.files("clawr1.gateway.dashboard").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "max-age=300",
                                                             "X-Content-Type-Options": "nosniff"})
