"""Who may use the console, and the headers every console answer carries.

Staff only, signed in through the admin (Django's sessions and users): anyone else is sent to
the admin's login page. Viewing needs the permission to view streams (``streams.view_stream``),
appending a message ``console.append_messages``; superusers have both.

A refusal of the protocol's kind (``streams.errors``: bad input, not found, conflicts) becomes
a page or, for what pages fetch, JSON with its status (``refusal``). Every answer forbids
caching and framing, and pages carry a Content-Security-Policy that
allows scripts, styles and connections of this origin only: message contents and stream paths
are escaped wherever they are shown, and if an escape were ever missed, an injected script or
event handler still would not run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.cache import add_never_cache_headers

from streams.errors import Forbidden, ProtocolError

VIEW = "streams.view_stream"
APPEND = "console.append_messages"
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


def _signed_out(request: HttpRequest, page: bool) -> HttpResponse:
    """A page sends the visitor to log in; what a page fetches answers 401 (a fetch would
    follow a redirect to the login form and take it for its answer)."""
    if page:
        return redirect_to_login(request.get_full_path(), reverse("admin:login"))
    body = {"error": "sign in to the console again", "code": "UNAUTHORIZED"}
    return JsonResponse(body, status=401)


def refusal(request: HttpRequest, error: ProtocolError, *, page: bool) -> HttpResponse:
    """The one place where a console request's refusal becomes an answer: a page for people,
    JSON (status, code, message) for the pages' scripts."""
    if page:
        context = {"error": error, "section": None}
        return TemplateResponse(request, "console/error.html", context, status=error.status)
    return JsonResponse({"error": error.message, "code": error.code}, status=error.status)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """``CSRF_FAILURE_VIEW``: a form refused by Django's CSRF check (a stale page, a forged
    post) gets the console's error page with its security headers, not Django's bare one."""
    error = Forbidden(
        "the form was not sent from this site's page, or the page is stale: reload it"
    )
    return _secured(refusal(request, error, page=True))


def _staff(user: Any) -> bool:
    return bool(user.is_active and user.is_staff)


def _denied(request: HttpRequest, permission: str, page: bool) -> HttpResponse:
    error = Forbidden(f"the console needs the {permission} permission")
    return refusal(request, error, page=page)


def _secured(response: HttpResponse) -> HttpResponse:
    add_never_cache_headers(response)
    response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    return response


def console_view(permission: str = VIEW, *, page: bool = True) -> Callable[[Any], Any]:
    """Decorate a console view (sync or async): staff with ``permission`` only. ``page``:
    whether it is a page people open (else a fragment or JSON that pages fetch)."""

    def decorate(view: Any) -> Any:
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                user = await request.auser()
                if not _staff(user):
                    return _secured(_signed_out(request, page))
                if not await user.ahas_perm(permission):
                    return _secured(_denied(request, permission, page))
                try:
                    response = await view(request, *args, **kwargs)
                except ProtocolError as error:
                    response = refusal(request, error, page=page)
                return _secured(response)

            return async_wrapped

        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not _staff(request.user):
                return _secured(_signed_out(request, page))
            if not request.user.has_perm(permission):
                return _secured(_denied(request, permission, page))
            try:
                response = view(request, *args, **kwargs)
            except ProtocolError as error:
                response = refusal(request, error, page=page)
            return _secured(response)

        return wrapped

    return decorate
