"""`--ssl DIR` as the published server's users run it: an empty (or missing) directory gets a
self-signed certificate, made with `cryptography`, that a client told to trust it verifies (a
real TLS handshake, hostname checked), reused on the next start; a pair the user brings is used
as it is; one file alone or a key that is not the certificate's is one clear line."""

from __future__ import annotations

import asyncio
import re
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from support_server import ROOT, chat, echo_similarity, openssl_pair, running_server

from personaplex_voice.errors import UserError
from personaplex_voice.process import tls

SR = 24000


def trusting(cert: Path) -> ssl.SSLContext:
    """A client context that trusts exactly this certificate and checks the host name."""
    context = ssl.create_default_context(cafile=str(cert))
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    return context


def sha256_of(cert: Path) -> str:
    der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(serialization.Encoding.DER)
    return tls.fingerprint(der)


def test_the_certificate_names_this_host_and_its_key_is_private(tmp_path):
    made = tls.ensure_certificate(tmp_path / "new" / "dir", "127.0.0.1")
    assert made.created and made.self_signed_here
    assert {"localhost", "127.0.0.1", "::1"} <= set(made.names)
    dns, ips = tls.host_names()
    assert set(dns) | set(ips) <= set(made.names)  # the host's own names and addresses too
    assert (made.key.stat().st_mode & 0o777) == 0o600
    assert made.fingerprint == sha256_of(made.cert) and re.fullmatch(
        r"([0-9A-F]{2}:){31}[0-9A-F]{2}", made.fingerprint
    )
    again = tls.ensure_certificate(tmp_path / "new" / "dir", "127.0.0.1")
    assert not again.created and again.fingerprint == made.fingerprint


def test_a_pair_the_user_brings_is_used_as_it_is(tmp_path):
    openssl_pair(tmp_path, "myhost")
    before = (tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()
    found = tls.ensure_certificate(tmp_path)
    assert not found.created and not found.self_signed_here
    assert ((tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()) == before


def test_one_file_alone_or_a_foreign_key_is_one_clear_line(tmp_path):
    first = tls.ensure_certificate(tmp_path / "a")
    other = tls.ensure_certificate(tmp_path / "b")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "cert.pem").write_bytes(first.cert.read_bytes())
    with pytest.raises(UserError, match=re.escape("cert.pem is there but key.pem is not")):
        tls.ensure_certificate(lonely)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "cert.pem").write_bytes(first.cert.read_bytes())
    (mixed / "key.pem").write_bytes(other.key.read_bytes())
    with pytest.raises(UserError, match=re.escape("do not make a pair (key.pem is not the key of cert.pem)")):
        tls.ensure_certificate(mixed)
    (mixed / "cert.pem").write_text("not a certificate")
    with pytest.raises(UserError, match=re.escape("cert.pem is not a PEM certificate")):
        tls.ensure_certificate(mixed)
    run = subprocess.run(
        [sys.executable, "-m", "personaplex_voice.cli", "serve", "--engine", "echo", "--ssl", str(lonely)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --ssl {lonely}: cert.pem is there but key.pem is not: "
        "give both, or neither (a self-signed pair is then made)"
    ]


@pytest.mark.timeout(240)
def test_serve_ssl_on_an_empty_directory_serves_wss_to_a_client_trusting_it_and_reuses_it(
    tmp_path, golden_dir
):
    ssl_dir = tmp_path / "ssl"
    ssl_dir.mkdir()
    user = sf.read(golden_dir / "user.wav", dtype="float32")[0][: 2 * SR]
    with running_server("--max-sessions", "1", "--ssl", str(ssl_dir)) as server:
        cert = ssl_dir / "cert.pem"
        assert cert.is_file() and (ssl_dir / "key.pem").is_file()
        log = server.log()
        fingerprint = sha256_of(cert)
        assert "self-signed certificate created" in log and str(cert) in log
        assert fingerprint in log and f"https://127.0.0.1:{server.port}/" in log
        context = trusting(cert)
        # https with the certificate verified (and a client that does not trust it is refused)
        with httpx.Client(verify=context) as client:
            assert client.get(f"https://localhost:{server.port}/healthz").json()["status"] == "ok"
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(server.url + "/healthz", verify=ssl.create_default_context())
        url = str(httpx.URL(server.ws_url + "/api/chat", params={"text_prompt": "Hello."}))
        result = asyncio.run(chat(url, user, ssl_context=context))
        assert result.handshake and result.errors == [] and result.close_code == 1000
        assert echo_similarity(user, result.pcm) >= 0.8
    first = cert.read_bytes(), (ssl_dir / "key.pem").read_bytes()
    with running_server("--max-sessions", "1", "--ssl", str(ssl_dir)) as server:
        assert (cert.read_bytes(), (ssl_dir / "key.pem").read_bytes()) == first
        log = server.log()
        assert "self-signed certificate reused" in log and fingerprint in log
        with httpx.Client(verify=trusting(cert)) as client:  # the same trust still holds
            assert client.get(server.url + "/readyz").status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_cluster_serves_the_certificate_made_in_a_missing_directory(tmp_path):
    ssl_dir = tmp_path / "not" / "there"
    with running_server("--workers", "1", "--engine-workers", "1", "--ssl", str(ssl_dir)) as server:
        context = trusting(ssl_dir / "cert.pem")
        with httpx.Client(verify=context) as client:
            assert client.get(server.url + "/readyz").status_code == 200
        assert "self-signed certificate created" in server.log()
        result = asyncio.run(
            chat(
                server.ws_url + "/api/chat?text_prompt=hi",
                np.zeros(SR // 2, np.float32),
                tail_s=0.2,
                ssl_context=context,
            )
        )
        assert result.handshake and result.errors == []
