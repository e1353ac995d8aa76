from django.urls import path

from state.api import views

urlpatterns = [
    path("streams", views.StateStreamList.as_view(), name="state-streams"),
    path("streams/<path:stream>", views.StateStreamDetail.as_view(), name="state-stream"),
    path("entities", views.EntityList.as_view(), name="state-entities"),
]
