"""URLs served by Django (everything except the lean ASGI endpoints: protocol, Yjs and the
probes, see asgi.py)."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from access import views as access_views
from streams import api as streams_api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/streams", streams_api.StreamCatalog.as_view(), name="stream-catalog"),
    path("v1/state/", include("state.api.urls")),
    path("v1/auth/whoami", access_views.WhoAmI.as_view(), name="auth-whoami"),
    path("v1/auth/signed-urls", access_views.SignedUrls.as_view(), name="auth-signed-urls"),
    path("v1/schema", SpectacularAPIView.as_view(), name="openapi-schema"),
    path("v1/docs", SpectacularSwaggerView.as_view(url_name="openapi-schema"), name="api-docs"),
]
