"""A TCP proxy between the learner agents and the web server, which a chaos test can cut.

The platform advertises the proxy as its public URL, so every agent's ingest connection goes
through it. `cut(downtime)` is what a dying link looks like to the agent: every open connection is
reset on the spot (a request may be half sent, or stored with its response lost), and for
`downtime` seconds new connections are reset as soon as they are accepted.

One thread does all the I/O (selectors), so a reset is a plain close with SO_LINGER 0 that no other
thread's blocked recv() can delay.
"""
import selectors
import socket
import struct
import threading
import time


class CuttableProxy:
    def __init__(self, upstream_port, *, host="127.0.0.1"):
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._peers = {}  # socket -> the socket at the other end of its connection
        self._half_closed = set()  # sockets whose sender has finished (EOF read)
        self._down_until = 0.0
        self._cut_pending = False
        self._closing = False
        self._lock = threading.Lock()
        self.connections = 0  # accepted while up: shows the agents really come through here
        self.resets = 0  # connections reset by cuts
        self._thread = threading.Thread(target=self._loop, name="chaos-proxy", daemon=True)
        self._thread.start()

    def cut(self, downtime):
        """Reset every open connection now and refuse new ones for `downtime` seconds."""
        with self._lock:
            self._down_until = time.monotonic() + downtime
            self._cut_pending = True
        self._wake_w.send(b"x")

    def close(self):
        self._closing = True
        self._wake_w.send(b"x")
        self._thread.join(5)
        self._listener.close()

    # --- the I/O thread ----------------------------------------------------------------------------
    def _loop(self):
        while not self._closing:
            for key, _ in self._selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(4096)
                elif key.fileobj in self._peers:  # may have been reset earlier in this round
                    self._forward(key.fileobj)
            with self._lock:
                cut, self._cut_pending = self._cut_pending, False
            if cut:
                self.resets += len(self._peers) // 2
                for sock in list(self._peers):
                    self._drop(sock)
        for sock in list(self._peers):
            self._drop(sock)

    def _accept(self):
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        with self._lock:
            down = time.monotonic() < self._down_until
        if down:
            _reset(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=2)
        except OSError:  # the web server is down: the agent sees its connection reset
            _reset(client)
            return
        self.connections += 1
        for sock in (client, server):
            sock.settimeout(5)  # sendall to a peer that stopped reading must not hang the proxy
        self._peers[client], self._peers[server] = server, client
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(server, selectors.EVENT_READ)

    def _forward(self, source):
        target = self._peers[source]
        try:
            data = source.recv(65536)
            if data:
                target.sendall(data)
                return
            # EOF: pass the half-close on, so an HTTP connection ends the way its peer ended it.
            self._selector.unregister(source)
            self._half_closed.add(source)
            target.shutdown(socket.SHUT_WR)
            if target in self._half_closed:
                self._drop(source, reset=False)
        except OSError:
            self._drop(source)

    def _drop(self, sock, *, reset=True):
        """Close one connection, both ends (with an RST unless it ended cleanly)."""
        peer = self._peers.pop(sock, None)
        for end in (sock, peer):
            if end is None:
                continue
            self._peers.pop(end, None)
            self._half_closed.discard(end)
            try:
                self._selector.unregister(end)
            except (KeyError, ValueError):
                pass
            if reset:
                _reset(end)
            else:
                end.close()


def _reset(sock):
    """Close with an RST rather than a FIN: the peer sees 'connection reset', as when a link dies."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
