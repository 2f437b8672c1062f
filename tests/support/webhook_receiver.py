"""A real HTTP receiver on 127.0.0.1 for the webhook tests: records every POST (headers, body) and
answers 200, or sleeps first (a slow receiver), or trickles its answer one byte every `trickle_s`
seconds for as long as the sender listens (each byte well within any read timeout). It can be stopped and started again on the same port
(a receiver that is down refuses connections)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from notifications import delivery


class Receiver:
    def __init__(self, *, delay_s=0.0, port=0, trickle_s=None):
        self.received, self.delay_s, self.port, self._server = [], delay_s, port, None
        self.trickle_s = trickle_s
        self.trickling = 0  # answers being trickled right now
        self.trickled = []  # how long each trickled answer went on before the sender hung up (s)
        self._lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/hook?x=1"

    def start(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(receiver.delay_s)
                with receiver._lock:
                    receiver.received.append((dict(self.headers), body))
                if receiver.trickle_s is not None:
                    return self.trickle()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def trickle(self):
                with receiver._lock:
                    receiver.trickling += 1
                began = time.monotonic()
                try:  # a status line, then a header that never ends, until the sender hangs up
                    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100_000:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(receiver.trickle_s)
                except OSError:
                    pass
                finally:
                    with receiver._lock:
                        receiver.trickling -= 1
                        receiver.trickled.append(time.monotonic() - began)
                    self.close_connection = True

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def events(self, secret):
        """[(payload, headers)] of every POST, each signature checked with `secret` (AssertionError if one is wrong)."""
        with self._lock:
            received = list(self.received)
        out = []
        for headers, body in received:
            assert delivery.verify(secret, headers[delivery.TIMESTAMP_HEADER], body,
                                   headers[delivery.SIGNATURE_HEADER]), "a bad signature"
            out.append((json.loads(body), headers))
        return out
