# One image for every Trainyard process (web, worker, beat); the command picks the role.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap procps \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY portal portal
COPY tenants tenants
COPY jobs jobs
COPY notifications notifications
COPY gpu_scheduler gpu_scheduler
COPY learner_agent learner_agent
COPY trainyard trainyard
RUN pip install --no-cache-dir -e ".[server,ml]"
COPY . .
ENV DJANGO_SETTINGS_MODULE=portal.settings PYTHONUNBUFFERED=1 TRAINYARD_DATA_DIR=/data
# Never root: the same uid as the Kubernetes manifests' runAsUser. Its data directory is its own; the
# code stays root's, read-only to it. (Run as non-root, the local backend's learners keep the
# platform's uid inside bubblewrap's user namespace, with every capability dropped.)
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin trainyard \
    && mkdir -p /data && chown trainyard:trainyard /data && chmod 0700 /data
USER 1000:1000
EXPOSE 8000
# uvicorn, as portal/runner.py runs it (WEB_SERVER_OPTIONS says why each option).
CMD ["python", "-m", "uvicorn", "portal.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--lifespan", "off", "--no-proxy-headers", "--no-server-header", "--no-access-log", "--ws", "websockets-sansio", "--ws-max-size", "4096", "--timeout-graceful-shutdown", "5"]
