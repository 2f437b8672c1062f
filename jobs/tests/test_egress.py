"""Data-store endpoints (jobs.egress): a manifest cannot make the worker reach the platform's own
network, and every way of not reaching an endpoint reads the same (no port scanner)."""
import ipaddress
import socket
import time

import pytest

from jobs import datastores, egress
from jobs.datastores import DataStoreError, Location, S3Store
from jobs.egress import EgressPolicy
from portal.runner import free_port
from tests.support.s3_server import s3_server

STRICT = EgressPolicy()


@pytest.fixture(scope="module")
def s3():
    with s3_server({"egress-bucket": {"inputs/a.csv": b"1,2\n"}}) as server:
        yield server


@pytest.fixture
def no_private_connects(monkeypatch):
    """Fails the test if anything connects to a non-public address (the policy must refuse first)."""
    real = socket.socket.connect
    attempts = []

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host and not egress.is_public(ipaddress.ip_address(host.split("%")[0])):
            attempts.append(address)
            raise AssertionError(f"connected to {address} before the policy refused it")
        return real(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.5.4", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("::", False), ("fe80::1", False),
    ("fc00::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False),
    ("2002:7f00:1::", False), ("64:ff9b::a00:1", False), ("fe80::1%eth0", False),
    ("fec0::1", False), ("3fff::1", False),  # site-local, documentation: is_global says public on 3.11
])
def test_it_allows_only_public_addresses_by_default(address, public):
    assert STRICT.address_allowed(address) is public


def test_the_operator_can_allow_private_addresses_hosts_and_networks():
    assert EgressPolicy(allow_private=True).address_allowed("127.0.0.1")
    policy = EgressPolicy(allowed=("10.0.5.0/24", "minio.internal", "[::1]"))
    assert policy.address_allowed("10.0.5.7") and not policy.address_allowed("10.0.6.7")
    assert policy.address_allowed("::1")
    assert policy.host_allowed("MinIO.Internal.") and not policy.host_allowed("other.internal")


@pytest.mark.parametrize("endpoint", [
    "http://127.0.0.1:{open}",  # the S3 server itself: an open port
    "http://127.0.0.1:1",  # a closed port
    "http://169.254.169.254",  # cloud metadata
    "http://10.0.0.1",  # a private host (never actually connected to)
    "http://[::1]:{open}",
    "http://localhost:{open}",  # a name that resolves to the loopback
    "http://[::ffff:127.0.0.1]:{open}",
    "http://no-such-host.invalid",  # does not resolve
])
def test_every_unreachable_endpoint_fails_with_one_message_before_connecting(s3, tmp_path, no_private_connects,
                                                                              endpoint):
    open_port = s3[0].rsplit(":", 1)[1]
    _, key, secret = s3
    store = S3Store("egress-bucket", endpoint=endpoint.format(open=open_port), access_key=key, secret_key=secret,
                    name="lake", egress=STRICT)
    with pytest.raises(DataStoreError) as error:
        datastores.fetch(Location(store, "inputs", "lake"), tmp_path / "data")
    assert str(error.value) == f"data store 'lake': {egress.UNREACHABLE}"
    assert no_private_connects == []


def test_a_closed_port_of_an_allowed_host_reads_the_same_as_a_refused_host(tmp_path):
    allowed = EgressPolicy(allowed=("127.0.0.1",))
    store = S3Store("b", endpoint=f"http://127.0.0.1:{free_port()}", access_key="a", secret_key="b", name="lake",
                    egress=allowed)
    with pytest.raises(DataStoreError) as error:
        datastores.fetch(Location(store, "", "lake"), tmp_path / "data")
    assert str(error.value) == f"data store 'lake': {egress.UNREACHABLE}"
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "m.bin").write_bytes(b"m")
    with pytest.raises(DataStoreError) as error:  # uploading reads the same
        datastores.push({"results": tmp_path / "results"}, Location(store, "job-1", "lake"))
    assert str(error.value) == f"data store 'lake': {egress.UNREACHABLE}"


def test_an_allowed_host_works_through_the_guarded_connections(s3, tmp_path):
    endpoint, key, secret = s3
    store = S3Store("egress-bucket", endpoint=endpoint, access_key=key, secret_key=secret, name="lake",
                    egress=EgressPolicy(allowed=("127.0.0.1",)))
    assert datastores.fetch(Location(store, "inputs", "lake"), tmp_path / "data") == (1, 4)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "m.bin").write_bytes(b"m")
    datastores.push({"results": tmp_path / "results"}, Location(store, "job-1", "lake"))
    assert [o.key for o in store.list("job-1")] == ["job-1/results/m.bin"]


def test_a_name_that_rebinds_to_the_loopback_after_the_check_is_refused(s3, tmp_path, monkeypatch):
    """The first answer is public (the endpoint check passes), later ones point at the S3 server on
    the loopback: the connection uses only addresses it checked itself, so it is refused."""
    endpoint, key, secret = s3
    port = int(endpoint.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    answers = iter([[(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]])

    def rebinding(host, *args, **kwargs):
        if host == "rebind.example":
            return next(answers, None) or real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    store = S3Store("egress-bucket", endpoint=f"http://rebind.example:{port}", access_key=key, secret_key=secret,
                    name="lake", egress=STRICT)
    with pytest.raises(DataStoreError, match="cannot be reached"):
        datastores.fetch(Location(store, "inputs", "lake"), tmp_path / "data")


def test_a_manifest_store_never_uses_the_platforms_aws_configuration(s3, monkeypatch):
    """AWS_ENDPOINT_URL and AWS_* keys are the platform's own storage: a job's store without an
    endpoint or credentials must not fall back to them."""
    endpoint, key, secret = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = S3Store("egress-bucket", name="lake", egress=STRICT)
    assert store.client.meta.endpoint_url.startswith("https://s3.")
    assert store.client._request_signer._credentials is None  # unsigned: no credentials looked up
    platform = S3Store("egress-bucket", name="platform")  # the platform's own storage still uses them
    assert platform.client.meta.endpoint_url == endpoint


def test_location_holds_s3_stores_to_the_policy():
    spec = {"id": "lake", "type": "s3_datastore", "training_data": {"container": "b/p"},
            "connection": {"auth_url": "http://169.254.169.254"}}
    found = datastores.location(spec, "training_data", {}, data_root="/nonexistent", tenant="t", egress=STRICT)
    assert found.store.egress is STRICT


# --- one deadline for connecting ---------------------------------------------------------------------
@pytest.fixture
def dropping_port():
    """A port on 127.0.0.1 whose listener's accept queue is full: the kernel drops new connections,
    as a filtered address on the internet does."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.2)
    yield port
    for filler in fillers:
        filler.close()
    server.close()


def resolving(monkeypatch, name, answer):
    """getaddrinfo() answers `answer()` for `name` (a name served by whoever wrote the endpoint)."""
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, port, *a, **k: answer(port) if host == name else real(host, port, *a, **k))


def test_a_name_with_many_addresses_that_drop_connections_takes_one_timeout_in_all(monkeypatch, dropping_port):
    resolving(monkeypatch, "many.example", lambda port: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))] * 30)
    began = time.monotonic()
    with pytest.raises(egress.EndpointRefused):
        egress.connect("many.example", dropping_port, EgressPolicy(allow_private=True), timeout=1.0)
    assert time.monotonic() - began < 1.8


def test_a_slow_lookup_counts_against_the_timeout(monkeypatch):
    def slow(port):
        time.sleep(3)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
    resolving(monkeypatch, "slow.example", slow)
    began = time.monotonic()
    with pytest.raises(egress.EndpointRefused):
        egress.connect("slow.example", 9, EgressPolicy(allow_private=True), timeout=0.5)
    assert time.monotonic() - began < 1.5


def test_the_library_internals_the_guard_relies_on_are_where_it_expects_them():
    """A canary: datastores._guard_connections replaces botocore's pool classes (its one private layout)
    with pools whose connections override urllib3's _new_conn; pyproject.toml pins both to the minor
    version this was checked against, and a change past it fails here, not in a user's download."""
    import boto3
    from botocore.awsrequest import AWSHTTPConnection
    from importlib.metadata import version

    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                          aws_access_key_id="k", aws_secret_access_key="s")
    assert set(client._endpoint.http_session._pool_classes_by_scheme) == {"http", "https"}
    connection = AWSHTTPConnection("example.org", 80)
    assert callable(connection._new_conn) and connection._dns_host == "example.org"
    assert version("botocore").split(".")[:2] == ["1", "44"] and version("urllib3").split(".")[0] == "2"
