"""Staff manage API keys and their grants in the admin; the key is shown once, at creation."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from rest_framework_api_key.admin import APIKeyModelAdmin
from rest_framework_api_key.models import APIKey

from access.models import ApiKey, Grant
from streams.admin import CheckedSelectionAdmin

# The library's own concrete model is unused: this project's keys are ApiKey.
admin.site.unregister(APIKey)

# Django's own admins of users and groups, with actions that refuse a selection naming no
# object (CheckedSelectionAdmin; found by review: theirs were a 500).
for _model, _admin in ((get_user_model(), UserAdmin), (Group, GroupAdmin)):
    admin.site.unregister(_model)
    admin.site.register(_model, type(_admin.__name__, (CheckedSelectionAdmin, _admin), {}))


class GrantInline(admin.TabularInline):
    model = Grant
    extra = 1
    fields = ["prefix", "read", "append", "manage"]


@admin.register(ApiKey)
class ApiKeyAdmin(CheckedSelectionAdmin, APIKeyModelAdmin):
    list_display = (
        "prefix", "name", "owner", "created", "expiry_date", "_has_expired", "revoked",
        "rate_limit", "grant_list",
    )  # type: ignore[assignment]  # fmt: skip
    list_filter = ("revoked", "created")  # type: ignore[assignment]
    search_fields = ("name", "prefix", "owner__username")  # type: ignore[assignment]
    inlines = [GrantInline]

    @admin.display(description="grants")
    def grant_list(self, key: ApiKey) -> str:
        return ", ".join(str(grant) for grant in key.grants.all()) or "(none)"
