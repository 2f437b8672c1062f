"""Where the platform may connect on a job's behalf.

A data store's endpoint is written by whoever wrote the manifest, but the worker that connects to it
sits inside the platform's network. Left alone, a manifest could make the worker reach the loopback
(Redis, the web server), the cloud metadata service (169.254.169.254) or any private host, and the
different errors of an open, a closed and a filtered port would make the worker a port scanner for
the researcher (SSRF). So every connection made for a data store goes through `connect()`:

- the host is resolved once, and EVERY address it resolves to must be public (not loopback,
  link-local, private, shared, multicast, unspecified or reserved, nor an IPv6 form of such an
  IPv4 address), unless the operator allows private addresses or lists the host;
- the socket is then connected to one of exactly those checked addresses, never resolving the name
  again, so a DNS answer that changes between the check and the connection (rebinding) cannot slip
  through;
- every way of not getting a connection (refused by this policy, connection refused, timeout, a
  name that does not resolve) is reported with ONE message, `UNREACHABLE`;
- with a `timeout`, it bounds the whole of it: the lookup (a name served by a slow resolver) and every
  address tried share it, and at most MAX_ADDRESSES are tried (a name with thirty addresses that
  drop connections must not hold a worker thirty timeouts long).

Django-free: jobs.datastores passes the policy built from the settings.
"""
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass, field

UNREACHABLE = ("its endpoint cannot be reached: the address is not allowed for data stores on this platform, "
               "or it does not resolve, refuses connections or does not answer")
# IPv6 prefixes that carry an IPv4 address in their last 32 bits (NAT64, RFC 6052).
NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Not public, though Python 3.11's is_global says so: the deprecated site-local prefix (still routed
# inside some networks) and the documentation prefix of RFC 9637.
NOT_PUBLIC = (ipaddress.ip_network("fec0::/10"), ipaddress.ip_network("3fff::/20"))
MAX_ADDRESSES = 4  # addresses of one name tried before giving up


class EndpointRefused(OSError):
    """No connection was made (policy, DNS, refused, timeout); the message is always UNREACHABLE."""

    def __init__(self):
        super().__init__(UNREACHABLE)


@dataclass(frozen=True)
class EgressPolicy:
    """`allow_private`: every address is allowed. `allowed`: host names (matched exactly, without
    case), IP addresses and networks (CIDR) that are allowed even though they are not public."""

    allow_private: bool = False
    allowed: tuple = ()
    _names: frozenset = field(init=False, repr=False, compare=False)
    _networks: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names, networks = set(), []
        for entry in self.allowed:
            try:
                networks.append(ipaddress.ip_network(entry.strip().strip("[]"), strict=False))
            except ValueError:
                names.add(normal_host(entry))
        object.__setattr__(self, "_names", frozenset(names))
        object.__setattr__(self, "_networks", tuple(networks))

    def host_allowed(self, host):
        return self.allow_private or normal_host(host) in self._names

    def address_allowed(self, address):
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id is not part of the address
        if self.allow_private or any(ip in network for network in self._networks):
            return True
        return all(is_public(each) for each in _meanings(ip))


def normal_host(host):
    return str(host).strip().strip("[]").rstrip(".").lower()


def is_public(ip):
    """An address anyone on the internet could reach: none of the special-purpose ranges."""
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified
                                 or any(ip in network for network in NOT_PUBLIC if network.version == ip.version))


def _meanings(ip):
    """The address and every IPv4 address it stands for (mapped, 6to4, Teredo, NAT64)."""
    yield ip
    if ip.version == 6:
        embedded = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None,
                    ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None]
        yield from (e for e in embedded if e is not None)


def checked_addresses(host, port, policy, *, timeout=None):
    """getaddrinfo() results for (host, port), every one allowed by `policy`; EndpointRefused otherwise
    (also when the lookup takes longer than `timeout` seconds).

    One disallowed address refuses the whole host: which address a connection would use is the
    resolver's choice, and a name with a public and a private address is the usual rebinding trick."""
    try:
        infos = _lookup(normal_host(host), port, timeout)
    except (OSError, UnicodeError, ValueError):
        raise EndpointRefused() from None
    if not infos:
        raise EndpointRefused()
    if not policy.host_allowed(host) and not all(policy.address_allowed(info[4][0]) for info in infos):
        raise EndpointRefused()
    return infos


def _lookup(host, port, timeout):
    """getaddrinfo() within `timeout` seconds (None: the resolver's own). The C call cannot be
    interrupted, so a bounded one runs on a thread of its own that is left to finish alone."""
    if timeout is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    answer = {}

    def ask():
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as exc:  # noqa: BLE001 - handed to the caller below
            answer["error"] = exc

    asking = threading.Thread(target=ask, name=f"resolve {host[:50]}", daemon=True)
    asking.start()
    asking.join(timeout)
    if "error" in answer:
        raise answer["error"]
    if "infos" not in answer:
        raise TimeoutError(f"resolving {host} took over {timeout:g}s")
    return answer["infos"]


def connect(host, port, policy, *, timeout=None, source_address=None, socket_options=()):
    """A TCP socket connected to one of the checked addresses of (host, port); EndpointRefused when
    none can be reached (the causes are deliberately not told apart). A numeric `timeout` bounds the
    lookup and all the addresses tried together."""
    bounded = isinstance(timeout, (int, float))  # urllib3 may pass its "default" sentinel
    deadline = time.monotonic() + timeout if bounded else None
    infos = checked_addresses(host, port, policy, timeout=timeout if bounded else None)
    for family, kind, proto, _, sockaddr in infos[:MAX_ADDRESSES]:
        left = deadline - time.monotonic() if bounded else None
        if bounded and left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if bounded:
                sock.settimeout(left)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError:
            sock.close()
    raise EndpointRefused()
