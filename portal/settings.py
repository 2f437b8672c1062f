"""Django settings for Trainyard, read from the environment (see docs/configuration.md, "Configuration")."""
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url

from portal import env, fanout, hosts

BASE_DIR = Path(__file__).resolve().parent.parent
# Everything Trainyard writes on this machine (SQLite file, stored jobs, runtime files) lives here.
DATA_DIR = Path(env.text("TRAINYARD_DATA_DIR", str(BASE_DIR / "var"))).resolve()

DEBUG = env.boolean("TRAINYARD_DEBUG", False)
SECRET_KEY = env.text("TRAINYARD_SECRET_KEY") or env.text("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    # Where processes share no data directory (Kubernetes pods), each would generate its own key, so
    # an operator there requires an explicit one; DEBUG does not relax that.
    if env.boolean("TRAINYARD_REQUIRE_SECRET_KEY", False):
        raise env.ConfigError("TRAINYARD_SECRET_KEY must be set (TRAINYARD_REQUIRE_SECRET_KEY is on)")
    from portal import secret_key
    # Generated once, mode 0600, shared by every process that uses this TRAINYARD_DATA_DIR.
    SECRET_KEY = secret_key.load_or_create(DATA_DIR)
# Keys rotated out, separated by spaces: sessions they signed and secrets they sealed (jobs.transfers.
# sealing_keys) still open; everything new uses SECRET_KEY.
SECRET_KEY_FALLBACKS = (env.text("TRAINYARD_SECRET_KEY_FALLBACKS") or "").split()

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served locally: the docs work offline
    "channels",
    "guardian",
    "axes",  # failed-login lockouts (tenants.throttling; AXES_* below)
    "django_prometheus",
    "tenants",
    "jobs",
    "notifications",
    "portal",
]

MIDDLEWARE = [
    # First and last: django-prometheus times whole requests (/metrics, docs/operating.md, "Operating Trainyard").
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "jobs.bounds.NulRefusalMiddleware",  # before anything reads the path or the query into a query
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "tenants.sso.SsoRecheckMiddleware",  # memberships follow the identity provider during a session
    "tenants.audit.AuditActorMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.csp.ContentSecurityPolicyMiddleware",
    "axes.middleware.AxesMiddleware",  # a locked-out sign-in's answer (tenants.sso.lockout_response)
    "portal.statement_timeout.StatementTimeoutMiddleware",  # a cancelled statement is a 503, not a 500
    "jobs.prometheus.RequestMetricsMiddleware",  # django-prometheus's, its labels bounded
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
        "tenants.context.pending_invitations",
    ]},
}]

# --- database: SQLite on a fresh machine, PostgreSQL through DATABASE_URL ---------------------
DATABASE_URL = env.url("DATABASE_URL", f"sqlite:///{DATA_DIR / 'trainyard.sqlite3'}",
                       schemes=("sqlite", "postgres", "postgresql", "pgsql"))
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A fresh checkout has no var/ yet; SQLite creates the file but not its folder.
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # The web server, the worker and beat write concurrently: WAL lets readers proceed and
    # IMMEDIATE transactions make writers queue on the lock instead of failing mid-transaction.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file, not a server: a connection is kept for the life of the thread that opened it, so a
    # worker task or a request does not open (and set up) one of its own.
    DATABASES["default"]["CONN_MAX_AGE"] = None
    # Celery's Django fix-up closes every connection before and after each task unless told to
    # reuse them: on SQLite that is a new connection and its PRAGMAs per task, and each open waits
    # on the writers, a large share of a busy worker's time.
    CELERY_DB_REUSE_MAX = 500
# On PostgreSQL a connection per request (CONN_MAX_AGE 0): the ASGI server runs each request in a
# thread of its own, where a kept connection would outlive its thread (the ingest threads, which live
# as long as the process, keep theirs: portal.overrides.ingest). Opening one is cheap when
# DATABASE_URL names a PgBouncer in front of the server (deploy/pgbouncer, docs/operating.md).
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: broker for Celery and the channel layer for websockets ----------------------------
# Unset means the embedded server that `make demo` (portal.runner) starts on this port: the one a
# running demo of this data directory wrote down (EMBEDDED_REDIS_PORT_FILE), so a `manage.py` command
# beside it reaches its Redis, else 6390.
EMBEDDED_REDIS_PORT_FILE = DATA_DIR / "embedded-redis.port"
EMBEDDED_REDIS_PORT = env.integer("TRAINYARD_EMBEDDED_REDIS_PORT", env.port_file(EMBEDDED_REDIS_PORT_FILE, 6390),
                                  minimum=1)
REDIS_URL = env.url("REDIS_URL", f"redis://127.0.0.1:{EMBEDDED_REDIS_PORT}/0",
                    schemes=("redis", "rediss", "unix"))

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
# A task is acknowledged only after it ran, so a worker killed mid-task leaves it to be redone;
# every task is idempotent for that reason.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 600}
# Webhook deliveries wait on other people's servers, so they have a queue of their own, served by a
# worker of their own (portal.runner's `webhooks`; every deployment runs one): a receiver that
# answers slowly holds one of that worker's processes, never the lifecycle worker's.
WEBHOOK_QUEUE = "webhooks"
CELERY_TASK_ROUTES = {"jobs.tasks.deliver_webhook": {"queue": WEBHOOK_QUEUE}}
RECONCILE_INTERVAL_S = env.number("TRAINYARD_RECONCILE_INTERVAL", 10.0, minimum=0.5)
# The scheduling loop (jobs.scheduler_loop, `manage.py run_scheduler`): woken through Redis, it
# starts a cycle no sooner than MIN_INTERVAL after the last one ended (and at least as long as that
# one took), and runs one at least every MAX_INTERVAL without a wake, so a lost wake stalls nothing.
SCHEDULER_MIN_INTERVAL_S = env.number("TRAINYARD_SCHEDULER_MIN_INTERVAL", 0.05, minimum=0.0)
SCHEDULER_MAX_INTERVAL_S = env.number("TRAINYARD_SCHEDULER_MAX_INTERVAL", 5.0, minimum=0.5)
# Experiments (jobs.experiments): the seconds each scheduling cycle gives the passes over them all (past
# it, the ones not reached go first next cycle), and the experiments not finished one tenant may have
# (each costs every cycle a pass).
EXPERIMENTS_PASS_SECONDS = env.number("TRAINYARD_EXPERIMENTS_PASS_SECONDS", 1.0, minimum=0.0)
MAX_EXPERIMENTS = env.integer("TRAINYARD_MAX_EXPERIMENTS", 20, minimum=1)
# GPU-hours of service after which a job yields to fresh jobs of its priority (gpu_scheduler: service
# levels); 0 turns service levels off.
SERVICE_LEVEL_GPU_HOURS = env.number("TRAINYARD_SERVICE_LEVEL_GPU_HOURS", 4.0, minimum=0.0)
# Between tenants, ties go to the one that has used the least lately: its GPU- and CPU-seconds with
# each second counted 2^(-age / this half-life) (tenants.quotas.recent_service; docs/scheduling.md).
FAIR_SHARE_HALF_LIFE_S = env.number("TRAINYARD_FAIR_SHARE_HALF_LIFE", 3600.0, minimum=1.0)
# Who may submit jobs with `priority: high` where the tenant's quota does not say (tenants.priority):
# admins (tenant admins only), everyone (every member who may submit), or nobody.
HIGH_PRIORITY = env.choice("TRAINYARD_HIGH_PRIORITY", "admins", ("admins", "everyone", "nobody"))
# A queued job's place in its tenant queue, past the head, is written at most this often (jobs.admission:
# one admission moves every job behind it); 0 writes every change at once.
QUEUE_POSITION_REFRESH_S = env.integer("TRAINYARD_QUEUE_POSITION_REFRESH", 5, minimum=0)
# Elastic jobs (jobs.autoscaler): besides after each scheduling cycle, the autoscaler runs this often;
# it resizes a job only if the predicted gain over the horizon beats the measured resize cost (the
# configured one until a resize has been measured), and a job not again within the minimum interval.
ELASTIC_INTERVAL_S = env.number("TRAINYARD_ELASTIC_INTERVAL", 30.0, minimum=0.5)
ELASTIC_MIN_INTERVAL_S = env.number("TRAINYARD_ELASTIC_MIN_INTERVAL", 300.0, minimum=0.0)
# Grows wait until no attempt has released GPUs for this long: jobs ending together (a burst of
# finishes, several terminates) become one resize onto all their GPUs, not one per job.
ELASTIC_GROW_SETTLE_S = env.number("TRAINYARD_ELASTIC_GROW_SETTLE", 10.0, minimum=0.0)
# A job whose learners keep less than this share of their GPUs busy (their latest resource samples)
# is not grown: more GPUs would idle as these do. 0 grows whatever the use.
ELASTIC_GROW_MIN_GPU_USE = env.number("TRAINYARD_ELASTIC_GROW_MIN_GPU_USE", 0.5, minimum=0.0)
ELASTIC_HORIZON_S = env.number("TRAINYARD_ELASTIC_HORIZON", 600.0, minimum=0.0)
ELASTIC_RESIZE_COST_S = env.number("TRAINYARD_ELASTIC_RESIZE_COST", 60.0, minimum=0.0)
ELASTIC_POLICY = env.choice("TRAINYARD_ELASTIC_POLICY", "trainyard", ("gpu_only", "paper", "trainyard"))
# Tenants' idle-GPU policies (jobs.idle) are judged this often from the learners' resource samples:
# a job is flagged (and halted, where its tenant asks) at most this long after its samples say so.
IDLE_GPU_INTERVAL_S = env.number("TRAINYARD_IDLE_GPU_INTERVAL", 30.0, minimum=0.5)
CELERY_BEAT_SCHEDULE = {
    "reconcile": {"task": "jobs.tasks.reconcile", "schedule": RECONCILE_INTERVAL_S},
    "autoscale": {"task": "jobs.tasks.autoscale", "schedule": ELASTIC_INTERVAL_S},
    "idle-gpus": {"task": "jobs.tasks.idle_gpus", "schedule": IDLE_GPU_INTERVAL_S},
    # Deleted jobs' files, logs and metrics (jobs.deletion.purge_pass), within a time budget a pass.
    "purge-deleted": {"task": "jobs.tasks.purge_deleted", "schedule": RECONCILE_INTERVAL_S},
    # Resource samples past their retention (jobs.retention.prune_pass), within a time budget a pass.
    "prune-samples": {"task": "jobs.tasks.prune_samples", "schedule": 60.0},
    # API tokens and invitations ended ENDED_KEPT ago (tenants.people.prune), a bounded number a pass.
    "prune-people": {"task": "jobs.tasks.prune_people", "schedule": 600.0},
    # What processes killed mid-submission left in storage (jobs.reconcile.sweep_storage): a walk over
    # every job's folder, so not every reconcile pass.
    "sweep-storage": {"task": "jobs.tasks.sweep_storage", "schedule": 600.0},
}

# Shared by every process, so counters (tenants.throttling) add up across web servers.
# Short timeouts: a Redis that hangs must not hang every login and ingest post with it.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                      "KEY_PREFIX": "trainyard", "OPTIONS": {"socket_connect_timeout": 2, "socket_timeout": 2,
                                                                 "pool_class": "portal.cache.SharedConnectionPool"}}}

CHANNEL_LAYERS = fanout.channel_layers(REDIS_URL)

# --- jobs, storage and the learner backend --------------------------------------------------
STORAGE_URL = env.url("TRAINYARD_STORAGE_URL", f"file://{DATA_DIR / 'storage'}", schemes=("file", "s3"))
# Data-store endpoints a manifest names must be public addresses (jobs.egress), unless allowed here:
# every address, or listed host names, IP addresses and CIDR networks (comma-separated).
DATASTORE_ALLOW_PRIVATE = env.boolean("TRAINYARD_DATASTORE_ALLOW_PRIVATE", False)
DATASTORE_ALLOWED_HOSTS = env.host_list("TRAINYARD_DATASTORE_ALLOWED_HOSTS")
# Webhooks (notifications/) likewise reach public addresses only unless this, their own switch, allows
# private ones; each delivery (connecting, sending and the whole answer) takes at most
# WEBHOOK_TIMEOUT_S in all, however slowly the receiver answers (notifications.delivery).
WEBHOOK_ALLOW_PRIVATE = env.boolean("TRAINYARD_WEBHOOK_ALLOW_PRIVATE", False)
WEBHOOK_TIMEOUT_S = env.number("TRAINYARD_WEBHOOK_TIMEOUT_S", 10.0, minimum=0.5)
BACKEND = env.choice("TRAINYARD_BACKEND", "local", ("local", "kubernetes"))
# The address learners' agents use to reach the platform's ingest endpoint.
PUBLIC_URL = env.url("TRAINYARD_PUBLIC_URL", "http://127.0.0.1:8000", schemes=("http", "https"))
MAX_CODE_BYTES = env.integer("TRAINYARD_MAX_CODE_MB", 100, minimum=1) * 1024 * 1024
MAX_UNPACKED_BYTES = env.integer("TRAINYARD_MAX_UNPACKED_MB", 1024, minimum=1) * 1024 * 1024
MAX_ARCHIVE_MEMBERS = env.integer("TRAINYARD_MAX_ARCHIVE_FILES", 20000, minimum=1)
# What checking a code archive may cost the submit request (learner_agent.archive.InspectBounds): an
# archive that unpacks to over 16 MiB may unpack to at most this many times its own size (a .tar.gz is
# inflated no further), and the check gives up after this many seconds; either refusal is a 400.
MAX_ARCHIVE_RATIO = env.number("TRAINYARD_MAX_ARCHIVE_RATIO", 100.0, minimum=1.0)
ARCHIVE_INSPECT_SECONDS = env.number("TRAINYARD_ARCHIVE_INSPECT_SECONDS", 15.0, minimum=1.0)
# Recording a job's output as artifacts (jobs.artifacts) on a shared worker: at most this many files
# per job, and this many seconds of hashing; the rest stays in storage, unlisted, with a log notice.
MAX_RECORDED_FILES = env.integer("TRAINYARD_MAX_RECORDED_FILES", 10000, minimum=1)
RECORD_SECONDS = env.number("TRAINYARD_RECORD_SECONDS", 60.0, minimum=1.0)
# What one tenant may put in the queue (jobs.submission; a tenant's quota may set its own): submissions
# per minute (every submit counts, in fixed windows of the clock's minutes; past it a 429 with
# Retry-After), and jobs waiting in QUEUED at once (past it a 429).
SUBMITS_PER_MINUTE = env.integer("TRAINYARD_SUBMITS_PER_MINUTE", 60, minimum=1)
MAX_QUEUED_JOBS = env.integer("TRAINYARD_MAX_QUEUED_JOBS", 500, minimum=1)
# A job's disk caps when its manifest's `disk` block names none (jobs.disk; docs/submitting.md, "Disk caps"):
# results and checkpoints per job, work (its work folder with the unpacked code, and its state
# folder) and tmp (/tmp and /dev/shm, memory-backed) per learner, stored log bytes and lines per job.
DISK_DEFAULTS = {
    "results": env.integer("TRAINYARD_DISK_RESULTS_MB", 10240, minimum=1) * 2**20,
    "checkpoints": env.integer("TRAINYARD_DISK_CHECKPOINTS_MB", 10240, minimum=1) * 2**20,
    "work": env.integer("TRAINYARD_DISK_WORK_MB", 10240, minimum=1) * 2**20,
    "tmp": env.integer("TRAINYARD_DISK_TMP_MB", 1024, minimum=1) * 2**20,
    "logs": env.integer("TRAINYARD_LOG_MAX_MB", 1024, minimum=1) * 2**20,
    "data": env.integer("TRAINYARD_DISK_DATA_MB", 10240, minimum=1) * 2**20,
    "log_lines": env.integer("TRAINYARD_LOG_MAX_LINES", 4_000_000, minimum=1),
}
# How long downloading a job's training data may take in all (a data store answering slowly holds a
# lifecycle worker meanwhile).
DATA_DOWNLOAD_SECONDS = env.integer("TRAINYARD_DATA_DOWNLOAD_SECONDS", 3600, minimum=1)
# How long uploading a job's results to its result stores may take in all (same reason).
RESULT_UPLOAD_SECONDS = env.integer("TRAINYARD_RESULT_UPLOAD_SECONDS", 3600, minimum=1)
# What one learner of a job may store of the log (within the job's caps), and one line's length.
LOG_MAX_BYTES_PER_LEARNER = env.integer("TRAINYARD_LOG_MAX_MB_PER_LEARNER", 256, minimum=1) * 2**20
LOG_MAX_LINES_PER_LEARNER = env.integer("TRAINYARD_LOG_MAX_LINES_PER_LEARNER", 1_000_000, minimum=1)
LOG_MAX_LINE_BYTES = env.integer("TRAINYARD_LOG_MAX_LINE_BYTES", 16384, minimum=256)
# What one learner of an attempt may store of metric points, and one job of distinct metric names
# (jobs.logcap.MetricMeter): past them points are counted, not stored.
METRIC_POINTS_PER_LEARNER = env.integer("TRAINYARD_METRIC_POINTS_PER_LEARNER", 1_000_000, minimum=1)
METRIC_NAMES_PER_JOB = env.integer("TRAINYARD_METRIC_NAMES_PER_JOB", 1000, minimum=1)
# How fast one learner's output is shipped (learner_agent.pace): after a burst, at most this many
# bytes a second; a learner printing faster is slowed (its writes wait), its lines are not dropped.
LOG_PACE_BYTES_PER_SECOND = env.integer("TRAINYARD_LOG_PACE_KB", 512, minimum=0) * 2**10
LOG_PACE_BURST_BYTES = env.integer("TRAINYARD_LOG_PACE_BURST_MB", 8, minimum=1) * 2**20
# How often each learner's agent samples its CPU, memory and GPUs (learner_agent.telemetry); 0: never.
RESOURCE_SAMPLE_S = env.number("TRAINYARD_RESOURCE_SAMPLE_S", 5.0, minimum=0.0)
# Samples older than this many days are summed into learner-days and deleted (jobs.retention); 0: kept.
RESOURCE_SAMPLE_DAYS = env.integer("TRAINYARD_RESOURCE_SAMPLE_DAYS", 30, minimum=0)
DATA_UPLOAD_MAX_MEMORY_SIZE = 16 * 1024 * 1024  # an agent batch is up to 8 MiB of JSON
# Threads of each web process that serve agents' ingest posts (portal.overrides.ingest); one on SQLite.
INGEST_THREADS = env.integer("TRAINYARD_INGEST_THREADS", 4, minimum=1)
# How many of those threads one tenant's posts may hold at once (portal.overrides.ingest); the rest
# wait their turn. 0: half of them (at least one).
INGEST_TENANT_THREADS = env.integer("TRAINYARD_INGEST_TENANT_THREADS", 0, minimum=0)
# How long an ingest thread keeps its database connection between posts (portal.overrides.ingest).
INGEST_KEEP_CONNECTION_S = env.integer("TRAINYARD_INGEST_KEEP_CONNECTION_S", 300, minimum=0)
# How long an ingest post's body may take to arrive in all (portal.overrides.ingest): a stalled
# upload is refused then, and its connection closed.
INGEST_READ_S = env.number("TRAINYARD_INGEST_READ_S", 60.0, minimum=1.0)
FILE_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
# How long a request's body may take to arrive (portal.bodylimit): a 408 then, and the connection closed.
REQUEST_READ_S = env.number("TRAINYARD_REQUEST_READ_S", 300.0, minimum=1.0)
# How long one database statement of the web and ingest servers may run or wait (portal.statement_timeout);
# 0 = no limit.
WEB_STATEMENT_TIMEOUT_S = env.number("TRAINYARD_WEB_STATEMENT_TIMEOUT_S", 30.0, minimum=0.0)
# How many websockets one user may hold open in one web process at once, of both streams together
# (jobs.consumers); past it a socket is refused with 4429.
WEBSOCKETS_PER_USER = env.integer("TRAINYARD_WEBSOCKETS_PER_USER", 256, minimum=1)

LOCAL_GPUS = env.integer("TRAINYARD_LOCAL_GPUS", -1)  # -1: the GPUs nvidia-smi reports
# A pynvml-compatible file (an absolute path) the local backend's agents load instead of NVML, for
# virtual GPUs, which have no counters of their own (learner_agent.telemetry.load_nvml); "": NVML.
LOCAL_NVML_MODULE = env.text("TRAINYARD_LOCAL_NVML_MODULE", "")
LOCAL_CPUS = env.number("TRAINYARD_LOCAL_CPUS", float(os.cpu_count() or 1), minimum=0.1)
LOCAL_MEMORY_MB = env.integer("TRAINYARD_LOCAL_MEMORY_MB", 0)  # 0: the machine's total memory
# How many complete checkpoints each attempt keeps once it ends (0 keeps them all).
CHECKPOINTS_KEPT_PER_ATTEMPT = env.integer("TRAINYARD_CHECKPOINTS_KEPT", 5, minimum=0)
SANDBOX = env.choice("TRAINYARD_SANDBOX", "auto", ("auto", "bwrap", "none"))
# Tries in a row a job's deploy may fail (about a minute apart past the first few) before its attempt
# ends: queued again while it has restarts left, failed otherwise (jobs.lifecycle.deploy).
DEPLOY_TRIES = env.integer("TRAINYARD_DEPLOY_TRIES", 10, minimum=1)
# Learner agents the local backend keeps started ahead of deploys (learner_agent.spare); 0: none.
SPARE_AGENTS = env.integer("TRAINYARD_SPARE_AGENTS", 1, minimum=0)

# The `kubernetes` backend (docs/kubernetes.md, "Run on Kubernetes"); read only when TRAINYARD_BACKEND=kubernetes, where
# jobs.backends.k8s checks the values that need more than a type (the volume JSON, the URL).
K8S_CONTEXT = env.text("TRAINYARD_K8S_CONTEXT", "")  # kubeconfig context; empty: current / in-cluster
K8S_NAMESPACE_PREFIX = env.text("TRAINYARD_K8S_NAMESPACE_PREFIX", "trainyard-")  # + tenant slug
K8S_PLATFORM_NAMESPACE = env.text("TRAINYARD_K8S_PLATFORM_NAMESPACE", "trainyard")
K8S_IMAGE_PREFIX = env.text("TRAINYARD_K8S_IMAGE_PREFIX", "ghcr.io/trainyard/learner-")  # + framework
K8S_IMAGE_TAG = env.text("TRAINYARD_K8S_IMAGE_TAG", "latest")
K8S_AGENT_IMAGE = env.text("TRAINYARD_K8S_AGENT_IMAGE", "ghcr.io/trainyard/learner-agent:latest")
K8S_STORAGE_VOLUME = env.text("TRAINYARD_K8S_STORAGE_VOLUME", "")  # JSON volume source of the storage root
K8S_INGEST_URL = env.text("TRAINYARD_K8S_INGEST_URL", "")  # in-cluster base URL of the web service
K8S_INGEST_PORT = env.integer("TRAINYARD_K8S_INGEST_PORT", 8000, minimum=1)
K8S_RUN_AS_USER = env.integer("TRAINYARD_K8S_RUN_AS_USER", 1000, minimum=1)
K8S_POD_SECURITY = env.choice("TRAINYARD_K8S_POD_SECURITY", "restricted", ("restricted", "baseline"))
K8S_UNSCHEDULABLE_TIMEOUT_S = env.number("TRAINYARD_K8S_UNSCHEDULABLE_TIMEOUT", 300.0, minimum=0)
K8S_API_RETRIES = env.integer("TRAINYARD_K8S_API_RETRIES", 4, minimum=0)
K8S_WATCH = env.boolean("TRAINYARD_K8S_WATCH", True)  # keep a pod cache fed by a watch in each worker
K8S_RESYNC_S = env.number("TRAINYARD_K8S_RESYNC", 300.0, minimum=1)

# --- monitoring: /metrics (jobs.prometheus) answers only this bearer token; unset, it does not exist ---
METRICS_TOKEN = env.text("TRAINYARD_METRICS_TOKEN", "")

# --- hosts and origins: derived from the public URL (portal.hosts) --------------------------------
ALLOWED_HOSTS = hosts.allowed_hosts(PUBLIC_URL, extra=env.text("TRAINYARD_ALLOWED_HOSTS", ""),
                                    service_urls=[K8S_INGEST_URL])
CSRF_TRUSTED_ORIGINS = hosts.trusted_origins(PUBLIC_URL, extra=env.text("TRAINYARD_CSRF_TRUSTED_ORIGINS", ""))
# Served over https (the public URL says so, whether TLS ends here or at a proxy): the session and
# CSRF cookies are then never sent over plain http.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = PUBLIC_URL.startswith("https://")

# --- auth and API -------------------------------------------------------------------------------
# Single sign-on through an OpenID provider (tenants.sso, docs/security.md): on when an issuer and a
# client id are set. Local passwords can be switched off; API tokens keep working either way.
OIDC_ISSUER = env.text("TRAINYARD_OIDC_ISSUER", "")
OIDC_CLIENT_ID = env.text("TRAINYARD_OIDC_CLIENT_ID", "")
OIDC_CLIENT_SECRET = env.text("TRAINYARD_OIDC_CLIENT_SECRET", "")
OIDC_SCOPES = env.text("TRAINYARD_OIDC_SCOPES", "openid email profile groups")
OIDC_SIGN_ALGO = env.choice("TRAINYARD_OIDC_SIGN_ALGO", "RS256", ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256"))
OIDC_GROUPS_CLAIM = env.text("TRAINYARD_OIDC_GROUPS_CLAIM", "groups")
OIDC_GROUP_MAP = env.text("TRAINYARD_OIDC_GROUP_MAP", "")  # group=tenant[:role], ...
OIDC_RECHECK_S = env.number("TRAINYARD_OIDC_RECHECK_INTERVAL", 300.0, minimum=1.0)
OIDC_TOKEN_LIFETIME_S = env.number("TRAINYARD_OIDC_TOKEN_LIFETIME", 12 * 3600.0, minimum=60.0)
LOCAL_LOGIN = env.boolean("TRAINYARD_LOCAL_LOGIN", True)
INVITATION_DAYS = env.number("TRAINYARD_INVITATION_DAYS", 14.0, minimum=1.0)  # how long one waits to be accepted
# What mozilla-django-oidc itself reads (its views and backend; tenants.sso supplies the endpoints).
OIDC_RP_SCOPES = OIDC_SCOPES
OIDC_USE_PKCE = True
OIDC_USE_NONCE = True
OIDC_AUTHENTICATION_CALLBACK_URL = "sso-callback"
# Seconds each request to the provider may take, the library's and tenants.sso's own: without one, a
# provider that never answers holds the sign-in's web thread for ever.
OIDC_TIMEOUT = 10

AUTHENTICATION_BACKENDS = [
    # django-axes's lockout first: a locked username+address is refused before its password is checked.
    *(["tenants.throttling.LoginLockout", "tenants.throttling.LocalPasswordBackend"] if LOCAL_LOGIN else []),
    "tenants.sso.SsoBackend",  # does nothing unless single sign-on is configured
    "guardian.backends.ObjectPermissionBackend",
]
# django-axes: failed password sign-ins counted per username and address in the cache (Redis),
# failing open when it cannot be reached (tenants.throttling).
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False  # a lockout ends when it said it would
AXES_HANDLER = "tenants.throttling.LoginFailures"
AXES_USERNAME_CALLABLE = "tenants.throttling.login_username"
AXES_WHITELIST_CALLABLE = "tenants.throttling.not_a_password_login"
AXES_CLIENT_IP_CALLABLE = "tenants.throttling.client_address"
AXES_LOCKOUT_CALLABLE = "tenants.sso.lockout_response"
AXES_ENABLE_ADMIN = False  # its admin pages list database rows, and the cache handler writes none
AXES_VERBOSE = False
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "jobs.bounds.BoundedLimitOffsetPagination",
    "DEFAULT_PARSER_CLASSES": ["jobs.bounds.BoundedJSONParser", "jobs.bounds.BoundedFormParser",
                               "jobs.bounds.BoundedMultiPartParser"],
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.api.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Trainyard API",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "portal.schema.add_error_responses"],
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = env.text("TRAINYARD_STATIC_ROOT")  # only for collectstatic; whitenoise serves from the finders
WHITENOISE_USE_FINDERS = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.log_level("TRAINYARD_LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}
