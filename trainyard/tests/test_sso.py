"""`trainyard login --sso`'s side of the device flow (trainyard.sso), against a scripted server: it
shows the code, polls at the interval, slows down when told, and stops with one line when refused."""
import pytest

from trainyard import sso
from trainyard.errors import ApiError


class Answer:
    def __init__(self, status, body):
        self.status_code, self.body = status, body

    def json(self):
        return self.body


class Server:
    """Answers each POST with the next scripted (status, body) and records (url, json)."""

    def __init__(self, *answers):
        self.answers, self.posts = list(answers), []

    def post(self, url, timeout, **kwargs):
        self.posts.append((url, kwargs.get("json")))
        return Answer(*self.answers.pop(0))


STARTED = (200, {"device_code": "dc-1", "user_code": "ABCD-EFGH", "verification_uri": "https://id.example/device",
                 "verification_uri_complete": "https://id.example/device?user_code=ABCD-EFGH", "expires_in": 60,
                 "interval": 2})


def run(server, *, expires_after=None):
    notes, sleeps, now = [], [], [0.0]

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    result = sso.device_login("https://ty.example", notify=notes.append, session=server, sleep=sleep,
                              clock=lambda: now[0])
    return result, notes, sleeps


def test_it_shows_the_code_and_polls_until_the_person_has_signed_in():
    server = Server(STARTED, (400, {"error": "authorization_pending"}), (400, {"error": "slow_down"}),
                    (200, {"token": "ty_x", "username": "carol", "expires_at": "2030-01-01T00:00:00Z"}))
    result, notes, sleeps = run(server)
    assert result["token"] == "ty_x"
    assert notes == ["to sign in, open https://id.example/device?user_code=ABCD-EFGH and confirm the code ABCD-EFGH"]
    assert sleeps == [2, 2, 7]  # slow_down adds five seconds (RFC 8628 §3.5)
    assert server.posts[1:] == [("https://ty.example/api/v1/sso/device/token/", {"device_code": "dc-1"})] * 3


def test_the_servers_own_limit_on_polls_slows_it_down_too():
    server = Server(STARTED, (429, {"detail": "Too many single sign-on requests from this address"}),
                    (200, {"token": "ty_x", "username": "carol", "expires_at": "2030-01-01T00:00:00Z"}))
    result, _, sleeps = run(server)
    assert result["token"] == "ty_x" and sleeps == [2, 7]


def test_it_stops_with_the_reason_when_the_person_refuses():
    server = Server(STARTED, (400, {"error": "access_denied", "detail": "The identity provider says access_denied."}))
    with pytest.raises(ApiError, match="single sign-on refused: The identity provider says access_denied"):
        run(server)


def test_it_gives_up_when_the_code_expires():
    server = Server(STARTED, *[(400, {"error": "authorization_pending"})] * 40)
    with pytest.raises(ApiError, match="the code expired"):
        run(server)


@pytest.mark.parametrize("interval, waited", [(-5, 1), ("soon", sso.DEFAULT_INTERVAL_S), (1e9, 60), (True, 5)])
def test_a_wait_the_server_names_is_kept_within_bounds(interval, waited):
    server = Server((200, {**STARTED[1], "interval": interval}), (200, {"token": "ty_x"}))
    assert run(server)[2] == [waited]


def test_a_start_without_a_device_code_is_said_in_one_line():
    server = Server((200, {key: value for key, value in STARTED[1].items() if key != "device_code"}))
    with pytest.raises(ApiError, match="holds no device code"):
        run(server)


def test_it_says_when_the_server_has_no_single_sign_on():
    server = Server((404, {"detail": "Single sign-on is not configured on this Trainyard."}))
    with pytest.raises(ApiError, match="single sign-on: Single sign-on is not configured"):
        run(server)


def test_login_takes_sso_or_a_token_not_both(capsys):
    from trainyard import cli
    assert cli.main(["login", "--url", "https://ty.example", "--sso", "--token", "ty_x"]) == cli.USAGE
    assert "give either --sso or --token, not both" in capsys.readouterr().err
