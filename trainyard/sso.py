"""`trainyard login --sso`: a personal API token through the organisation's identity provider, by the
OAuth device authorization grant (RFC 8628). The server runs the grant with the provider (its client
secret never leaves it); this side shows the code, waits while the person signs in in any browser, and
receives a token that expires (TRAINYARD_OIDC_TOKEN_LIFETIME on the server)."""
import time

import requests

from trainyard.errors import ApiError, ConnectionFailed

DEFAULT_INTERVAL_S = 5  # RFC 8628 §3.2: when the provider names none
SLOW_DOWN_S = 5  # §3.5: added to the interval at every slow_down
TIMEOUT_S = 30


def _post(session, url, **kwargs):
    try:
        response = session.post(url, timeout=TIMEOUT_S, **kwargs)
    except requests.RequestException as exc:
        raise ConnectionFailed(f"cannot reach {url}: {exc}") from None
    try:
        body = response.json()
    except ValueError:
        body = {}
    return response.status_code, body if isinstance(body, dict) else {}


def device_login(url, *, notify, session=None, sleep=time.sleep, clock=time.monotonic):
    """{"token", "username", "expires_at"} once the person has signed in at the provider; ApiError when
    they refuse, the code expires, or single sign-on is not configured on the server."""
    session = session or requests.Session()
    status, start = _post(session, f"{url}/api/v1/sso/device/")
    if status != 200:
        raise ApiError(f"single sign-on: {start.get('detail') or f'the server answered {status}'}", status=status,
                       detail=start.get("detail", ""))
    where = start.get("verification_uri_complete") or start.get("verification_uri")
    device_code = start.get("device_code")
    if not isinstance(device_code, str) or not device_code:
        raise ApiError("single sign-on: the server's answer holds no device code", status=status)
    notify(f"to sign in, open {where} and confirm the code {start.get('user_code')}")
    interval = _seconds(start.get("interval"), DEFAULT_INTERVAL_S, low=1, high=60)
    deadline = clock() + _seconds(start.get("expires_in"), 600, low=1, high=3600)
    while clock() < deadline:
        sleep(interval)
        status, answer = _post(session, f"{url}/api/v1/sso/device/token/", json={"device_code": device_code})
        if status == 200:
            return answer
        error = answer.get("error")
        if error == "authorization_pending":
            continue
        if error == "slow_down" or status == 429:  # 429: the server's own limit on polls from one address
            interval += SLOW_DOWN_S
            continue
        raise ApiError(f"single sign-on refused: {answer.get('detail') or error or status}", status=status,
                       detail=answer.get("detail", ""))
    raise ApiError("single sign-on: the code expired before the sign-in was confirmed", status=400)


def _seconds(value, default, *, low, high):
    """A wait the server names, as whole seconds within [low, high]; `default` when it names none
    that is a number (a negative interval would poll without pause, a huge one for ever)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return default
    return int(min(max(value, low), high))
