"""Logging in to the dashboard: the ``/login`` routes, and a login page for a browser that has no token yet.

A browser (a request that accepts HTML, for a page outside ``/api`` and ``/metrics``) without the token gets
the login page, status 401, with a form to paste the token into; the form POSTs it, so it never lands in a URL,
the history or a log. API and scraping clients keep the bare 401 JSON they can act on. ``/login?token=TOKEN``
still logs in once from a link (``reshard up`` prints one).
"""

from __future__ import annotations

import hmac
from typing import Optional
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["COOKIE", "install_login"]

COOKIE = "reshard_admin"
_MACHINE_PATHS = ("/api/", "/metrics", "/openapi.json")
_MAX_FORM_BYTES = 4096


def _is_token(given: Optional[str], token: Optional[str]) -> bool:
    return token is not None and bool(given) and hmac.compare_digest(given.encode(), token.encode())


def _safe_next(page: str) -> str:
    """Only paths on this server, never another site."""
    return page if page.startswith("/") and not page.startswith("//") else "/"


def _logged_in(token: str, next_page: str) -> Response:
    resp = RedirectResponse(_safe_next(next_page), status_code=303)
    resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", max_age=12 * 3600)
    return resp


def _wants_page(request: Request) -> bool:
    return ("text/html" in request.headers.get("accept", "")
            and not request.url.path.startswith(_MACHINE_PATHS))


def install_login(app: FastAPI, templates: Jinja2Templates, token: Optional[str]) -> None:
    """Add ``GET /login`` (token in the query), ``POST /login`` (the form) and the login page for browsers."""
    router = APIRouter(include_in_schema=False)

    def page(request: Request, next_page: str, wrong: bool = False) -> HTMLResponse:
        return templates.TemplateResponse(request, "login.html", {"next": _safe_next(next_page), "wrong": wrong},
                                          status_code=401)

    @router.get("/login")
    def login_link(request: Request, token_arg: str = Query("", alias="token"),
                   next_page: str = Query("/", alias="next")):
        if _is_token(token_arg, token):
            return _logged_in(token, next_page)
        if _wants_page(request):
            return page(request, next_page, wrong=bool(token_arg))
        raise HTTPException(status_code=401, detail="unauthorized")

    @router.post("/login")
    async def login_form(request: Request):
        body = await request.body()
        form = parse_qs(body[:_MAX_FORM_BYTES].decode(errors="replace"))
        given, next_page = form.get("token", [""])[0].strip(), form.get("next", ["/"])[0]
        if _is_token(given, token):
            return _logged_in(token, next_page)
        return page(request, next_page, wrong=True)

    app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def unauthorized(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 401 and _wants_page(request):
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return page(request, target)
        return await http_exception_handler(request, exc)
