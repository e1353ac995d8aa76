"""URLs served by Django (everything except the lean ASGI protocol endpoints, see asgi.py)."""

from django.contrib import admin
from django.urls import path

from streams import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("admin/", admin.site.urls),
]
