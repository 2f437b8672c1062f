"""A fake Trainyard REST API on a real local port, for testing the CLI without a database.

It follows the contract the CLI relies on (SPEC §4) and parses uploads with Django's own multipart
parser, so what it accepts the real server accepts too. A job advances one step per log poll: each
poll stores two more lines, and the status is read *after* that, the way the real view does, so the
poll that first reports a final status does not carry the last lines (a client must drain).
"""
import hashlib
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlsplit

import yaml

TOKEN = "secret-token"
ARTIFACT_PAGE = 1


class FakeJob:
    def __init__(self, job_id, manifest, code):
        self.id, self.manifest, self.code = job_id, manifest, code
        self.failing = manifest.get("name") == "failing"
        count = 3 if self.failing else 7
        self.lines = [f"{manifest.get('name')} line {n}" for n in range(1, count + 1)]
        self.stored, self.status, self.reason, self.exit_code = 0, "QUEUED", "", None
        self.elastic, self.allocations = None, []  # an elastic job's detail block and timeline rows

    def advance(self):
        self.stored = min(self.stored + 2, len(self.lines))
        if self.stored < len(self.lines):
            self.status = "PROCESSING"
        elif self.failing:
            self.status, self.reason, self.exit_code = "FAILED", "learner 0 exited with code 3", 3
        else:
            self.status, self.exit_code = "COMPLETED", 0

    def json(self):
        return {"id": self.id, "name": self.manifest.get("name"), "description": "", "framework": "custom",
                "status": self.status, "status_reason": self.reason, "attempt": 1, "exit_code": self.exit_code,
                "priority": "normal", "learners": 1, "gpus": 0, "cpus": 1.0, "memory_bytes": 2**30,
                "owner": "alice", "tenant": "team-a", "created_at": "2026-05-01T10:00:00+00:00",
                "admitted_at": None, "started_at": None, "finished_at": None,
                "queue_position": 1 if self.status == "QUEUED" else None, "manifest": self.manifest,
                "final": self.status in ("COMPLETED", "FAILED", "TERMINATED"),
                "latest_metrics": {"loss": {"value": 0.25, "step": 8}}, "page_url": f"/jobs/{self.id}/",
                "elastic": self.elastic}


class FakeTrainyard:
    def __init__(self):
        self.jobs, self.headers, self.requested_paths, self.fail_log_polls = {}, [], [], 0
        self.artifacts = {"results/model.pt": b"weights" * 1000, "results/metrics.json": b'{"acc": 0.97}',
                          "checkpoints/epoch-2.pt": b"checkpoint"}
        self.corrupt = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add_job(self, job_id="training-done0001", name="demo"):
        job = FakeJob(job_id, {"name": name}, b"")
        self.jobs[job_id] = job
        return job

    # --- routing ---------------------------------------------------------------------------------
    def handle(self, method, path, query, headers, body):
        self.headers.append(dict(headers))
        self.requested_paths.append(path)
        if headers.get("Authorization") != f"Token {TOKEN}":
            return 401, {"detail": "Invalid token."}
        routes = [
            ("POST", r"/api/v1/jobs/", self.submit),
            ("GET", r"/api/v1/jobs/", self.list_jobs),
            ("GET", r"/api/v1/tenants/current/", self.tenant),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/", self.detail),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/logs/", self.logs),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/metrics/", self.metrics),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/allocations/", self.allocations),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/artifacts/", self.artifact_list),
            ("GET", r"/api/v1/jobs/(?P<job_id>[^/]+)/artifacts/(?P<name>.+)", self.artifact),
            ("POST", r"/api/v1/jobs/(?P<job_id>[^/]+)/(?P<action>halt|resume|terminate)/", self.action),
            ("DELETE", r"/api/v1/jobs/(?P<job_id>[^/]+)/", self.delete),
        ]
        for route_method, pattern, view in routes:
            match = re.fullmatch(pattern, path)
            if match and route_method == method:
                job_id = match.groupdict().pop("job_id", None)
                if job_id is not None and job_id not in self.jobs:
                    return 404, {"detail": "Not found."}
                args = {k: v for k, v in match.groupdict().items() if k != "job_id"}
                if job_id is not None:
                    args["job"] = self.jobs[job_id]
                return view(query=query, headers=headers, body=body, **args)
        return 404, {"detail": "Not found."}

    def submit(self, *, query, headers, body):
        from django.core.files.uploadhandler import MemoryFileUploadHandler
        from django.http.multipartparser import MultiPartParser

        meta = {"CONTENT_TYPE": headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body))}
        _, files = MultiPartParser(meta, io.BytesIO(body), [MemoryFileUploadHandler()]).parse()
        manifest = yaml.safe_load(files["manifest"].read())
        if str(manifest.get("memory")) == "999GiB":
            return 400, {"detail": "999 GiB is more than the tenant's quota of 64 GiB", "field": "memory"}
        job_id = f"training-{len(self.jobs) + 1:08d}"
        self.jobs[job_id] = FakeJob(job_id, manifest, files["code"].read())
        return 201, self.jobs[job_id].json()

    def list_jobs(self, *, query, **_):
        text = query.get("q", "").lower()  # the server's q: in the id or the name
        jobs = [j.json() for j in self.jobs.values() if query.get("status") in (None, j.status)]
        jobs = [j for j in jobs if text in j["id"].lower() or text in j["name"].lower()]
        limit = int(query.get("limit", 50))
        return 200, {"count": len(jobs), "next": None, "previous": None, "results": jobs[:limit]}

    def tenant(self, **_):
        return 200, {"tenant": {"slug": "team-a", "name": "Team A"}, "role": "researcher",
                     "quota": {"gpus": 4, "cpus": None, "memory_bytes": 64 * 2**30, "jobs": None, "gpu_hours": 100,
                               "cpu_hours": None, "period": "month", "budget_mode": "hard"},
                     "usage": {"gpus": 1, "cpus": 2.0, "memory_bytes": 2**30, "jobs": 2, "gpu_hours": 12.5,
                               "cpu_hours": 30.25, "period_start": "2026-11-01T00:00:00+00:00",
                               "period_end": "2026-12-01T00:00:00+00:00"},
                     "budget": {"state": "ok", "reason": ""}, "queued": {"jobs": 3, "gpus": 5}}

    def detail(self, *, job, **_):
        return 200, job.json()

    def logs(self, *, job, query, **_):
        if self.fail_log_polls:
            self.fail_log_polls -= 1
            return 503, {"detail": "restarting"}
        since, limit = int(query.get("since", 0)), int(query.get("limit", 1000))
        lines = [{"seq": n, "learner": 0, "stream": "stdout", "time": "2026-05-01T10:00:00+00:00", "line": text}
                 for n, text in enumerate(job.lines[:job.stored], start=1) if n > since][:limit]
        job.advance()
        return 200, {"results": lines, "next_since": lines[-1]["seq"] if lines else since,
                     "status": job.status, "final": job.json()["final"]}

    def metrics(self, *, job, query, **_):
        points = [{"name": name, "step": step, "value": value, "time": "2026-05-01T10:00:00+00:00", "learner": 0}
                  for name, step, value in [("loss", 1, 0.9), ("loss", 2, 0.5), ("val_acc", 1, 0.8)]]
        return 200, {"results": [p for p in points if query.get("name") in (None, p["name"])]}

    def allocations(self, *, job, **_):
        return 200, {"results": job.allocations}

    def artifact_list(self, *, job, query, **_):
        """Pages in name order, as the platform gives them, of ARTIFACT_PAGE files each (the platform's
        are far larger: a client that reads only the first page misses files here)."""
        after = query.get("after", "")
        names = sorted(name for name in self.artifacts if name > after)
        results = []
        for name in names[:ARTIFACT_PAGE]:
            data = self.artifacts[name]
            digest = hashlib.sha256(data if name not in self.corrupt else b"other").hexdigest()
            results.append({"name": name, "kind": "checkpoint" if name.startswith("checkpoints/") else "result",
                            "size": len(data), "sha256": digest, "attempt": 1,
                            "url": f"/api/v1/jobs/{job.id}/artifacts/{name}"})
        more = len(names) > ARTIFACT_PAGE
        return 200, {"count": len(self.artifacts), "results": results,
                     "next": f"/api/v1/jobs/{job.id}/artifacts/?{urlencode({'after': results[-1]['name']})}"
                     if more else None}

    def artifact(self, *, job, name, **_):
        if name not in self.artifacts:
            return 404, {"detail": "Not found."}
        return 200, self.artifacts[name]

    def action(self, *, job, action, **_):
        if job.status in ("COMPLETED", "FAILED", "TERMINATED"):
            return 409, {"detail": f"{job.id} is {job.status}; it cannot {action}"}
        job.status = {"halt": "HALTING", "resume": "QUEUED", "terminate": "TERMINATED"}[action]
        return 202, job.json()

    def delete(self, *, job, **_):
        if job.status not in ("COMPLETED", "FAILED", "TERMINATED", "HALTED"):
            return 409, {"detail": f"job {job.id} is {job.status}; only a job that has ended or is halted can be "
                                   "deleted (terminate it first)"}
        del self.jobs[job.id]
        return 202, job.json()

    def _handler_class(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = fake.handle(self.command, parts.path, query, self.headers, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes)
                                 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *args):
                pass

        return Handler
