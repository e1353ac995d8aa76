"""URLs served by Django (everything except the lean ASGI endpoints: protocol, Yjs and the
probes, see asgi.py)."""

import threading
from typing import Any, ClassVar

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.request import Request
from rest_framework.response import Response

from access import views as access_views
from streams import api as streams_api


class SwaggerView(SpectacularSwaggerView):
    """The Swagger UI page. DRF answers OPTIONS with the view's metadata, which this page's
    only renderer (an HTML template renderer) cannot render: a 500. It answers OPTIONS as
    Django's own views do: 200, the allowed methods, no body."""

    def options(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:  # type: ignore[override]
        return HttpResponse(headers={"Allow": ", ".join(self.allowed_methods)})


class SchemaView(SpectacularAPIView):
    """The OpenAPI schema, built once per process under a lock. drf-spectacular's generator
    keeps state in module globals (the view it inspects, its warnings' breadcrumbs): two
    requests building the schema at once in Django's threads broke each other, answering 500
    ("Schema generation REQUIRES a view instance"), and left its state polluted for later ones.
    The schema is the same for every request anyway.

    The API has one version: ``?version=`` is refused (400). drf-spectacular puts the value in
    the answer's Content-Disposition and builds a schema for each one (probe 10e: a line break
    in it was a 500 with a traceback for anyone, U+2028 an answer never sent, a quote let a
    client name the file a browser saves, and each new value cost a build and five lines of
    warnings)."""

    _built: ClassVar[Any] = None
    _building = threading.Lock()

    @extend_schema(exclude=True)  # as drf-spectacular's own get: not a path of the API
    def get(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        if "version" in request.query_params:
            detail = "this API has one version: ask for its schema without ?version="
            return JsonResponse({"detail": detail, "code": "bad_request"}, status=400)
        return super().get(request, *args, **kwargs)

    def _get_schema_response(self, request: Request) -> Response:
        with SchemaView._building:
            if SchemaView._built is None:
                SchemaView._built = super()._get_schema_response(request).data
        filename = self._get_filename(request, None)  # the format asked for: json, yaml
        return Response(
            SchemaView._built, headers={"Content-Disposition": f'inline; filename="{filename}"'}
        )


# The admin's "View site" link opens the stream console.
admin.site.site_url = "/console/"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("console/", include("console.urls")),
    path("v1/streams", streams_api.StreamCatalog.as_view(), name="stream-catalog"),
    path("v1/state/", include("state.api.urls")),
    path("v1/auth/whoami", access_views.WhoAmI.as_view(), name="auth-whoami"),
    path("v1/auth/signed-urls", access_views.SignedUrls.as_view(), name="auth-signed-urls"),
    path("v1/schema", SchemaView.as_view(), name="openapi-schema"),
    path("v1/docs", SwaggerView.as_view(url_name="openapi-schema"), name="api-docs"),
]
