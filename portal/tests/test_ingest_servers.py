"""The ingest servers' application (portal.asgi.ingest_application), the only platform servers
learner pods may reach: agents' posts are served as the web servers serve them, and nothing else is."""
import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator, WebsocketCommunicator

from jobs import credentials
from jobs.models import LogLine
from portal.asgi import ingest_application, ingest_route
from tests.support.builders import job, member, token_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture(autouse=True)
def connections_let_go():
    """The route's threads keep their connections; the suite's database is dropped at its end."""
    yield
    ingest_route.close()


@async_to_sync
async def request(method, path, body=b"", headers=()):
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers]
    communicator = HttpCommunicator(ingest_application, method, path, body=body, headers=headers)
    response = await communicator.get_response(timeout=10)
    return response["status"], json.loads(response["body"])


def test_an_agents_post_is_stored_and_acknowledged():
    target = job(member(), status="PENDING")
    token = credentials.issue_for_attempt(target)[0]
    records = [{"seq": 1, "kind": "log", "stream": "stdout", "time": 1.0, "line": "hello"}]
    status, body = request("POST", f"/api/v1/ingest/{target.id}/",
                           json.dumps({"attempt": 1, "learner": 0, "records": records}).encode(),
                           [(b"authorization", f"Ingest {token}".encode())])
    assert (status, body) == (200, {"acked": 1})
    assert list(LogLine.objects.values_list("line", flat=True)) == ["hello"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/jobs/"),  # the API, even with a good token
    ("POST", "/api/v1/jobs/"),
    ("GET", "/admin/"),
    ("GET", "/login/"),
    ("GET", "/api/schema/"),
    ("GET", "/metrics"),
    ("GET", "/api/v1/ingest/"),  # no job id
])
def test_nothing_else_of_the_platform_is_served(method, path):
    token = token_for(member())
    status, body = request(method, path, b"{}", [(b"authorization", f"Token {token}".encode())])
    assert status == 404 and "ingest" in body["detail"]


def test_websockets_are_refused():
    async def connect():
        communicator = WebsocketCommunicator(ingest_application, "/ws/jobs/",
                                             headers=[(b"host", b"testserver"), (b"origin", b"http://testserver")])
        connected, _ = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected
    assert async_to_sync(connect)() is False
