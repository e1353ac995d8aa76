"""Django settings, read from the environment with django-environ.

Defaults serve a developer: with no ``DATABASE_URL`` the project starts its own PostgreSQL
cluster (see ``durable_project.localdb``). Production sets ``DATABASE_URL``,
``DJANGO_SECRET_KEY``, ``DJANGO_DEBUG=false`` and ``DJANGO_ALLOWED_HOSTS``.

Protocol settings use the peer server's names (``DS_SECTION__NAME``).
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
# Variables of the environment win over the file's. DJANGO_ENV_FILE names another file.
ENV_FILE = Path(os.environ.get("DJANGO_ENV_FILE") or BASE_DIR / ".env")
if ENV_FILE.is_file():
    environ.Env.read_env(ENV_FILE)


# The largest value a number setting may take: what a PostgreSQL bigint holds with room for
# sums (an integer), about 31 years (seconds); less where a setting becomes a PostgreSQL int.
MOST_INT = 2**62
MOST_SECS = 1e9


def _int(name: str, default: int | None, *, least: int, most: int = MOST_INT) -> Any:
    """The integer setting ``name`` (``default`` when unset), ``least`` or more: anything else
    refuses to start, naming the setting (a wrong type or value met only at the first request
    that used it was a 500, a spin or a hang there: probe 10f)."""
    try:
        value = env.int(name, default=default)
    except ValueError:
        raise ImproperlyConfigured(
            f"{name} must be an integer, not {os.environ.get(name)!r}"
        ) from None
    if value is not None and value < least:
        raise ImproperlyConfigured(f"{name} must be {least} or more, not {value}")
    if value is not None and value > most:
        raise ImproperlyConfigured(f"{name} must be {most} or less, not {value}")
    return value


def _float(
    name: str,
    default: float,
    *,
    least: float | None = None,
    above: float | None = None,
    most: float = MOST_SECS,
) -> float:
    """The number setting ``name`` (``default`` when unset): finite, ``least`` or more, or
    more than ``above``; anything else refuses to start, naming the setting (as ``_int``)."""
    raw = os.environ.get(name)
    try:
        value = env.float(name, default=default)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ImproperlyConfigured(f"{name} must be a finite number, not {raw!r}")
    if least is not None and value < least:
        raise ImproperlyConfigured(f"{name} must be {least} or more, not {value}")
    if above is not None and value <= above:
        raise ImproperlyConfigured(f"{name} must be more than {above}, not {value}")
    if value > most:
        raise ImproperlyConfigured(f"{name} must be {most:g} or less, not {value}")
    return float(value)


# Off unless asked for: a development checkout asks in its `.env` (written by `make setup`).
DEBUG = env.bool("DJANGO_DEBUG", default=False)
DEVELOPMENT_SECRET_KEY = "dev-only-insecure-key-set-DJANGO_SECRET_KEY-in-production"
SECRET_KEY = env("DJANGO_SECRET_KEY", default=DEVELOPMENT_SECRET_KEY if DEBUG else "")
if not DEBUG and SECRET_KEY in ("", DEVELOPMENT_SECRET_KEY):
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY must be set to a secret of your own when DJANGO_DEBUG is false "
        "(for example: python -c 'import secrets; print(secrets.token_urlsafe(50))')"
    )
# Any host in development; in production only what DJANGO_ALLOWED_HOSTS names (and loopback
# by default), so URLs built from the Host header (Location) cannot be pointed elsewhere.
ALLOWED_HOSTS = env.list(
    "DJANGO_ALLOWED_HOSTS", default=["*"] if DEBUG else ["localhost", "127.0.0.1", "[::1]"]
)
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])
CSRF_FAILURE_VIEW = "console.access.csrf_failure"
# Behind TLS (README, Production): the admin's and console's session and CSRF cookies only
# over HTTPS, HSTS for this long, and the proxy's header that says a request came over HTTPS
# (e.g. X-Forwarded-Proto; only if the proxy always sets it). Off by default so that a
# checkout served over plain HTTP (make serve) can still sign in.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env.bool("DJANGO_SECURE_COOKIES", default=False)
SECURE_HSTS_SECONDS = _int("DJANGO_HSTS_SECONDS", default=0, least=0)
_PROXY_SSL_HEADER = env.str("DJANGO_PROXY_SSL_HEADER", default="")
if _PROXY_SSL_HEADER:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https")

INSTALLED_APPS = [
    # daphne first: it makes `manage.py runserver` serve the ASGI application.
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    # Swagger UI's assets, served from the project (no CDN): /v1/docs works offline.
    "drf_spectacular_sidecar",
    "rest_framework_api_key",
    "streams",
    "access",
    "state",
    "yjs",
    "spark",
    "subscriptions",
    "console",
    "tablesync",
]

MIDDLEWARE = [
    "durable_project.middleware.ReleaseDatabaseMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "durable_project.middleware.ApiHeadersMiddleware",
    "durable_project.middleware.DatabaseErrorMiddleware",
    "durable_project.middleware.SignInThrottleMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "durable_project.urls"
ASGI_APPLICATION = "durable_project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def database_config(url: str) -> dict[str, Any]:
    """Django's settings for the database at ``url``. django-environ keeps a percent-encoded
    host as it is, and libpq's URL form writes a Unix socket's directory that way
    (``postgres://user@%2Frun%2Fpostgresql/db``): the host is decoded here."""
    config: dict[str, Any] = env.db_url_config(url)
    config["HOST"] = unquote(config.get("HOST") or "")
    return config


# The protocol endpoints' own connections (their pool, the LISTEN connection) may reach the
# database through a Unix socket in this directory instead of the URL's host and port: on the
# same machine a statement costs the server less CPU that way than over TCP (docs/
# benchmarks.md). The project's local cluster offers one; Django and Spark keep the URL.
DS_DB_SOCKET_DIR = env.str("DS_DB__SOCKET_DIR", default="")
if env("DATABASE_URL", default=""):
    DATABASES = {"default": database_config(env.str("DATABASE_URL"))}
else:
    from durable_project import localdb

    DATABASES = {"default": database_config(localdb.ensure_running())}
    DS_DB_SOCKET_DIR = DS_DB_SOCKET_DIR or localdb.socket_directory() or ""
# Pages, the admin and the REST API run in Django's threads under ASGI, each request on a thread
# of its own: persistent per-thread connections (CONN_MAX_AGE) would pile up, one per thread
# that ever ran. A bounded pool instead (Django 5.1+, psycopg_pool): at most this many
# connections per process. A request waits at most DS_DB_ACQUIRE_TIMEOUT_SECS for a pooled
# connection (here and in the protocol endpoints' async pool), then answers 503 with
# Retry-After: the database is down or overloaded.
DS_DB_ACQUIRE_TIMEOUT_SECS = _float("DS_DB__ACQUIRE_TIMEOUT_SECS", default=3.0, above=0)
DATABASES["default"]["CONN_MAX_AGE"] = 0
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)
DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
    "min_size": 0,
    "max_size": _int("DS_DB__DJANGO_POOL_MAX_SIZE", default=4, least=1),
    "timeout": DS_DB_ACQUIRE_TIMEOUT_SECS,
    "max_idle": 60,
    # Give up a reconnection after 5 s, so the next request starts over at once once the
    # database is back (streams/store/pool.py: RECONNECT_TIMEOUT_SECS).
    "reconnect_timeout": 5,
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The setting ``name`` (``default`` when unset), one of ``choices``; else refuses to start."""
    value = env.str(name, default=default)
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value


_LOG_LEVEL = _choice(
    "DS_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")
)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "durable_project.logs.RequestIdFilter"}},
    "formatters": {
        "text": {"()": "durable_project.logs.TextFormatter"},
        "json": {"()": "durable_project.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": _choice("DS_LOG__FORMAT", "text", ("text", "json")),
            "filters": ["request_id"],
        },
    },
    "loggers": {
        name: {
            "handlers": ["console"],
            "level": _LOG_LEVEL,
            "propagate": False,
        }
        for name in (
            "streams",
            "state",
            "yjs",
            "spark",
            "access",
            "subscriptions",
            "console",
            "tablesync",
            "durable_project",
            "ds",
        )
    }
    # Errors of Django-served URLs (500s of the admin and the REST API), with their traceback.
    | {"django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False}},
}

# --- Durable Streams (names follow the peer server's DS_SECTION__NAME convention) -------------

# Long-poll wait before 204 (PROTOCOL.md 5.7). The conformance suite wants it under 4 s.
DS_LONG_POLL_TIMEOUT_SECS = _float("DS_SERVER__LONG_POLL_TIMEOUT_SECS", default=30.0, least=0)


def _descriptor_share(share: float) -> int:
    """``share`` of this process's descriptor limit (0 when it has none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else int(soft * share)


# Live reads (long-polls waiting, SSE connections) one client may hold per process (429 past
# it), and the process in all (503 past it; by default four fifths of its descriptor limit, so
# live reads cannot take the descriptors every other connection, the pool and files need):
# streams.live_readers. 0: no limit.
DS_LIVE_MAX_PER_CLIENT = _int("DS_LIVE__MAX_PER_CLIENT", default=2000, least=0)
DS_LIVE_MAX_READERS = _int("DS_LIVE__MAX_READERS", default=_descriptor_share(0.8), least=0)
# An idle SSE connection gets a comment this often, so proxies and clients keep it open.
DS_SSE_KEEPALIVE_SECS = _float("DS_SERVER__SSE_KEEPALIVE_SECS", default=15.0, above=0)
# SSE connections end after this long so CDNs can collapse them (PROTOCOL.md 10.2); 0 = never.
DS_SSE_RECONNECT_INTERVAL_SECS = _float(
    "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS", default=60.0, least=0
)
# A connection whose client has not taken what was written to it (its buffer over the
# high-water mark) for this many seconds is cut (aborted, so what it buffered is freed): a
# client that stops reading holds no memory for longer (durable_project.protocol).
DS_SEND_TIMEOUT_SECS = _float("DS_SERVER__SEND_TIMEOUT_SECS", default=30.0, above=0)
# Origins allowed by CORS: "*" or a comma-separated list.
DS_CORS_ORIGINS = env.list("DS_HTTP__CORS_ORIGINS", default=["*"])
# A stream may hold at most this many bytes; an append past it answers 413.
DS_MAX_STREAM_BYTES = _int("DS_LIMITS__MAX_STREAM_BYTES", default=1024**3, least=1)
# A request body may be at most this many bytes; a larger one answers 413 and stores nothing.
DS_MAX_REQUEST_BYTES = _int("DS_LIMITS__MAX_REQUEST_BYTES", default=64 * 1024**2, least=1)
# How many forks deep a chain may go (a fork of a fork of ... ): every read and HEAD of a fork
# walks its chain, so its depth is what each costs (400 past it; ds_max_fork_depth).
DS_MAX_FORK_DEPTH = _int("DS_LIMITS__MAX_FORK_DEPTH", default=100, least=1, most=2**31 - 1)
# A JSON append (or a create's initial body) may hold at most this many messages (413).
DS_MAX_APPEND_MESSAGES = _int("DS_LIMITS__MAX_APPEND_MESSAGES", default=100_000, least=1)
# A request body's next part must arrive within this many seconds (408 otherwise).
DS_BODY_READ_TIMEOUT_SECS = _float("DS_HTTP__BODY_READ_TIMEOUT_SECS", default=30.0, above=0)
# Bytes of request bodies a process holds while they arrive, past which bodies larger than
# 1 MiB are refused (503): a client sending large bodies slowly held them all
# (streams.http.request).
DS_ARRIVING_BODIES_BYTES = _int("DS_HTTP__ARRIVING_BODIES_BYTES", default=512 * 1024**2, least=0)
# A request's head (request line and headers) must be complete this many seconds after it began
# (408 otherwise), and a connection's first request must begin within it (closed otherwise),
# under the production command's protocol (durable_project.protocol).
DS_HEAD_TIMEOUT_SECS = _float("DS_HTTP__HEAD_TIMEOUT_SECS", default=30.0, above=0)
# A catch-up response carries at most about this many bytes (always at least one message).
# What one response holds in memory while it is sent: the messages as read, plus one block of
# them (1 MiB) at a time joined for sending (streams.http.responses).
DS_MAX_READ_BYTES = _int("DS_READ__MAX_CHUNK_BYTES", default=8 * 1024**2, least=1)
# ... and at most this many messages, so a stream of tiny messages is read in bounded steps.
DS_MAX_READ_MESSAGES = _int("DS_READ__MAX_CHUNK_MESSAGES", default=10_000, least=1)
# Past this many bytes of answers a process holds while their clients take them, reads carry at
# most 64 KiB each (streams.held_answers): slow clients cannot make a process hold gigabytes.
DS_READ_HELD_ANSWERS_BYTES = _int("DS_READ__HELD_ANSWERS_BYTES", default=256 * 1024**2, least=0)
# How long a statement waits for a lock (PostgreSQL's lock_timeout) before it fails and its
# request answers 503 with Retry-After: a table or row locked by someone else (a long
# transaction, an operator's LOCK, DDL) otherwise held every request that met it, and its pooled
# connection, for as long as the lock lasted. 0: wait without limit.
DS_DB_LOCK_TIMEOUT_SECS = _float(
    "DS_DB__LOCK_TIMEOUT_SECS", default=15.0, least=0, most=(2**31 - 1) / 1000
)
# The session settings (libpq ``options``) of every connection the server and its commands make,
# the protocol endpoints' pool (streams.store.pool) and Django's alike: how deep forks may go
# (ds_max_fork_depth) and the lock timeout above. Django's connections had neither: a catalog
# read that met a locked table waited for as long as the lock lasted. A command (``migrate``
# included) fails past the lock timeout too, rather than queue every request behind its lock.
DS_DB_LOCK_TIMEOUT_MS = round(DS_DB_LOCK_TIMEOUT_SECS * 1000)
DS_DB_SESSION_OPTIONS = f"-c ds.max_fork_depth={DS_MAX_FORK_DEPTH}" + (
    f" -c lock_timeout={DS_DB_LOCK_TIMEOUT_MS}" if DS_DB_LOCK_TIMEOUT_MS > 0 else ""
)
_django_options = DATABASES["default"]["OPTIONS"]
_django_options["options"] = " ".join(
    option for option in (_django_options.get("options"), DS_DB_SESSION_OPTIONS) if option
)
# Connections in each server process's async pool. Small is fast: appends to one stream queue
# on its row lock anyway (DESIGN.md, storage measurements).
DS_DB_POOL_MIN_SIZE = _int("DS_DB__POOL_MIN_SIZE", default=1, least=0)
DS_DB_POOL_MAX_SIZE = _int("DS_DB__POOL_MAX_SIZE", default=6, least=max(1, DS_DB_POOL_MIN_SIZE))
# Connections of each process reserved for write transactions over 8 MiB, which keep their
# buffers (up to 32 MiB) instead of being replaced after each (streams.store.pool); 0: none,
# such transactions use the pool above and replace their connection.
DS_DB_LARGE_WRITE_CONNECTIONS = _int("DS_DB__LARGE_WRITE_CONNECTIONS", default=2, least=0)
# Write transactions in flight at once per process (streams.store.group_commit): appends that
# arrive while they are busy wait and share the next one. Fewer means larger batches (less CPU
# and fewer commits per append), more means less waiting.
DS_DB_WRITE_TRANSACTIONS = _int("DS_DB__WRITE_TRANSACTIONS", default=1, least=1)
# The LISTEN connection of live delivery: DATABASE_URL unless set (a pooler in transaction mode,
# such as PgBouncer's, cannot LISTEN: point this at the database itself).
DS_LISTEN_DATABASE_URL = env("DS_DB__LISTEN_URL", default="")
# Every this many seconds the LISTEN connection sends itself a notification; when nothing
# comes back for twice as long, it has stalled and is replaced (readers then re-read).
DS_LISTEN_HEARTBEAT_SECS = _float("DS_DB__LISTEN_HEARTBEAT_SECS", default=5.0, above=0)
# Expired streams are deleted on access and by a sweep this often (seconds, per process).
DS_EXPIRY_SWEEP_INTERVAL_SECS = _float(
    "DS_SERVER__EXPIRY_SWEEP_INTERVAL_SECS", default=60.0, least=0
)

# Retention (docs/gaps.md, Retention): the policy of streams that set none of their own
# (Stream-Retention-Max-Age / -Max-Bytes at creation; staff change it in the admin). None by
# default: streams keep everything. Internal streams and registered state streams are exempt.
DS_RETENTION_MAX_AGE_SECS = _int("DS_RETENTION__MAX_AGE_SECS", default=None, least=1)
DS_RETENTION_MAX_BYTES = _int("DS_RETENTION__MAX_BYTES", default=None, least=1)
# How often each server process enforces retention (marks, trims, purges); 0 = never (then
# `manage.py trim_streams` does it). Age retention keeps messages up to this much longer.
DS_RETENTION_SWEEP_INTERVAL_SECS = _float(
    "DS_RETENTION__SWEEP_INTERVAL_SECS", default=60.0, least=0
)
# Trimmed rows are deleted this many (at most) per transaction.
DS_RETENTION_PURGE_BATCH_ROWS = _int("DS_RETENTION__PURGE_BATCH_ROWS", default=5000, least=1)

# State streams left behind (e.g. by a stopped process) are materialized by a sweep this often.
DS_STATE_SWEEP_INTERVAL_SECS = _float("DS_STATE__SWEEP_INTERVAL_SECS", default=5.0, least=0)
# How long the schema check of an append may take (plus a second per MiB of the append) in its
# process (state.checker) before that process is replaced and the append refused (400).
DS_STATE_CHECK_TIMEOUT_SECS = _float("DS_STATE__CHECK_TIMEOUT_SECS", default=2.0, above=0)
if DS_STATE_CHECK_TIMEOUT_SECS <= 0:
    raise ImproperlyConfigured("DS_STATE__CHECK_TIMEOUT_SECS must be more than 0")
# State streams whose registration (compiled schemas) each process keeps for validating appends;
# past it, the least recently used is dropped and read again when next needed.
DS_STATE_CACHED_REGISTRATIONS = _int("DS_STATE__CACHED_REGISTRATIONS", default=256, least=1)
if DS_STATE_CACHED_REGISTRATIONS < 1:
    raise ImproperlyConfigured("DS_STATE__CACHED_REGISTRATIONS must be 1 or more")
# Compaction of state streams registered with it (state/compaction.py): a sweep this often
# (0 = never: `manage.py compact_state` does it) compacts those with this many new events.
DS_STATE_COMPACTION_INTERVAL_SECS = _float(
    "DS_STATE__COMPACTION_INTERVAL_SECS", default=60.0, least=0
)
DS_STATE_COMPACTION_MIN_EVENTS = _int("DS_STATE__COMPACTION_MIN_EVENTS", default=10_000, least=0)
# Deletes are kept this long by compaction (a reader resuming from before a dropped delete gets
# 410), unless a registration says otherwise.
DS_STATE_TOMBSTONE_SECS = _int("DS_STATE__TOMBSTONE_SECS", default=86_400, least=0)

# Table sync (tablesync/): every process checks every sink this often (besides being woken by
# appends), and reloads the lists of sinks and published tables.
DS_TABLESYNC_SWEEP_INTERVAL_SECS = _float("DS_TABLESYNC__SWEEP_INTERVAL_SECS", default=5.0, least=0)
# Messages a sink applies per transaction.
DS_TABLESYNC_SINK_BATCH_MESSAGES = _int("DS_TABLESYNC__SINK_BATCH_MESSAGES", default=2000, least=1)

# --- Access control (access/, PROTOCOL.md 12.1) ---------------------------------------------

# "keys": every request needs an API key, an identity-provider token or a signed URL with a
# grant for what it does; "open": everyone may do everything (development, the conformance
# suite). Open with DEBUG, keys without it, unless set.
DS_AUTH_MODE = env.str("DS_AUTH__MODE", default="open" if DEBUG else "keys")
if DS_AUTH_MODE not in ("keys", "open"):
    raise ImproperlyConfigured("DS_AUTH__MODE must be 'keys' or 'open'")
# Who may keep a historical chunk (PROTOCOL.md 10.1): "public" lets shared caches (a CDN) keep
# it and give it to anyone asking the same URL; "private" only the client's own cache. Private
# unless everyone may read everything (open): in keys mode a CDN would hand one key's reads to
# clients without it (found by a probe). "public" there only behind a cache that keys on the
# credentials (Authorization, the signed query) or checks them itself.
DS_CACHE_SCOPE = env.str(
    "DS_HTTP__CACHE_SCOPE", default="public" if DS_AUTH_MODE == "open" else "private"
)
if DS_CACHE_SCOPE not in ("public", "private"):
    raise ImproperlyConfigured("DS_HTTP__CACHE_SCOPE must be 'public' or 'private'")
# Signs read URLs (access.signing); the secret key when unset.
DS_AUTH_SIGNING_KEY = env.str("DS_AUTH__SIGNING_KEY", default="")
# Signed URLs may be valid for at most this long.
# Sign-ins to the admin (durable_project.middleware.SignInThrottleMiddleware): password checks
# at once per process, and refused sign-ins an address may make within the window (seconds).
DS_AUTH_SIGN_INS_AT_ONCE = _int("DS_AUTH__SIGN_INS_AT_ONCE", default=2, least=1)
DS_AUTH_SIGN_IN_FAILURES = _int("DS_AUTH__SIGN_IN_FAILURES", default=10, least=1)
DS_AUTH_SIGN_IN_WINDOW_SECS = _float("DS_AUTH__SIGN_IN_WINDOW_SECS", default=300.0, least=0)
DS_AUTH_SIGNED_URL_MAX_SECS = _int("DS_AUTH__SIGNED_URL_MAX_SECS", default=7 * 24 * 3600, least=1)
# Keys a process has not cached are looked up one by one, up to this many a second (a token
# bucket); past it, an id not on the process's list of every key id is refused without a
# lookup, and the list is read again for such an id at most every DS_AUTH__UNKNOWN_KEY_SECS,
# which is also how long a process remembers one id as unknown (access.auth).
DS_AUTH_KEY_LOOKUPS_PER_SEC = _float("DS_AUTH__KEY_LOOKUPS_PER_SEC", default=50.0, least=0)
DS_AUTH_UNKNOWN_KEY_SECS = _float("DS_AUTH__UNKNOWN_KEY_SECS", default=1.0, above=0)
# Tokens of an identity provider (JWT): the public keys (a JWKS URL or file), the issuer and
# audience they must carry, the algorithms accepted and the claim holding their grants.
DS_AUTH_JWT_JWKS_URL = env.str("DS_AUTH__JWT_JWKS_URL", default="")
DS_AUTH_JWT_JWKS_FILE = env.str("DS_AUTH__JWT_JWKS_FILE", default="")
if DS_AUTH_JWT_JWKS_FILE and not Path(DS_AUTH_JWT_JWKS_FILE).is_file():
    raise ImproperlyConfigured(f"DS_AUTH__JWT_JWKS_FILE {DS_AUTH_JWT_JWKS_FILE!r} is no file")
DS_AUTH_JWT_ISSUER = env.str("DS_AUTH__JWT_ISSUER", default="")
DS_AUTH_JWT_AUDIENCE = env.str("DS_AUTH__JWT_AUDIENCE", default="")
DS_AUTH_JWT_ALGORITHMS = env.list("DS_AUTH__JWT_ALGORITHMS", default=["RS256", "ES256", "EdDSA"])
DS_AUTH_JWT_GRANTS_CLAIM = env.str("DS_AUTH__JWT_GRANTS_CLAIM", default="ds_grants")

# --- Subscriptions (subscriptions/, PROTOCOL.md 6, 7) ------------------------------------------

# Webhooks to localhost, 127.0.0.0/8 and ::1, over http:// too: for development and tests only.
# Everything else must be https:// to a public address (PROTOCOL.md 12.8).
DS_SUBSCRIPTIONS_ALLOW_LOOPBACK_WEBHOOKS = env.bool(
    "DS_SUBSCRIPTIONS__ALLOW_LOOPBACK_WEBHOOKS", default=False
)
# This server's public URL (https://streams.example.com), from which callback and JWKS URLs
# are built; unset: the scheme and Host of the request that creates the subscription.
DS_SUBSCRIPTIONS_PUBLIC_URL = env.str("DS_SUBSCRIPTIONS__PUBLIC_URL", default="")
# A webhook request must be answered within this long, or it counts as a failed attempt.
DS_SUBSCRIPTIONS_WEBHOOK_TIMEOUT_SECS = _float(
    "DS_SUBSCRIPTIONS__WEBHOOK_TIMEOUT_SECS", default=10.0, above=0
)
# Every process checks this often for expired leases, due retries and wakes a stopped process
# left behind (wakes themselves follow appends at once).
DS_SUBSCRIPTIONS_SWEEP_INTERVAL_SECS = _float(
    "DS_SUBSCRIPTIONS__SWEEP_INTERVAL_SECS", default=1.0, least=0
)
# Links the sweep looks at each time for work a lost notification left behind (a step of a
# round over every subscription): what bounds its work whatever the number of links.
DS_SUBSCRIPTIONS_SWEEP_LINKS = _int("DS_SUBSCRIPTIONS__SWEEP_LINKS", default=20_000, least=1)
# Webhook requests in flight at once per process.
DS_SUBSCRIPTIONS_MAX_CONCURRENT_DELIVERIES = _int(
    "DS_SUBSCRIPTIONS__MAX_CONCURRENT_DELIVERIES", default=256, least=1
)

# --- Observability ---------------------------------------------------------------------------

# Prometheus metrics at /metrics (streams.metrics); reading them needs the "metrics" grant
# (read) in keys mode.
DS_METRICS_ENABLED = env.bool("DS_METRICS__ENABLED", default=True)
# One log line per request (logger "ds.request"); DS_LOG__FORMAT ("text" or "json") is read
# by LOGGING above.
DS_LOG_REQUESTS = env.bool("DS_LOG__REQUESTS", default=True)

# --- Yjs documents (YJS-PROTOCOL.md) -------------------------------------------------------

# Compact a document once this many update bytes accumulated since its last snapshot.
YJS_COMPACTION_THRESHOLD_BYTES = _int("YJS_COMPACTION_THRESHOLD_BYTES", default=1024**2, least=1)
# Awareness streams expire after this long without reads or writes (sliding TTL).
YJS_AWARENESS_TTL_SECS = _int("YJS_AWARENESS_TTL_SECS", default=3600, least=1)
# Documents each process keeps a copy of, to check POSTs against the whole document
# (yjs.replicas); the least recently written beyond this are dropped and rebuilt when written.
YJS_CHECKED_DOCUMENTS = _int("YJS_CHECKED_DOCUMENTS", default=64, least=0)
# pycrdt's work on updates (checking a POST, building a copy of a document, compacting) runs in
# a process of its own (yjs.engine) with this long, plus this per MiB; past it the process
# is killed: a POST is refused (400), a copy or compaction fails (503, or recorded).
YJS_CHECK_TIMEOUT_SECS = _float("YJS_CHECK_TIMEOUT_SECS", default=10.0, above=0)
YJS_CHECK_SECS_PER_MIB = _float("YJS_CHECK_SECS_PER_MIB", default=1.0, least=0)
# A document holding more bytes of updates than this (or about to, with the POSTs being checked)
# is checked in that process: pycrdt's calls on it could hold Python's lock for more than a few
# milliseconds (about 0.1 s a MiB of small map entries, and faster than linearly for some shapes:
# 0.1 s for 32 KiB of concurrent inserts at one place). Smaller ones are checked in the server
# process itself, without the round trip (0.2 ms, half a small POST's time), and move to the
# engine once one call on them is slow (yjs.replicas.INLINE_SLOW_SECS).
YJS_INLINE_DOCUMENT_BYTES = _int("YJS_INLINE_DOCUMENT_BYTES", default=32 * 1024, least=0)
# Optional per-service secrets ("service=secret,other=secret2"): requests to such a service
# need `Authorization: Bearer <secret>` (401 UNAUTHORIZED otherwise).
try:
    YJS_SERVICE_SECRETS = env.dict("YJS_SERVICE_SECRETS", default={})
except ValueError:
    raise ImproperlyConfigured(
        "YJS_SERVICE_SECRETS must read service=secret,other=secret2"
    ) from None

# --- REST API (Django REST framework + drf-spectacular) ------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "streams.rest.Pagination",
    "EXCEPTION_HANDLER": "streams.rest.exception_handler",
    "DEFAULT_PARSER_CLASSES": [
        "streams.rest.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # The same credentials as the stream endpoints (access.rest); views check grants. Sessions
    # are not used: they would also demand CSRF tokens from API clients.
    "DEFAULT_AUTHENTICATION_CLASSES": ["access.rest.BearerAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["access.rest.HasCredentials"],
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Durable Streams: catalog and State Protocol API",
    "DESCRIPTION": (
        "The stream catalog and server-side materialized State Protocol state. The streams "
        "themselves are served at /v1/stream/<path> by the Durable Streams protocol."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The API's documentation is public, whatever the access mode.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    # Swagger UI and its favicon from drf-spectacular-sidecar's static files, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}
