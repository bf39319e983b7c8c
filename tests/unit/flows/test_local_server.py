"""flows/stages/local_server.py's settings of the API a command talks to: for a plain http://
API, Prefect's clients build their (unused) TLS contexts from a CA file of one certificate,
not from a whole bundle; an https:// API keeps the CA file the user set, or Prefect's default."""

from __future__ import annotations

import os
import ssl

import pytest
from prefect.client.orchestration import PrefectClient
from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, temporary_settings

from flows.stages.local_server import PLAIN_HTTP_CA_FILE, api_settings, prefect_api


def test_the_plain_http_ca_file_is_one_certificate_a_tls_context_loads() -> None:
    context = ssl.create_default_context(cafile=str(PLAIN_HTTP_CA_FILE))
    assert context.cert_store_stats()["x509_ca"] == 1


def test_only_a_plain_http_api_gets_the_file() -> None:
    assert api_settings("http://127.0.0.1:4200/api") == {"PREFECT_API_URL": "http://127.0.0.1:4200/api",
                                                         "PREFECT_API_SSL_CERT_FILE": str(PLAIN_HTTP_CA_FILE)}  # fmt: skip
    assert api_settings("https://prefect.example.com/api") == {"PREFECT_API_URL": "https://prefect.example.com/api"}


def test_a_tls_api_keeps_the_users_ca_file(tmp_path) -> None:
    own = tmp_path / "company-ca.pem"
    own.write_bytes(PLAIN_HTTP_CA_FILE.read_bytes())
    url = "https://prefect.example.com/api"
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_API_SSL_CERT_FILE: str(own)}), prefect_api():
        assert PREFECT_API_SSL_CERT_FILE.value() == str(own)


def test_clients_of_a_configured_http_api_load_the_file_and_it_is_undone_after(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[str | None] = []
    original = ssl.create_default_context

    def recording(*args, cafile: str | None = None, **kwargs) -> ssl.SSLContext:
        loaded.append(cafile)
        return original(*args, cafile=cafile, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recording)
    before = os.environ.get("PREFECT_API_SSL_CERT_FILE"), PREFECT_API_SSL_CERT_FILE.value()
    url = "http://127.0.0.1:9/api"  # configured: no server is started, none is asked
    with temporary_settings(updates={PREFECT_API_URL: url}), prefect_api() as api:
        assert api == url and os.environ["PREFECT_API_SSL_CERT_FILE"] == str(PLAIN_HTTP_CA_FILE)
        PrefectClient(api)
    assert loaded == [str(PLAIN_HTTP_CA_FILE)], "the client's TLS context, from the file"
    assert (os.environ.get("PREFECT_API_SSL_CERT_FILE"), PREFECT_API_SSL_CERT_FILE.value()) == before
