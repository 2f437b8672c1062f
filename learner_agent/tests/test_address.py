"""Following a platform that moved (learner_agent.address): the file, and the shipper reading it."""
import json

from learner_agent import address
from learner_agent.shipper import Shipper
from learner_agent.spool import Spool
from tests.support.agent_runs import TOKEN, IngestServer

JOB = "training-test0001"


def announce(path, server):
    address.announce(path, server.url.replace(JOB, address.JOB_ID))


def shipper_at(url, folder, platform_file):
    return Shipper(url, TOKEN, attempt=1, learner=0, spool=Spool(str(folder / "spool")),
                   current_url=lambda: address.ingest_url(platform_file, JOB), backoff_max=0.2)


def dead_url():
    """An address nothing listens on: the platform's old one, after it stopped."""
    server = IngestServer()
    url = server.url
    server.close()
    return url


def test_the_file_gives_the_job_its_own_ingest_url_and_says_when_the_platform_stopped(tmp_path):
    path = address.path_in(tmp_path)
    assert address.ingest_url(path, JOB) is None  # never announced
    address.mark_stopped(path)
    assert address.read(path) is None  # a stop writes nothing the platform never announced
    address.announce(path, "http://127.0.0.1:8001/api/v1/ingest/{job_id}/")
    assert address.ingest_url(path, JOB) == f"http://127.0.0.1:8001/api/v1/ingest/{JOB}/"
    announced = address.read(path)["started_at"]
    assert not address.stopped_since(path, announced)
    address.mark_stopped(path)
    assert address.stopped_since(path, announced)
    assert address.ingest_url(path, JOB) == f"http://127.0.0.1:8001/api/v1/ingest/{JOB}/"


def test_a_file_without_a_usable_address_is_ignored(tmp_path):
    path = address.path_in(tmp_path)
    for content in ("not json", "[]", json.dumps({"ingest_url": "file:///etc/passwd"}), json.dumps({"ingest_url": 7})):
        with open(path, "w") as f:
            f.write(content)
        assert address.ingest_url(path, JOB) is None


def test_records_for_a_platform_that_moved_reach_it_at_its_new_address(tmp_path):
    server = IngestServer()
    platform_file = address.path_in(tmp_path)
    announce(platform_file, server)
    shipper = shipper_at(dead_url(), tmp_path, platform_file)
    try:
        for i in range(5):
            shipper.add({"kind": "log", "stream": "stdout", "line": f"line {i}"})
        assert shipper.flush(timeout=10)
        assert [r["line"] for r in server.stored()] == [f"line {i}" for i in range(5)]
    finally:
        shipper.close()
        server.close()


def test_a_refusal_at_the_old_address_does_not_end_delivery_when_the_platform_moved(tmp_path):
    """Whoever listens on the old address now does not know the credential (401): that is not the
    platform's final word when it says it is elsewhere by then."""
    stranger, server = IngestServer(token="someone else's"), IngestServer()
    answers = iter([stranger.url])  # where the platform is: the old address when the post goes out, then the new
    shipper = Shipper(stranger.url, TOKEN, attempt=1, learner=0, spool=Spool(str(tmp_path / "spool")),
                      current_url=lambda: next(answers, server.url))
    try:
        shipper.add({"kind": "log", "stream": "stdout", "line": "hello"})
        assert shipper.flush(timeout=10), shipper.stopped_reason
        assert stranger.requests == 1 and [r["line"] for r in server.stored()] == ["hello"]
    finally:
        shipper.close()
        stranger.close()
        server.close()


def test_a_refusal_is_final_where_the_platform_still_is(tmp_path):
    stranger = IngestServer(token="someone else's")
    platform_file = address.path_in(tmp_path)
    announce(platform_file, stranger)
    shipper = shipper_at(stranger.url, tmp_path, platform_file)
    try:
        shipper.add({"kind": "log", "stream": "stdout", "line": "hello"})
        assert not shipper.flush(timeout=5)
        assert shipper.stopped_reason.startswith("HTTP 401") and stranger.requests == 1
    finally:
        shipper.close()
        stranger.close()
