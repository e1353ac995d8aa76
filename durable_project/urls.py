"""URLs served by Django (everything except the lean ASGI endpoints: protocol, Yjs and the
probes, see asgi.py)."""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from access import views as access_views
from streams import api as streams_api


class SwaggerView(SpectacularSwaggerView):
    """The Swagger UI page. DRF answers OPTIONS with the view's metadata, which this page's
    only renderer (an HTML template renderer) cannot render: a 500. It answers OPTIONS as
    Django's own views do: 200, the allowed methods, no body."""

    def options(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:  # type: ignore[override]
        return HttpResponse(headers={"Allow": ", ".join(self.allowed_methods)})


# The admin's "View site" link opens the stream console.
admin.site.site_url = "/console/"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("console/", include("console.urls")),
    path("v1/streams", streams_api.StreamCatalog.as_view(), name="stream-catalog"),
    path("v1/state/", include("state.api.urls")),
    path("v1/auth/whoami", access_views.WhoAmI.as_view(), name="auth-whoami"),
    path("v1/auth/signed-urls", access_views.SignedUrls.as_view(), name="auth-signed-urls"),
    path("v1/schema", SpectacularAPIView.as_view(), name="openapi-schema"),
    path("v1/docs", SwaggerView.as_view(url_name="openapi-schema"), name="api-docs"),
]
