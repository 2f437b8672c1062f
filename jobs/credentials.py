"""Learner credentials: what a learner's agent proves itself with when it posts to ingest.

Each is random (`secrets`), issued per job attempt and per learner when the attempt is deployed, so
nothing about it follows from the platform's secret key, the job id or another learner's credential.
Only its SHA-256 is stored: a 256-bit random token cannot be found from its digest, so a slow password
hash would only slow down ingest. A credential is good for its own job, attempt and learner, and only
while that attempt lives; what counts as "lived" is read from the job row in the same query.
"""
import hashlib
import secrets
import threading
from dataclasses import dataclass

from jobs.models import LearnerCredential
from jobs.models import ACTIVE

TOKEN_BYTES = 32
MAX_TOKEN_LENGTH = 256  # longer than any issued token: refused without hashing


@dataclass(frozen=True)
class Grant:
    """What a valid credential allows: posting as `learner` of `attempt` of `job_id`, a job of `tenant_id`."""
    job_id: str
    attempt: int
    learner: int
    tenant_id: int  # whose share of the ingest threads its posts take (portal.overrides.ingest)
    ended: bool  # the attempt is over: its agent must stop (410), nothing it sends is stored


def digest(token):
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def issue_for_attempt(job):
    """A fresh credential for each learner of the job's current attempt: [token of learner 0, ...].

    A repeated deploy issues new ones; the agents already running keep theirs, which stay valid
    until the attempt ends."""
    tokens = [secrets.token_urlsafe(TOKEN_BYTES) for _ in range(job.learners)]
    LearnerCredential.objects.bulk_create(
        LearnerCredential(job=job, attempt=job.attempt, learner=index, digest=digest(token))
        for index, token in enumerate(tokens))
    return tokens


def attempt_over(*, status, current_attempt, attempt):
    """An attempt lives while its job is active on it; halted, finished, requeued or superseded, it is over."""
    return attempt != current_attempt or status not in ACTIVE


# digest -> (job id, attempt, learner, tenant id) of credentials seen valid: what a credential grants
# never changes once issued, so a process asks the database once per learner, not at every post.
# Whether its attempt lives is not remembered: ingest reads that under the job's lock at every post.
# Bounded; the oldest is forgotten first.
_KNOWN = {}
KNOWN_MAX = 16384
_known_lock = threading.Lock()


def check(token, job_id):
    """The Grant of `token` for posting to `job_id`, or None if it is unknown or for another job.
    One query on the unique digest index, joined to the job row for its state; a credential this
    process has seen valid before is not looked up again, and its Grant says `ended=False`: the
    caller must check the attempt itself (jobs.ingest does, under the job's lock)."""
    if not token or len(token) > MAX_TOKEN_LENGTH:
        return None
    key = digest(token)
    known = _KNOWN.get(key)
    if known is not None:
        return Grant(*known, ended=False) if known[0] == job_id else None
    row = (LearnerCredential.objects.filter(digest=key)
           .values_list("job_id", "attempt", "learner", "job__tenant_id", "job__status", "job__attempt").first())
    if row is None or row[0] != job_id:
        return None
    credential_job, attempt, learner, tenant_id, status, current_attempt = row
    ended = attempt_over(status=status, current_attempt=current_attempt, attempt=attempt)
    if not ended:
        _remember(key, (credential_job, attempt, learner, tenant_id))
    return Grant(credential_job, attempt, learner, tenant_id, ended=ended)


def _remember(key, grant):
    with _known_lock:
        while len(_KNOWN) >= KNOWN_MAX:
            del _KNOWN[next(iter(_KNOWN))]
        _KNOWN[key] = grant
