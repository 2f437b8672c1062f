"""A real OpenID provider for the single sign-on tests: panva's certified `oidc-provider`
(tests/support/oidc_provider/provider.js) run by node as its own process, with a client for
Trainyard, people whose groups a test rewrites, and the device flow on.

The signing key is made here and handed to the provider, so a test can also sign tokens with the
provider's own key (for another audience, expired) or with a stranger's; `sign_in` walks the
provider's sign-in pages with plain HTTP, as a person's browser would.
"""
import json
import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import jwt
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from portal.runner import free_port
from tests.support.optional import skip_or_fail

PROVIDER_DIR = Path(__file__).resolve().parent / "oidc_provider"
CLIENT_ID, CLIENT_SECRET = "trainyard", "trainyard-test-secret-that-is-long-enough"


def rsa_jwk(kid):
    """(private JWK dict, PEM of the private key) of a fresh RSA key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return {**jwk, "kid": kid, "use": "sig", "alg": "RS256"}, pem


class Provider:
    def __init__(self, workdir, *, redirect_uris, accounts):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.jwk, self.private_pem = rsa_jwk("test-key-1")
        self.redirect_uris = list(redirect_uris)
        self.accounts_path = self.workdir / "accounts.json"
        self.set_accounts(accounts)
        self.process = None

    def set_accounts(self, accounts):
        """Who exists and in which groups, e.g. {"carol": {"groups": ["ml-vision"]}}; read at every use."""
        temporary = self.accounts_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(accounts))
        temporary.replace(self.accounts_path)

    def start(self):
        node = shutil.which("node")
        if node is None:
            skip_or_fail("node is not installed (the tests' OpenID provider runs on it)")
        version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
        if tuple(int(part) for part in re.findall(r"\d+", version)[:2]) < (20, 19):
            skip_or_fail(f"node {version} is too old for oidc-provider 9 (20.19 or later)")
        if not (PROVIDER_DIR / "node_modules" / "oidc-provider").is_dir():
            skip_or_fail(f"oidc-provider is not installed: run `npm ci` in {PROVIDER_DIR}")
        (self.workdir / "jwks.json").write_text(json.dumps({"keys": [self.jwk]}))
        (self.workdir / "clients.json").write_text(json.dumps([{
            "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "redirect_uris": self.redirect_uris,
            "grant_types": ["authorization_code", "refresh_token", "urn:ietf:params:oauth:grant-type:device_code"],
            "response_types": ["code"], "token_endpoint_auth_method": "client_secret_basic"}]))
        env = dict(os.environ, OIDC_PORT=str(self.port), OIDC_JWKS=str(self.workdir / "jwks.json"),
                   OIDC_CLIENTS=str(self.workdir / "clients.json"), OIDC_ACCOUNTS=str(self.accounts_path))
        self.log = open(self.workdir / "provider.log", "w")
        self.process = subprocess.Popen([node, str(PROVIDER_DIR / "provider.js")], env=env, cwd=PROVIDER_DIR,
                                        stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(self.issuer + "/.well-known/openid-configuration", timeout=2).ok:
                    return self
            except requests.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenID provider did not start: {(self.workdir / 'provider.log').read_text()}")
            time.sleep(0.1)

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None):
            self.log.close()

    @property
    def discovery(self):
        return requests.get(self.issuer + "/.well-known/openid-configuration", timeout=10).json()

    def settings(self, **more):
        """Django settings that point Trainyard at this provider."""
        return {"OIDC_ISSUER": self.issuer, "OIDC_CLIENT_ID": CLIENT_ID, "OIDC_CLIENT_SECRET": CLIENT_SECRET,
                **more}

    def id_token(self, *, key_pem=None, kid="test-key-1", algorithm="RS256", **claims):
        """An ID token as this provider would sign it (with its own key unless `key_pem` is another)."""
        now = int(time.time())
        payload = {"iss": self.issuer, "aud": CLIENT_ID, "sub": "carol", "iat": now, "exp": now + 300, **claims}
        payload = {name: value for name, value in payload.items() if value is not None}
        return jwt.encode(payload, key_pem or self.private_pem, algorithm=algorithm, headers={"kid": kid})


class _Forms(HTMLParser):
    """The forms of an HTML page: [(action, method, {name: value})]."""

    def __init__(self):
        super().__init__()
        self.forms = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form":
            self.forms.append((attrs.get("action") or "", (attrs.get("method") or "get").lower(), {}))
        elif tag in ("input", "button") and self.forms and attrs.get("name"):
            self.forms[-1][2].setdefault(attrs["name"], attrs.get("value") or "")


def forms_of(html):
    parser = _Forms()
    parser.feed(html)
    return parser.forms


def sign_in(session, url, login, *, stop_at=None, max_steps=20):
    """Follow `url` through the provider's pages as `login` (any password), submitting each page's form,
    until a redirect leaves for `stop_at` (that URL returned, unvisited) or a page has no form (returned)."""
    response = session.get(url, allow_redirects=False, timeout=10)
    for _ in range(max_steps):
        if response.is_redirect:
            url = urljoin(response.url, response.headers["Location"])
            if stop_at and url.startswith(stop_at):
                return url
            response = session.get(url, allow_redirects=False, timeout=10)
            continue
        forms = forms_of(response.text)
        if not forms:
            return response
        action, method, fields = forms[0]
        if "login" in fields:
            fields.update(login=login, password="any password")
        fields.pop("abort", None)  # the device flow's confirmation: Continue, not Abort
        response = session.request(method.upper(), urljoin(response.url, action), data=fields,
                                   allow_redirects=False, timeout=10)
    raise AssertionError(f"the provider's pages did not end in {max_steps} steps; last: {response.url}")


def complete_device_flow(verification_uri_complete, login):
    """Enter a user code at the provider as `login` would; the final page's text."""
    response = sign_in(requests.Session(), verification_uri_complete, login)
    return re.sub(r"<[^>]+>", " ", response.text)
