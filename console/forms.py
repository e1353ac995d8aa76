"""What the console's pages accept from the query string and forms, validated by Django forms:
anything else is a 400 that names the field, never an error of the database."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from streams.errors import BadRequest
from streams.http.request import MAX_PATH_BYTES
from streams.protocol.offsets import Offset, parse

ANY = ""
MAX_TEXT = MAX_PATH_BYTES
# The longest message the stream page's form takes (larger ones: use the protocol).
MAX_APPEND_BYTES = 1024 * 1024


class OffsetField(forms.CharField):
    """An offset this server mints (``{seq:016d}_{pos:016d}``)."""

    def to_python(self, value: str | None) -> Offset | None:  # type: ignore[override]
        text = super().to_python(value)
        if not text:
            return None
        try:
            return parse(text)
        except BadRequest:
            raise ValidationError(
                "an offset is 16 digits, '_' and 16 digits", code="invalid"
            ) from None


def _choice(*choices: tuple[str, str]) -> forms.ChoiceField:
    return forms.ChoiceField(choices=[(ANY, "any"), *choices], required=False)


class StreamFilters(forms.Form):
    """The stream list's search. Every field is optional; an empty form lists every stream."""

    # Not "prefix": forms have an attribute of that name.
    path_prefix = forms.CharField(required=False, max_length=MAX_TEXT, strip=False)
    content_type = forms.CharField(required=False, max_length=256)
    min_bytes = forms.IntegerField(required=False, min_value=0, max_value=2**62)
    max_bytes = forms.IntegerField(required=False, min_value=0, max_value=2**62)
    tail_from = OffsetField(required=False, label="Tail at or past")
    closed = _choice(("yes", "closed"), ("no", "open"))
    expiry = _choice(("ttl", "expires"), ("never", "never expires"), ("expired", "expired"))
    fork = _choice(("fork", "is a fork"), ("source", "has forks"), ("plain", "neither"))
    forked_from = forms.CharField(required=False, max_length=MAX_TEXT, strip=False)
    state = _choice(("yes", "registered"), ("no", "not registered"))
    status = forms.ChoiceField(
        choices=[("live", "live"), ("deleted", "soft-deleted"), ("all", "all")],
        required=False,
    )
    # Keyset pagination: the page after this path.
    after = forms.CharField(required=False, max_length=MAX_TEXT, strip=False)

    def clean(self) -> dict[str, object]:
        data = super().clean() or {}
        low, high = data.get("min_bytes"), data.get("max_bytes")
        if low is not None and high is not None and low > high:
            raise ValidationError("the minimum size is larger than the maximum")
        return data


class OlderMessages(forms.Form):
    """``before``: messages that end at or before this offset (default: the tail)."""

    before = OffsetField(required=False)
    limit = forms.IntegerField(required=False, min_value=1, max_value=500)


class AppendMessage(forms.Form):
    """A message typed into the stream page: JSON for JSON streams, text otherwise."""

    body = forms.CharField(
        strip=False, max_length=MAX_APPEND_BYTES, widget=forms.Textarea(attrs={"rows": 4})
    )

    def clean_body(self) -> str:
        # Browsers submit a textarea's line breaks as CRLF (HTML's form encoding); what the
        # person typed were line feeds.
        return str(self.cleaned_data["body"]).replace("\r\n", "\n")


class EntityFilters(forms.Form):
    type = forms.CharField(required=False, max_length=MAX_TEXT)
    key = forms.CharField(required=False, max_length=MAX_TEXT, strip=False)


def errors_text(form: forms.Form) -> str:
    """A form's errors in one line, for a 400."""
    parts = []
    for field, errors in form.errors.items():
        label = "" if field == "__all__" else f"{field}: "
        parts.append(label + "; ".join(str(error) for error in errors))
    return ". ".join(parts)
