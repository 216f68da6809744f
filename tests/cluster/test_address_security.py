"""The address backend refuses an open dashboard, and reaches an https one signed by a private CA."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline import auth
from verl_pipeline.cluster.address import AddressBackend
from verl_pipeline.exceptions import ClusterError, ConfigError

x509 = pytest.importorskip("cryptography.x509")


@pytest.mark.parametrize("url,mode,allowed,refused", [
    ("http://10.0.0.5:8265", "disabled", False, True),
    ("http://ray-head:8265", "disabled", False, True),
    ("http://0.0.0.0:8265", "disabled", False, True),
    ("http://10.0.0.5:8265", "disabled", True, False),   # allow_insecure: the profile says so
    ("http://10.0.0.5:8265", "token", False, False),
    ("https://ray.example.org", "disabled", False, False),
    ("http://127.0.0.1:8265", "disabled", False, False),
    ("http://127.8.0.1:8265", "disabled", False, False),
    ("http://localhost:8265", "disabled", False, False),
    ("http://[::1]:8265", "disabled", False, False),
])
def test_which_dashboards_are_refused(url: str, mode: str, allowed: bool, refused: bool) -> None:
    assert (auth.exposure_problem(url, auth.AuthMode(mode), allowed=allowed) is not None) is refused


def test_the_refusal_names_the_field_the_value_the_risk_and_the_fix() -> None:
    open_profile = {"backend": "address", "dashboard_url": "http://10.0.0.5:8265", "auth_mode": "disabled"}
    with pytest.raises(ConfigError) as e:
        AddressBackend.from_spec(open_profile)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cluster.dashboard_url='http://10.0.0.5:8265': ")
    assert "CVE-2023-48022" in msg and "anyone who can reach this port can run code" in msg
    assert "auth_mode: token" in msg and "allow_insecure: true" in msg
    AddressBackend.from_spec({**open_profile, "allow_insecure": True})
    with pytest.raises(ConfigError, match=r"cluster\.allow_insecure"):
        AddressBackend.from_spec({"backend": "address", "dashboard_url": "http://h:1", "allow_insecure": "yes"})


def test_a_profile_that_names_no_auth_mode_gets_the_projects_default() -> None:
    from verl_pipeline.cluster.local import LocalBackend
    from verl_pipeline.cluster.slurm import SlurmBackend
    from verl_pipeline.constants import DEFAULT_AUTH_MODE

    assert AddressBackend.from_spec({"backend": "address", "conn_id": "c"}).auth_mode == DEFAULT_AUTH_MODE.value
    assert LocalBackend.from_spec({"backend": "local"}).auth_mode is DEFAULT_AUTH_MODE
    assert SlurmBackend.from_spec({"backend": "slurm"}).auth_mode is DEFAULT_AUTH_MODE


def test_token_auth_without_a_token_is_refused_where_an_open_dashboard_would_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Token auth with no token sends every request without one: only an open cluster answers, so the
    profile's word (or the default) cannot stand in for the ShadowRay check."""
    monkeypatch.delenv(auth.PIPELINE_TOKEN_VAR, raising=False)
    backend = AddressBackend.from_spec({"backend": "address", "conn_id": "ray_default"})
    with pytest.raises(ConfigError) as e:
        backend.with_endpoint("http://10.0.0.5:8265", None).provision("pytest/tokenless")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cluster.auth_mode='token': no Ray token was given for http://10.0.0.5")
    assert "CVE-2023-48022" in msg and "auth_mode: disabled" in msg
    # With a token (the connection's password, or the variable) the check passes: what follows is the cluster's.
    assert backend.with_endpoint("http://10.0.0.5:8265", "t0ken")._tokenless_problem() is None
    monkeypatch.setenv(auth.PIPELINE_TOKEN_VAR, "t0ken")
    assert backend.with_endpoint("http://10.0.0.5:8265", None)._tokenless_problem() is None
    monkeypatch.delenv(auth.PIPELINE_TOKEN_VAR)
    # Where an open dashboard is accepted (loopback, https, allow_insecure), so is a token-less one.
    for url in ("http://127.0.0.1:8265", "https://ray.example.org"):
        assert backend.with_endpoint(url, None)._tokenless_problem() is None
    insecure = AddressBackend.from_spec({"backend": "address", "conn_id": "c", "allow_insecure": True})
    assert insecure.with_endpoint("http://10.0.0.5:8265", None)._tokenless_problem() is None


def test_a_url_from_the_connection_is_checked_at_provision() -> None:
    backend = AddressBackend.from_spec({"backend": "address", "conn_id": "ray_default", "auth_mode": "disabled"})
    with pytest.raises(ConfigError, match=r"auth_mode is disabled.*CVE-2023-48022"):
        backend.with_endpoint("http://ray-head:8265", None).provision("pytest/open")


# -- https with a private CA ---------------------------------------------------------------------
def _certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, server.pem, server.key)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> Any:
        return x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("pytest CA")).issuer_name(name("pytest CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


_JOB = {"submission_id": "job-1", "status": "SUCCEEDED", "entrypoint": "true", "message": "done"}
_NODES = {"data": {"summary": [{"ip": "127.0.0.1", "raylet": {"nodeId": "n1", "state": "ALIVE", "isHeadNode": True,
                                                               "resourcesTotal": {"CPU": 2.0}}}]}}


class _Dashboard(BaseHTTPRequestHandler):
    """The few Jobs API answers the client reads, over TLS."""

    seen: list[str] = []

    def _send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append(f"GET {self.path}")
        if self.path == "/api/version":
            self._send({"ray_version": "2.60.0", "version": "4"})
        elif self.path.startswith("/nodes"):
            self._send(_NODES)
        elif self.path == "/api/jobs/job-1":
            self._send(_JOB)
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        self.seen.append(f"POST {self.path}")
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send({"submission_id": "job-2", "job_id": "job-2"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def https_dashboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    ca, cert, key = _certs(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Dashboard.seen = []
    yield f"https://127.0.0.1:{server.server_address[1]}", ca
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_https_dashboard_with_the_connections_ca_bundle(https_dashboard: tuple[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       request: pytest.FixtureRequest) -> None:
    from airflow.sdk import BaseHook
    from ray._raylet import AuthenticationTokenLoader

    # Ray reads its auth mode once per process: after the token clusters of earlier tests its SDK
    # wants a token even for this auth-disabled dashboard. A throwaway one satisfies it (the test's
    # dashboard ignores it); Ray's token cache is cleared again after the test.
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    AuthenticationTokenLoader.instance().reset_cache()
    request.addfinalizer(AuthenticationTokenLoader.instance().reset_cache)

    from verl_pipeline.airflow.hooks import endpoint_from_connection

    url, ca = https_dashboard
    port = int(url.rsplit(":", 1)[1])
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(
        {"conn_type": "http", "schema": "https", "host": "127.0.0.1", "port": port, "extra": {"ca_bundle": str(ca)}}))
    endpoint = endpoint_from_connection(BaseHook.get_connection("ray_default"))
    assert endpoint == (url, None, str(ca))
    backend = AddressBackend.from_spec({"backend": "address", "conn_id": "ray_default", "ready_timeout_s": 1})
    # Without the CA the certificate is not trusted: the cluster never becomes ready.
    with pytest.raises(ClusterError, match="CERTIFICATE_VERIFY_FAILED"):
        backend.with_endpoint(url, None).provision("pytest/https")
    handle = backend.with_endpoint(*endpoint).provision("pytest/https")
    assert handle.ca_bundle == str(ca) and json.loads(json.dumps(handle.to_dict()))["ca_bundle"] == str(ca)
    client = handle.client()
    assert client.version()["ray_version"] == "2.60.0"
    assert client.submit(entrypoint="true", submission_id="job-2", runtime_env={}) == "job-2"  # Ray's SDK

    async def from_the_trigger() -> Any:  # the hook the trigger uses: aiohttp with the same CA
        from verl_pipeline.airflow.hooks import RayJobsHook

        async with RayJobsHook(handle.to_dict()) as hook:
            return await hook.aget_job("job-1")

    info = asyncio.run(from_the_trigger())
    assert info is not None and info.status.value == "SUCCEEDED"
    assert "POST /api/jobs/" in _Dashboard.seen and "GET /api/jobs/job-1" in _Dashboard.seen


def test_a_missing_ca_bundle_is_a_clear_error(tmp_path: Path) -> None:
    backend = AddressBackend.from_spec({"backend": "address", "conn_id": "ray_default"})
    with pytest.raises(ClusterError, match=r"ca_bundle=.*no such CA file"):
        backend.with_endpoint("https://ray.example.org", None, str(tmp_path / "nope.pem")).provision("x")
