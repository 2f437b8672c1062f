"""The portal's HTTP requests through the ASGI application (portal.handler): the middleware and the
view of a request run in one thread, without hopping back to the event loop in between."""
import json

import pytest
from asgiref import sync
from channels.testing import HttpCommunicator

from jobs.tests.builders import member, token_for
from portal.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def hops(monkeypatch):
    """The calls from a thread back into the event loop (AsyncToSync) while a request is served."""
    calls = []
    original = sync.AsyncToSync.__call__

    def counted(self, *args, **kwargs):
        name = getattr(self.awaitable, "__qualname__", repr(self.awaitable))
        if name != "HttpCommunicator.get_response":  # the test's own call
            calls.append(name)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(sync.AsyncToSync, "__call__", counted)
    return calls


def get(path, headers=()):
    return sync.async_to_sync(HttpCommunicator(application, "GET", path, headers=[(b"host", b"testserver"),
                                                                                  *headers]).get_response)(timeout=10)


def test_a_page_is_served_through_every_middleware_in_one_thread(hops):
    response = get("/login/")
    assert response["status"] == 200
    headers = {name.lower(): value for name, value in response["headers"]}
    assert b"content-security-policy" in headers  # the innermost sync middleware ran
    assert b"x-frame-options" in headers and b"csrftoken" in headers.get(b"set-cookie", b"")
    assert hops == []  # Django's own ASGI handler went back to the loop for its async middleware


def test_an_api_request_is_authenticated_and_answered_as_before(hops):
    alice = member("team-a", "alice")
    token = f"Token {token_for(alice)}".encode()
    response = get("/api/v1/jobs/", headers=[(b"authorization", token)])
    assert response["status"] == 200, response["body"]
    assert json.loads(response["body"])["results"] == []
    assert get("/api/v1/jobs/")["status"] in (401, 403)
    assert hops == []
