"""Settings for the LMSP service.

Everything an operator changes comes from environment variables; the defaults
give a working single-machine service (SQLite file under ``data/``, Redis on
localhost, models under ``models/``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from lmsp_project import edge_config
from lmsp_project.secret_key import secret_key_load_or_create

BASE_DIR = Path(__file__).resolve().parent.parent
_Parsed = TypeVar("_Parsed")


def _env_parsed(name: str, default: _Parsed, parse: Callable[[str], _Parsed], expected: str) -> _Parsed:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be {expected}, got {raw!r}") from exc


def _env_int(name: str, default: int) -> int:
    return _env_parsed(name, default, int, "an integer")


def _env_int_at_least(name: str, default: int, minimum: int, meaning: str = "") -> int:
    value = _env_int(name, default)
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be an integer >= {minimum}{meaning}, got {value}")
    return value


def _finite_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"not finite: {raw}")
    return value


def _env_float(name: str, default: float) -> float:
    return _env_parsed(name, default, _finite_float, "a finite number")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_path(name: str, default: Path) -> Path:
    raw = os.environ.get(name)
    path = Path(raw) if raw else default
    return path if path.is_absolute() else (BASE_DIR / path)


DEBUG = _env_bool("LMSP_DEBUG", False)

# --- Edge security (docs/security.md) -----------------------------------------
# Signs admin sessions and stream tokens. Unset, a random key is made on the
# first start and kept in LMSP_DATA_DIR/secret-key (mode 0600), which every
# process on that data directory reads; hosts that share no data directory
# set the same LMSP_SECRET_KEY on each.
SECRET_KEY = os.environ.get("LMSP_SECRET_KEY") or os.environ.get("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG and os.environ.get("LMSP_REQUIRE_SECRET_KEY"):
        raise ImproperlyConfigured("LMSP_SECRET_KEY must be set")
    SECRET_KEY = secret_key_load_or_create(_env_path("LMSP_DATA_DIR", BASE_DIR / "data"))
# Host headers answered (any other: 400 invalid_request). Default: the
# address the server is bound to (LMSP_HOST) and the loopback names.
LMSP_HOST = os.environ.get("LMSP_HOST", "127.0.0.1")
ALLOWED_HOSTS = edge_config.env_list("LMSP_ALLOWED_HOSTS") or edge_config.allowed_hosts_default(LMSP_HOST)
# Proxies (addresses or CIDRs) whose X-Forwarded-For is believed: a request
# from one is counted against the right-most hop none of them added. None
# by default: the peer's address is the client's.
LMSP_TRUSTED_PROXIES = edge_config.env_networks("LMSP_TRUSTED_PROXIES")
# Wrong codes tried while a pairing code is pending (each counts against
# every pending code) before that code locks for good.
LMSP_PAIRING_MAX_FAILURES = max(_env_int("LMSP_PAIRING_MAX_FAILURES", 5), 1)
# Browser origins allowed to read the event streams with a stream token
# (CORS, read-only GET .../events only); none by default.
LMSP_CORS_ORIGINS = edge_config.env_origins("LMSP_CORS_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "tasks_app",
    "fixture_models",
]

MIDDLEWARE = [
    # One access line per request, whatever answers it (tasks_app/edge/access_log.py).
    "tasks_app.edge.access_log.AccessLogMiddleware",
    # Under another protocol's routes, every problem below in that protocol's error shape (LMSP_ERROR_SHAPES).
    "tasks_app.edge.error_shapes.ProtocolErrorShapeMiddleware",
    # A foreign Host header is a 400 problem before anything reads the host.
    "tasks_app.edge.hosts.AllowedHostMiddleware",
    # Next, so oversized bodies are refused before anything reads them.
    "tasks_app.edge.middleware.RequestSizeLimitMiddleware",
    # A database that is away, read-only, full or locked past the lock timeout is a 503 (507) problem, not a 500.
    "tasks_app.edge.middleware.DatabaseUnavailableMiddleware",
    # Cross-origin reads of the event streams (LMSP_CORS_ORIGINS), preflights answered here.
    "tasks_app.edge.cors.StreamCorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "lmsp_project.urls"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

WSGI_APPLICATION = "lmsp_project.wsgi.application"
ASGI_APPLICATION = "lmsp_project.asgi.application"

# --- Database -------------------------------------------------------------
DATA_DIR = _env_path("LMSP_DATA_DIR", BASE_DIR / "data")
DEFAULT_SQLITE_PATH = DATA_DIR / "lmsp.sqlite3"
DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{DEFAULT_SQLITE_PATH}"
# The longest any connection waits for a lock (SQLite's write lock, a
# PostgreSQL row lock) before its statement fails and writes nothing: a
# request then answers 503 with Retry-After, a worker retries its commit.
# A process frozen inside a transaction holds its lock until it thaws or
# dies; nobody waits on it longer than this (tasks_app/plumbing/db_locks.py).
# LMSP_SQLITE_BUSY_TIMEOUT_SECONDS is the older name, still read.
LMSP_DB_LOCK_TIMEOUT_SECONDS = float(
    os.environ.get("LMSP_DB_LOCK_TIMEOUT_SECONDS") or os.environ.get("LMSP_SQLITE_BUSY_TIMEOUT_SECONDS") or "5"
)
SQLITE_BUSY_TIMEOUT_SECONDS = LMSP_DB_LOCK_TIMEOUT_SECONDS
# Maintenance (reaper, startup recovery, retention cleanup) waits this long
# for a lock, then leaves the rest for its next round.
LMSP_MAINTENANCE_LOCK_TIMEOUT_SECONDS = float(os.environ.get("LMSP_MAINTENANCE_LOCK_TIMEOUT_SECONDS") or "1")
# Retry-After of a 503 service_unavailable (the lock was not granted in time).
LMSP_DB_BUSY_RETRY_AFTER_SECONDS = _env_int("LMSP_DB_BUSY_RETRY_AFTER_SECONDS", 2)
# Retry-After of the 503 (507 for a full disk) a request gets while the database cannot be reached or
# written (docs/recovery.md). The SDKs retry twice by default after what it says: 5 s covers a server
# restart of up to 10 s.
LMSP_DB_UNAVAILABLE_RETRY_AFTER_SECONDS = _env_int("LMSP_DB_UNAVAILABLE_RETRY_AFTER_SECONDS", 5)
# FULL (the default): a commit is on disk before it returns, so a task whose
# 202 was sent, and every event a client saw, survive a power loss or an OS
# crash. NORMAL (WAL) survives the crash of any process but may roll back the
# last commits on a power loss: an accepted task can vanish, a seen event be
# renumbered with other text. Opt in only where losing that is acceptable
# (docs/scaling.md has the cost of each).
SQLITE_SYNCHRONOUS = os.environ.get("LMSP_SQLITE_SYNCHRONOUS", "FULL").strip().upper()
if SQLITE_SYNCHRONOUS not in {"NORMAL", "FULL"}:
    raise ImproperlyConfigured(f"LMSP_SQLITE_SYNCHRONOUS must be NORMAL or FULL, got {SQLITE_SYNCHRONOUS!r}")

# PostgreSQL only: how fast a silent peer is given up on (see the OPTIONS below). The server ends a
# session whose transaction stays idle this long (a worker frozen or cut off between two statements);
# no transaction of the service is idle for more than milliseconds between its statements.
LMSP_DB_IDLE_IN_TRANSACTION_SECONDS = _env_float("LMSP_DB_IDLE_IN_TRANSACTION_SECONDS", 10.0)
LMSP_DB_CONNECT_TIMEOUT_SECONDS = _env_int("LMSP_DB_CONNECT_TIMEOUT_SECONDS", 5)
LMSP_DB_KEEPALIVE_IDLE_SECONDS = _env_int("LMSP_DB_KEEPALIVE_IDLE_SECONDS", 5)
LMSP_DB_KEEPALIVE_INTERVAL_SECONDS = _env_int("LMSP_DB_KEEPALIVE_INTERVAL_SECONDS", 2)
LMSP_DB_KEEPALIVE_COUNT = _env_int("LMSP_DB_KEEPALIVE_COUNT", 3)
LMSP_DB_TCP_USER_TIMEOUT_SECONDS = _env_float("LMSP_DB_TCP_USER_TIMEOUT_SECONDS", 10.0)

_db = dj_database_url.parse(DATABASE_URL, conn_max_age=_env_int("LMSP_DB_CONN_MAX_AGE", 60))
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # Django's backend, with a process's writers queued on a lock instead of
    # SQLite's sleeping busy handler (tasks_app/db/sqlite3/base.py).
    _db["ENGINE"] = "tasks_app.db.sqlite3"
    sqlite_path = Path(_db["NAME"])
    if str(sqlite_path) != ":memory:":
        sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    _db["OPTIONS"] = {
        # IMMEDIATE takes the write lock at BEGIN, so a read-then-write
        # transaction waits for the lock instead of failing with
        # "database is locked" when it upgrades (see shared/notes).
        "transaction_mode": "IMMEDIATE",
        "timeout": SQLITE_BUSY_TIMEOUT_SECONDS,
        "init_command": (
            "PRAGMA journal_mode=WAL;"
            f"PRAGMA synchronous={SQLITE_SYNCHRONOUS};"
            f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)};"
        ),
    }
    # Tests need a real file (other processes open it), never ":memory:".
    _db["TEST"] = {"NAME": os.environ.get("LMSP_TEST_SQLITE_PATH") or str(DATA_DIR / "test_lmsp.sqlite3")}
    # Health checks only cost time on SQLite; the file does not go away.
    _db["CONN_HEALTH_CHECKS"] = False
else:
    _db["CONN_HEALTH_CHECKS"] = True
    # Row locks are waited on for a bounded time as well (tasks_app/plumbing/db_locks.py); and a client that goes
    # silent (a host cut off, a frozen process) loses its session, and with it every lock it held, within
    # seconds instead of the kernel's keepalive defaults (2 h 11 min): the server ends a transaction left
    # idle for LMSP_DB_IDLE_IN_TRANSACTION_SECONDS and probes or drops a silent connection; the client side
    # gives up on a connect, or on unacknowledged data, as fast (docs/scaling.md).
    _idle_ms = int(LMSP_DB_IDLE_IN_TRANSACTION_SECONDS * 1000)
    _user_timeout_ms = int(LMSP_DB_TCP_USER_TIMEOUT_SECONDS * 1000)
    _db.setdefault("OPTIONS", {})["options"] = " ".join(
        [
            f"-c lock_timeout={int(LMSP_DB_LOCK_TIMEOUT_SECONDS * 1000)}",
            f"-c idle_in_transaction_session_timeout={_idle_ms}",
            f"-c tcp_keepalives_idle={LMSP_DB_KEEPALIVE_IDLE_SECONDS}",
            f"-c tcp_keepalives_interval={LMSP_DB_KEEPALIVE_INTERVAL_SECONDS}",
            f"-c tcp_keepalives_count={LMSP_DB_KEEPALIVE_COUNT}",
            f"-c tcp_user_timeout={_user_timeout_ms}",
        ]
    )
    _db["OPTIONS"] |= {
        "connect_timeout": LMSP_DB_CONNECT_TIMEOUT_SECONDS,
        "keepalives": 1,
        "keepalives_idle": LMSP_DB_KEEPALIVE_IDLE_SECONDS,
        "keepalives_interval": LMSP_DB_KEEPALIVE_INTERVAL_SECONDS,
        "keepalives_count": LMSP_DB_KEEPALIVE_COUNT,
        "tcp_user_timeout": _user_timeout_ms,
    }
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Internationalisation ---------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

# --- REST framework -------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["tasks_app.edge.auth.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["tasks_app.edge.auth.HasRequiredScopes"],
    "DEFAULT_PARSER_CLASSES": ["tasks_app.edge.parsers.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "tasks_app.edge.negotiation.JSONOnlyNegotiation",
    "EXCEPTION_HANDLER": "tasks_app.edge.problems.exception_handler",
    # No OPTIONS self-description: the OpenAPI schema documents the API.
    "DEFAULT_METADATA_CLASS": None,
    "UNAUTHENTICATED_USER": None,
    "UNAUTHENTICATED_TOKEN": None,
    "DEFAULT_THROTTLE_RATES": {"pair": os.environ.get("LMSP_PAIR_RATE", "10/min")},
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# --- OpenAPI schema (drf-spectacular): /lmsp/v1/openapi.json, /lmsp/v1/docs --
SPECTACULAR_SETTINGS = {
    "TITLE": "LMSP service",
    "VERSION": "1.0",
    # 3.1: a nullable object is "oneOf: [ref, null]"; 3.0's "nullable" beside "allOf"
    # is ambiguous, and JSON Schema validators reject null there.
    "OAS_VERSION": "3.1.0",
    # Adds the async stream views (not DRF views) and keeps only /lmsp/v1.
    "DEFAULT_GENERATOR_CLASS": "tasks_app.api.schema_generator.LmspSchemaGenerator",
    # Security per operation, and every problem each operation answers (tasks_app/api/schema_generator.py).
    # Without spectacular's enum hook enums stay inline: several unrelated fields are named "status".
    "POSTPROCESSING_HOOKS": ["tasks_app.api.schema_generator.lmsp_postprocess"],
    "ENUM_GENERATE_CHOICE_DESCRIPTION": False,
    "SCHEMA_PATH_PREFIX": "/lmsp/v1",
    # The schema and its docs page are public: no authentication is even attempted.
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_AUTHENTICATION": [],
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    # Swagger UI's files come from the drf-spectacular-sidecar package, so the
    # docs page works on a machine with no internet access.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "displayOperationId": True, "defaultModelsExpandDepth": 0},
}

# --- LMSP -----------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LMSP_MODELS_DIR = _env_path("LMSP_MODELS_DIR", BASE_DIR / "models")
LMSP_EVENT_RETENTION_SECONDS = _env_int("LMSP_EVENT_RETENTION_SECONDS", 7 * 24 * 3600)
LMSP_TASK_RETENTION_SECONDS = _env_int("LMSP_TASK_RETENTION_SECONDS", 30 * 24 * 3600)
# A conversation unchanged this long is deleted with its items; 0 (the default) keeps it until its client
# deletes it, as OpenAI keeps conversations (docs/conversations.md).
LMSP_CONVERSATION_RETENTION_SECONDS = _env_int("LMSP_CONVERSATION_RETENTION_SECONDS", 0)
LMSP_IDEMPOTENCY_TTL_SECONDS = _env_int("LMSP_IDEMPOTENCY_TTL_SECONDS", 24 * 3600)
LMSP_PAIRING_CODE_TTL_SECONDS = _env_int("LMSP_PAIRING_CODE_TTL_SECONDS", 600)
# Retention cleanup (lmsp_cleanup, and Celery beat this often): rows are
# deleted in batches of this size, one short transaction each, so the writer
# lock (SQLite) is never held for long.
LMSP_CLEANUP_INTERVAL_SECONDS = _env_int("LMSP_CLEANUP_INTERVAL_SECONDS", 3600)
LMSP_CLEANUP_BATCH_SIZE = _env_int("LMSP_CLEANUP_BATCH_SIZE", 500)
# Largest request body accepted on the API, in bytes; larger -> 413.
LMSP_MAX_REQUEST_BYTES = _env_int("LMSP_MAX_REQUEST_BYTES", 1024 * 1024)
# Files and batches (docs/batches.md). Files are kept on disk here, never in the database; with more
# than one web process this directory must be the same for all of them.
LMSP_FILES_DIR = _env_path("LMSP_FILES_DIR", DATA_DIR / "files")
# Largest file accepted by POST /files, in bytes (OpenAI's limit for a batch's input); larger -> 413.
LMSP_MAX_FILE_BYTES = _env_int("LMSP_MAX_FILE_BYTES", 200 * 1024 * 1024)
# Files (uploads and batches' output and error files) older than this are deleted with their bytes, never
# the input of a batch that has not ended. 0 (the default): kept until deleted, as OpenAI keeps uploads.
LMSP_FILE_RETENTION_SECONDS = _env_int("LMSP_FILE_RETENTION_SECONDS", 0)
# Most lines one batch's input file may hold (OpenAI's limit).
LMSP_BATCH_MAX_LINES = _env_int("LMSP_BATCH_MAX_LINES", 50_000)
# Batch lines that may be tasks at once, across all batches (docs/decisions/0017-batches.md). 0 (the
# default): the rows of the online workers (their reports) less one each, left for interactive requests, and
# less the tasks already queued or running; 8 while no worker reports itself. A number: that many, fixed.
LMSP_BATCH_ACTIVE_LINES = _env_int_at_least("LMSP_BATCH_ACTIVE_LINES", 0, 0)
# How often each web process's batch keeper looks at the unfinished batches (feeds lines, writes results).
LMSP_BATCH_POLL_SECONDS = _env_float("LMSP_BATCH_POLL_SECONDS", 0.5)
# Tasks allowed to wait in `queued` at once; more -> 429 queue_full.
LMSP_MAX_QUEUED_TASKS = _env_int("LMSP_MAX_QUEUED_TASKS", 10_000)
# The routes whose errors another protocol's clients read, and the adapter function that shapes them
# (tasks_app/edge/error_shapes.py): the problem object in, that protocol's status and body out.
LMSP_ERROR_SHAPES = {
    "/lmsp/v1/messages": "tasks_app.anthropic.errors.anthropic_error",
    "/api/": "tasks_app.ollama.errors.ollama_error",
}
# Ollama's clients often cannot send a token (docs/ollama.md): the name of a client whose scopes a request to
# /api/... from a loopback address without an Authorization header gets. Empty (the default): a token is needed.
LMSP_OLLAMA_ANONYMOUS = os.environ.get("LMSP_OLLAMA_ANONYMOUS", "").strip()
LMSP_QUEUE_FULL_RETRY_AFTER_SECONDS = _env_int("LMSP_QUEUE_FULL_RETRY_AFTER_SECONDS", 5)
# The last-used time of a client is written at most this often, so that
# authenticated reads do not each cost a write on SQLite.
LMSP_CLIENT_LAST_USED_RESOLUTION_SECONDS = _env_int("LMSP_CLIENT_LAST_USED_RESOLUTION_SECONDS", 60)

# Prefix of every Redis key, queue and channel this installation uses, so two
# installations (or a test run) can share one Redis server.
LMSP_REDIS_PREFIX = os.environ.get("LMSP_REDIS_PREFIX", "lmsp")
# The Celery queue that carries task ids to workers.
LMSP_TASK_QUEUE = os.environ.get("LMSP_TASK_QUEUE", LMSP_REDIS_PREFIX)
# The queue of the periodic jobs (sweeper, reaper, cleanup), consumed by the
# beat node, so that they never wait behind an hour-long generation.
LMSP_MAINTENANCE_QUEUE = os.environ.get("LMSP_MAINTENANCE_QUEUE", f"{LMSP_TASK_QUEUE}-maintenance")

# --- Workers ----------------------------------------------------------------
# Inference device: auto (CUDA when it really loads, else CPU), cpu or cuda.
LMSP_DEVICE = os.environ.get("LMSP_DEVICE", "auto")
LMSP_DEVICE_ID = _env_int("LMSP_DEVICE_ID", 0)
if LMSP_DEVICE not in {"auto", "cpu", "cuda"}:
    raise ImproperlyConfigured(f"LMSP_DEVICE must be auto, cpu or cuda, got {LMSP_DEVICE!r}")
# Deltas are committed in batches: whichever comes first, this many tokens or
# this much time since the batch's first token.
LMSP_DELTA_BATCH_TOKENS = _env_int("LMSP_DELTA_BATCH_TOKENS", 16)
# A run waits this long for its first token before it commits its start: a short prompt's first token
# comes within it, and the start and the first delta are then one commit (docs/workers.md). 0: never.
LMSP_START_FOLD_MS = _env_float("LMSP_START_FOLD_MS", 25.0)
if LMSP_START_FOLD_MS < 0:
    raise ImproperlyConfigured(f"LMSP_START_FOLD_MS must be >= 0, got {LMSP_START_FOLD_MS}")
LMSP_DELTA_BATCH_MS = _env_int("LMSP_DELTA_BATCH_MS", 50)
# A worker holding a task writes its heartbeat at least this often.
LMSP_HEARTBEAT_SECONDS = _env_int("LMSP_HEARTBEAT_SECONDS", 10)
# The reaper (Celery beat, every LMSP_REAP_INTERVAL_SECONDS) treats a held
# task whose heartbeat is older than this as abandoned by a dead worker and
# applies its on_restart policy. Keep it several heartbeats long.
LMSP_HEARTBEAT_TIMEOUT_SECONDS = _env_int("LMSP_HEARTBEAT_TIMEOUT_SECONDS", 60)
LMSP_REAP_INTERVAL_SECONDS = _env_int("LMSP_REAP_INTERVAL_SECONDS", 15)
# The admin calls a held task's worker silent when its heartbeat is older than this (it writes one at
# least every LMSP_HEARTBEAT_SECONDS): an operator sees a frozen worker long before the reaper acts.
LMSP_HEARTBEAT_SILENT_SECONDS = _env_int("LMSP_HEARTBEAT_SILENT_SECONDS", 2 * LMSP_HEARTBEAT_SECONDS)
# Every worker node reports itself (process, version, models and devices, rows, tokens/s) this often,
# for the admin's workers page; a node whose report is older than LMSP_WORKER_SILENT_SECONDS is silent
# (0: the node does not report itself, and the page does not list it).
LMSP_WORKER_REPORT_SECONDS = _env_float("LMSP_WORKER_REPORT_SECONDS", 5.0)
LMSP_WORKER_SILENT_SECONDS = _env_float("LMSP_WORKER_SILENT_SECONDS", 3 * LMSP_WORKER_REPORT_SECONDS)
# A node that has not reported for this long (stopped, or gone) leaves the workers page (retention).
LMSP_WORKER_NODE_RETENTION_SECONDS = _env_int("LMSP_WORKER_NODE_RETENTION_SECONDS", 7 * 24 * 3600)
# A task that has been started this many times and is found unfinished again
# (a prompt that kills its worker, say) fails instead of being retried.
LMSP_MAX_ATTEMPTS = _env_int("LMSP_MAX_ATTEMPTS", 3)
# lmsp_recover asks the live workers of this installation which tasks they
# run, and waits this long for their replies.
LMSP_RECOVER_INSPECT_SECONDS = float(os.environ.get("LMSP_RECOVER_INSPECT_SECONDS", "1.0"))
# Recovery sends the tasks it runs again (oldest first) for at most this
# long, so a large backlog does not hold up the start; the sweeper sends the
# rest (about 2,000 a second; each is already durable and queued).
LMSP_RECOVER_DISPATCH_SECONDS = float(os.environ.get("LMSP_RECOVER_DISPATCH_SECONDS", "2.0"))
# Models kept loaded per worker process (least recently used goes first).
LMSP_WORKER_MAX_MODELS = _env_int("LMSP_WORKER_MAX_MODELS", 2)
# Each worker process runs its models in an engine process of its own (docs/workers.md). One that says
# nothing for this long (it speaks twice a second) is taken for frozen and killed; its rows are handed
# back by their on_restart policy. The first word may take longer: the process starts and imports.
LMSP_ENGINE_SILENCE_SECONDS = _env_float("LMSP_ENGINE_SILENCE_SECONDS", 10.0)
LMSP_ENGINE_START_SECONDS = _env_float("LMSP_ENGINE_START_SECONDS", 60.0)
if LMSP_ENGINE_SILENCE_SECONDS <= 0 or LMSP_ENGINE_START_SECONDS <= 0:
    raise ImproperlyConfigured("LMSP_ENGINE_SILENCE_SECONDS and LMSP_ENGINE_START_SECONDS must be > 0")
# A model's tool-call family where its template does not say it (docs/tools.md): "name=family,..."
# (a name without a tag covers all its tags), e.g. "my-llama=llama3_json".
LMSP_TOOL_FORMATS = dict(
    (name.strip(), family.strip())
    for name, _, family in (pair.partition("=") for pair in os.environ.get("LMSP_TOOL_FORMATS", "").split(","))
    if name.strip() and family.strip()
)
# ONNX Runtime intra-op threads per worker process (0: ONNX Runtime's default,
# one per core; set it when several CPU workers share a machine).
LMSP_INTRA_OP_THREADS = _env_int("LMSP_INTRA_OP_THREADS", 0)
# ONNX Runtime's intra-op threads busy-wait between steps unless this is set;
# worth it only on a host that does nothing but generate.
LMSP_ORT_SPINNING = _env_bool("LMSP_ORT_SPINNING", False)
# Prompt tokens fed to the model per prefill call.
LMSP_PREFILL_CHUNK = _env_int("LMSP_PREFILL_CHUNK", 512)
# A long prompt beside decoding rows is prefilled in slices between their steps, each slice this
# many decode steps' time (docs/workers.md): the rows' gaps grow to about (1 + share) steps, the
# prompt's time to its first token to about (1 + share) / share of its prefill alone.
LMSP_PREFILL_SHARE = _env_float("LMSP_PREFILL_SHARE", 3.0)
if not 0 < LMSP_PREFILL_SHARE <= 100:
    raise ImproperlyConfigured(f"LMSP_PREFILL_SHARE must be in (0, 100], got {LMSP_PREFILL_SHARE}")
# Generations one worker process runs at once, stepped together in one batch
# on its device (docs/workers.md), so that a GPU never idles while tasks wait
# in line behind one generation; 1 runs one at a time. 0 (the default): as
# many as the engines' KV cache budgets hold (a task is claimed only while no
# engine holds a row back for its budget), at most 256. Rows cost no thread:
# the task threads (the Procfile's LMSP_WORKER_THREADS) only start them.
LMSP_MAX_BATCH = _env_int_at_least("LMSP_MAX_BATCH", 0, 0, " (0: automatic, from the KV cache budget)")
# KV cache bytes one engine may hold for its rows: a task whose cache would
# not fit waits, in order, instead of the device running out of memory in
# the middle of a step that every row shares. 0: automatic, from the share below.
LMSP_KV_CACHE_BYTES = _env_int_at_least("LMSP_KV_CACHE_BYTES", 0, 0, " (0: automatic)")
# The automatic budget: this share of the device memory free once the model
# is loaded (CUDA), or of physical memory (CPU). The rest is for ONNX
# Runtime's activations and for whatever else shares the device.
LMSP_KV_CACHE_SHARE = _env_float("LMSP_KV_CACHE_SHARE", 0.5)
if not 0 < LMSP_KV_CACHE_SHARE <= 1:
    raise ImproperlyConfigured(f"LMSP_KV_CACHE_SHARE must be in (0, 1], got {LMSP_KV_CACHE_SHARE}")
# Keep the KV of prompts (and answers) in what the KV budget leaves free, so a later request that starts
# with the same tokens skips their model calls (docs/workers.md, "The prefix cache"); a hit changes no
# token. Off: every prompt is prefilled whole.
LMSP_PREFIX_CACHE = _env_bool("LMSP_PREFIX_CACHE", True)
# Send a response that continues another (previous_response_id) to the worker node that ran the one
# before it, while that node is alive and has room: its prefix cache holds the conversation
# (tasks_app.plumbing.affinity). Off: every task goes to the shared queue. Read by the web process.
LMSP_AFFINITY = _env_bool("LMSP_AFFINITY", True)
# Threads that sample one decode step's rows side by side (docs/workers.md):
# at a real vocabulary (150k logits) a sampled row costs ~0.3 ms of NumPy work
# that runs without the GIL. 0: automatic, half the cores, at least 2 and at most 8.
LMSP_SAMPLING_THREADS = _env_int_at_least("LMSP_SAMPLING_THREADS", 0, 0, " (0: automatic)")
# On SIGTERM the running rows may go on generating this long, so that short
# tasks finish instead of restarting; then each is handed back by its
# on_restart policy. 0 (the default) hands back at once, which fits honcho's
# 5 s before it kills; in compose, keep stop_grace_period above this plus the
# hand-back commits (docker-compose.yml).
LMSP_DRAIN_SECONDS = _env_float("LMSP_DRAIN_SECONDS", 0.0)
if LMSP_DRAIN_SECONDS < 0:
    raise ImproperlyConfigured(f"LMSP_DRAIN_SECONDS must be >= 0, got {LMSP_DRAIN_SECONDS}")
# ONNX Runtime's CUDA arena grows until the device is full and never gives
# memory back; a limit (gpu_mem_limit) keeps one worker from starving
# another process on the same GPU. 0: no limit.
LMSP_GPU_MEM_LIMIT_BYTES = _env_int_at_least("LMSP_GPU_MEM_LIMIT_BYTES", 0, 0, " (0: no limit)")
# The sweeper (Celery beat) re-dispatches queued tasks whose message is not
# known to be in the broker, this often, once they are this old.
LMSP_SWEEP_INTERVAL_SECONDS = _env_int("LMSP_SWEEP_INTERVAL_SECONDS", 10)
LMSP_SWEEP_GRACE_SECONDS = _env_int("LMSP_SWEEP_GRACE_SECONDS", 5)
# One sweep sends for at most this long (a backlog left by a large recovery
# drains over a few rounds), so the maintenance node's other jobs still run.
LMSP_SWEEP_BUDGET_SECONDS = float(os.environ.get("LMSP_SWEEP_BUDGET_SECONDS", "4.0"))
# How long a dispatch marker vouches for a message in the broker; after that
# a still-queued task is dispatched again (a duplicate is dropped by the claim).
LMSP_DISPATCH_MARKER_TTL_SECONDS = _env_int("LMSP_DISPATCH_MARKER_TTL_SECONDS", 3600)

# Event streams (SSE). Idle streams get a ": keepalive" comment this often.
LMSP_STREAM_KEEPALIVE_SECONDS = _env_int("LMSP_STREAM_KEEPALIVE_SECONDS", 15)
# With the Redis subscription up, a stream (or a waiting POST /responses)
# still reads the database this often, in case a wake-up was lost.
LMSP_STREAM_SAFETY_POLL_SECONDS = _env_int("LMSP_STREAM_SAFETY_POLL_SECONDS", 5)
# While the subscription is down, streams poll the database this often.
LMSP_STREAM_FALLBACK_POLL_MS = _env_int("LMSP_STREAM_FALLBACK_POLL_MS", 500)
# Events per database read, and events kept per followed task for its streams.
LMSP_STREAM_PAGE_EVENTS = _env_int("LMSP_STREAM_PAGE_EVENTS", 500)
LMSP_STREAM_FEED_WINDOW = _env_int("LMSP_STREAM_FEED_WINDOW", 2048)
# Threads (each with its own database connection) for the reads of streams.
LMSP_STREAM_DB_THREADS = _env_int("LMSP_STREAM_DB_THREADS", 4)
# Lifetime of a browser's read-only stream token (?token=).
LMSP_STREAM_TOKEN_SECONDS = _env_int("LMSP_STREAM_TOKEN_SECONDS", 300)
# POST /responses/{id}/cancel of a running response waits up to this long for
# the worker to finish the move, so the answer is the cancelled response.
LMSP_RESPONSE_CANCEL_WAIT_SECONDS = float(os.environ.get("LMSP_RESPONSE_CANCEL_WAIT_SECONDS", "5"))

# --- Webhooks (docs/webhooks.md) ---------------------------------------------
# The deliverer (`manage.py lmsp_webhooks`, the Procfile's `webhooks`) is woken
# over Redis by each commit that makes a delivery due, and besides reads the
# outbox this often (one indexed query when nothing is due): retries whose
# backoff ended, and everything while Redis is away.
LMSP_WEBHOOK_POLL_SECONDS = _env_float("LMSP_WEBHOOK_POLL_SECONDS", 1.0)
# One attempt's socket timeout (connect, send, each read of the answer); an
# attempt ends after 3 x this in all, however slowly its receiver answers.
LMSP_WEBHOOK_TIMEOUT_SECONDS = _env_float("LMSP_WEBHOOK_TIMEOUT_SECONDS", 10.0)
# A failed attempt is retried after BASE * 2^(attempts-1) seconds, capped at
# MAX, each shortened by up to a quarter at random (jitter), until
# MAX_AGE_SECONDS after the event: then the delivery is given up (failed).
LMSP_WEBHOOK_BACKOFF_BASE_SECONDS = _env_float("LMSP_WEBHOOK_BACKOFF_BASE_SECONDS", 5.0)
LMSP_WEBHOOK_BACKOFF_MAX_SECONDS = _env_float("LMSP_WEBHOOK_BACKOFF_MAX_SECONDS", 3600.0)
LMSP_WEBHOOK_MAX_AGE_SECONDS = _env_float("LMSP_WEBHOOK_MAX_AGE_SECONDS", 72 * 3600.0)
# Delivered and given-up deliveries are kept this long after their last attempt (retention cleanup).
LMSP_WEBHOOK_RETENTION_SECONDS = _env_int("LMSP_WEBHOOK_RETENTION_SECONDS", 7 * 24 * 3600)
# Deliveries one deliverer sends at once (one thread each), so that a slow
# receiver holds up only its own.
LMSP_WEBHOOK_CONCURRENCY = _env_int_at_least("LMSP_WEBHOOK_CONCURRENCY", 8, 1)
# How long a claimed delivery is a deliverer's own; a deliverer that died
# with it leaves it to another after this. Longer than an attempt can take
# (3 x LMSP_WEBHOOK_TIMEOUT_SECONDS).
LMSP_WEBHOOK_LEASE_SECONDS = _env_float("LMSP_WEBHOOK_LEASE_SECONDS", 60.0)
if LMSP_WEBHOOK_LEASE_SECONDS <= 3 * LMSP_WEBHOOK_TIMEOUT_SECONDS:
    raise ImproperlyConfigured("LMSP_WEBHOOK_LEASE_SECONDS must be more than 3 x LMSP_WEBHOOK_TIMEOUT_SECONDS")
# Targets on private, loopback, link-local, multicast, reserved or
# unspecified addresses are refused (at registration and at every attempt)
# unless this is set: a webhook must not reach into the service's own network.
LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = _env_bool("LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS", False)

# --- Web serving (lmsp_project/asgi.py, docs/http.md) -------------------------
# Threads of a web process that run the sync views (REST, admin, docs) through
# Django's WSGI handler, each keeping its own database connection (on
# PostgreSQL: up to this many connections per web process, plus the streams').
# 0: every request through Django's ASGI handler, a new connection per request.
LMSP_WEB_THREADS = _env_int("LMSP_WEB_THREADS", 8)

# --- Limits of the HTTP server and of open event streams (docs/http.md) ------
# Open event streams per client (its bearer token and its stream tokens
# together; a staff session counts on its own) and per web process; one more
# is refused with 429 too_many_streams and Retry-After. Counted in each web
# process. An open stream costs a connection and ~40 KB: 500 is ~20 MB and
# half of LMSP_HTTP_MAX_CONNECTIONS, so streams never crowd out the API.
LMSP_MAX_STREAMS_PER_CLIENT = _env_int("LMSP_MAX_STREAMS_PER_CLIENT", 32)
LMSP_MAX_STREAMS_PER_PROCESS = _env_int("LMSP_MAX_STREAMS_PER_PROCESS", 500)
LMSP_STREAM_LIMIT_RETRY_AFTER_SECONDS = _env_int("LMSP_STREAM_LIMIT_RETRY_AFTER_SECONDS", 5)
# Read by the HTTP protocol of uvicorn (lmsp_project.http_server): a request
# head (request line and headers) longer than this is answered 431; a head
# not complete this long after the connection opened (or after its first
# byte, on a kept-alive connection), or a body not complete this long after
# its head, closes the connection; an idle kept-alive connection is closed
# after LMSP_HTTP_KEEPALIVE_SECONDS; a connection beyond
# LMSP_HTTP_MAX_CONNECTIONS gets 503 at once. Responses (streams) are never timed.
LMSP_HTTP_MAX_HEADER_BYTES = _env_int("LMSP_HTTP_MAX_HEADER_BYTES", 64 * 1024)
LMSP_HTTP_HEAD_TIMEOUT_SECONDS = float(os.environ.get("LMSP_HTTP_HEAD_TIMEOUT_SECONDS") or "10")
LMSP_HTTP_BODY_TIMEOUT_SECONDS = float(os.environ.get("LMSP_HTTP_BODY_TIMEOUT_SECONDS") or "30")
LMSP_HTTP_KEEPALIVE_SECONDS = float(os.environ.get("LMSP_HTTP_KEEPALIVE_SECONDS") or "5")
LMSP_HTTP_MAX_CONNECTIONS = _env_int("LMSP_HTTP_MAX_CONNECTIONS", 1000)

# --- Metrics (GET /metrics, Prometheus text format) ------------------------
# Not behind bearer auth; with this set, only loopback clients get them.
LMSP_METRICS_LOCAL_ONLY = _env_bool("LMSP_METRICS_LOCAL_ONLY", False)
# Workers report their histograms to Redis; a node that has not reported for
# this long (gone, or renamed) drops out of /metrics and its keys expire.
LMSP_METRICS_WORKER_TTL_SECONDS = _env_int("LMSP_METRICS_WORKER_TTL_SECONDS", 24 * 3600)

# --- Celery (read by lmsp_project.celery with the CELERY_ namespace) --------
# docs/workers.md explains every choice; the short form: the database decides
# what runs, so a message is only a hint that a task id may be claimable.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # A generation may run for hours; an unacked message comes back only
    # after this, and is then dropped by the claim (the task is not queued).
    "visibility_timeout": _env_int("LMSP_BROKER_VISIBILITY_TIMEOUT_SECONDS", 12 * 3600),
    "socket_connect_timeout": 2,
}
CELERY_TASK_DEFAULT_QUEUE = LMSP_TASK_QUEUE
# Broadcasts (the recovery's inspect) go to this installation's workers only: two
# installations on one Redis may both run a "worker@host", and the replies are
# keyed by node name, so one's answer would hide the other's.
CELERY_CONTROL_EXCHANGE = LMSP_REDIS_PREFIX
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = False
CELERY_TASK_ACKS_ON_FAILURE_OR_TIMEOUT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DISABLE_PREFETCH = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_SEND_TASK_EVENTS = False
# A generation survives a broker blip (Celery 6 would cancel it by default);
# the claim, not the broker, decides whether a task runs again.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# Django's own body limit (admin forms); the API limit is enforced above.
DATA_UPLOAD_MAX_MEMORY_SIZE = LMSP_MAX_REQUEST_BYTES

# --- Logging -----------------------------------------------------------------
# One line per request on lmsp.access (tasks_app/edge/access_log.py; uvicorn's own
# access log is off), so django.request's warning per 4xx would say it twice:
# it keeps its errors (5xx, with their tracebacks). Celery's routine lines
# about the maintenance jobs (sent, received, succeeded, three per round) show
# only at LMSP_LOG_LEVEL=DEBUG; the jobs log themselves when they did
# something (workers/log_filters.py).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"quiet_maintenance": {"()": "workers.log_filters.MaintenanceChatterFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LMSP_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "django.request": {"level": "ERROR"},
        # huggingface_hub's HTTP client logs every request at INFO; `lmsp_models pull` shows a progress bar.
        "httpx2": {"level": "WARNING"},
        "celery.beat": {"filters": ["quiet_maintenance"]},
        "celery.worker.strategy": {"filters": ["quiet_maintenance"]},
        "celery.app.trace": {"filters": ["quiet_maintenance"]},
    },
}
