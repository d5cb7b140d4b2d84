"""A real S3-compatible HTTP server on 127.0.0.1 for tests and benchmarks: moto's server mode.

``S3TestServer`` runs moto's WSGI application (S3 and IAM) in a thread of this process behind a
small middleware that

* counts requests per (method, path) and the body bytes of GET responses, on the server side;
* can throttle GET bodies (``throttle``) so that a download lasts long enough to be killed;
* can take the server down when a chosen request arrives (``outage_on``): that request's
  connection is dropped mid-body, the listening socket is closed (new connections are refused)
  and the server comes back on the same port after a few seconds. Objects survive: moto keeps
  its state in this process.

Authentication is on: the server makes an IAM user with an S3 policy and an access key at start;
requests signed with anything else are refused with HTTP 403, as a real endpoint does.
Only 127.0.0.1 is used; nothing leaves the machine.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Aborted(ConnectionAbortedError):
    """Raised inside a response body: werkzeug drops the connection mid-transfer."""


class S3TestServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._requests: collections.Counter = collections.Counter()
        self.log: list[tuple[str, str]] = []   # (method, path) of every request, in order
        self._get_bytes: collections.Counter = collections.Counter()
        self._generation = 0            # bumped by stop(): older streaming bodies abort
        self._throttle: Optional[tuple[float, Callable[[str], bool]]] = None
        self._outage: Optional[tuple[str, str, float]] = None
        self.outages = 0                # outages that happened
        self.access_key_id = self.secret_access_key = ""

    # -- life cycle --------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3TestServer":
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # one line per request otherwise
        app = DomainDispatcherApplication(create_backend_app)
        deadline = time.time() + 10
        while True:  # the port of a just-closed server may take a moment to be free again
            try:
                self._server = make_server("127.0.0.1", self.port, self._middleware(app),
                                           threaded=True, request_handler=MotoRequestHandler)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        if not self.access_key_id:
            self._enable_auth()
        return self

    def __enter__(self) -> "S3TestServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering: in-flight bodies break off, new connections are refused."""
        with self._lock:
            self._generation += 1
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def _enable_auth(self) -> None:
        import boto3
        import moto.settings
        from moto.core.responses import ActionAuthenticatorMixin

        # moto keeps its state (and this switch) per process: an earlier server may have left
        # authentication on, and its user behind.
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")
        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=REGION,
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        user = f"slmoe-test-{self.port}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self.access_key_id, self.secret_access_key = key["AccessKeyId"], key["SecretAccessKey"]
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on every request is checked
        ActionAuthenticatorMixin.request_count = 0

    # -- what clients need -------------------------------------------------------------------------

    def env(self, secret: Optional[str] = None, key_id: Optional[str] = None) -> dict[str, str]:
        """Environment of a process that talks to this server (optionally with other credentials)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key_id or self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret_access_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",   # never ask 169.254.169.254
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "MSC_CONFIG": os.devnull,
        }

    def client(self):
        """A boto3 S3 client with the server's credentials (to set up and inspect buckets)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key_id,
                            aws_secret_access_key=self.secret_access_key)

    def upload_folder(self, bucket: str, prefix: str, folder) -> list[str]:
        """Every file under ``folder`` put as ``prefix`` + its relative path, in path order;
        returns the keys."""
        client, keys = self.client(), []
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            keys.append(f"{prefix}{path.relative_to(folder).as_posix()}")
            client.put_object(Bucket=bucket, Key=keys[-1], Body=path.read_bytes())
        return keys

    # -- counters ----------------------------------------------------------------------------------

    def requests(self, method: Optional[str] = None, path: Optional[str] = None) -> int:
        """Requests received (answered or not), by method and exact path (``/bucket/key``)."""
        with self._lock:
            return sum(n for (m, p), n in self._requests.items()
                       if (method is None or m == method) and (path is None or p == path))

    def get_bytes(self, path_prefix: str = "/") -> int:
        """Body bytes sent in GET responses under a path prefix (``/bucket/...``)."""
        with self._lock:
            return sum(n for p, n in self._get_bytes.items() if p.startswith(path_prefix))

    def reset_counts(self) -> None:
        with self._lock:
            self._requests.clear()
            self._get_bytes.clear()
            self.log.clear()

    # -- faults ------------------------------------------------------------------------------------

    def throttle(self, bytes_per_s: Optional[float], path_contains: str = "") -> None:
        """Send GET bodies whose path contains ``path_contains`` at about this rate (None: off)."""
        with self._lock:
            self._throttle = None if bytes_per_s is None else (
                float(bytes_per_s), lambda p: path_contains in p)

    def outage_on(self, method: str, path_contains: str, seconds: float) -> None:
        """On the next ``method`` request whose path contains ``path_contains``: drop it after
        part of its body, go down for ``seconds`` (connections refused), come back."""
        with self._lock:
            self._outage = (method, path_contains, seconds)

    def _take_outage(self, method: str, path: str) -> Optional[float]:
        with self._lock:
            if self._outage and self._outage[0] == method and self._outage[1] in path:
                seconds = self._outage[2]
                self._outage = None
                return seconds
        return None

    def _go_down(self, seconds: float) -> None:
        self.stop()
        self.outages += 1
        time.sleep(seconds)
        self.start()

    # -- the middleware ----------------------------------------------------------------------------

    def _middleware(self, app):
        def counted(environ, start_response):
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            with self._lock:
                self._requests[(method, path)] += 1
                self.log.append((method, path))
                generation = self._generation
                throttle = self._throttle
            outage = self._take_outage(method, path)
            body = app(environ, start_response)
            if method != "GET" and outage is None:
                return body
            return self._stream(body, path, generation,
                                throttle if throttle and throttle[1](path) else None, outage)

        return counted

    def _stream(self, body, path: str, generation: int, throttle, outage: Optional[float]):
        try:
            pieces = [block[i:i + 16384] for block in body for i in range(0, len(block), 16384)]
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        # An outage cuts the body halfway (the client sees a truncated transfer); a body too
        # short to cut fails before its first byte (werkzeug then answers HTTP 500).
        cut = len(pieces) // 2 if outage is not None else None
        for index, piece in enumerate(pieces):
            if index == cut:
                threading.Thread(target=self._go_down, args=(outage,), daemon=True).start()
                raise _Aborted("simulated outage")
            with self._lock:
                if self._generation != generation:
                    raise _Aborted("server stopped")
                self._get_bytes[path] += len(piece)
            yield piece
            if throttle is not None:
                time.sleep(len(piece) / throttle[0])
        if cut == 0:  # an empty body
            threading.Thread(target=self._go_down, args=(outage,), daemon=True).start()
            raise _Aborted("simulated outage")
