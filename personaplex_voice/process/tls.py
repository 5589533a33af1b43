"""`--ssl DIR`: the certificate and key the server presents (https and wss).

As the published server's users run it (`SSL_DIR=$(mktemp -d); ... --ssl "$SSL_DIR"`): a
directory with neither `cert.pem` nor `key.pem` (or no directory at all) gets a self-signed
certificate made here with the `cryptography` package (no download, no openssl binary), for the
names a client may use: localhost, 127.0.0.1, ::1, this host's names and addresses, and the
address the server binds. The next start finds the pair and uses it again, so a browser or
client that trusts it once keeps trusting it. A pair the user brings is used exactly as it is;
one file without the other, or a certificate whose key is not the one beside it, stops the
server with one line. Each start logs the certificate's path, its SHA-256 fingerprint (what a
user compares before trusting it) and the https URL.

docs/server.md and docs/browser.md say how to trust it or bring a real one.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from personaplex_voice.errors import UserError

log = logging.getLogger("personaplex_voice.tls")

CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
VALID_DAYS = 365
# The certificates made here say so in their subject (and the log says which kind is in use).
ISSUER_ORGANIZATION = "personaplex-voice self-signed"


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path
    fingerprint: str  # SHA-256 of the DER certificate, colon-separated hex (as browsers show it)
    names: tuple[str, ...]  # the subject alternative names
    not_after: datetime.datetime
    created: bool  # made by this start (else found in the directory)
    self_signed_here: bool  # made by personaplex-voice (now or at an earlier start)


def host_names(bind_host: str | None = None) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a client on this host or the network may use to reach it."""
    dns = ["localhost"]
    ips = ["127.0.0.1", "::1"]
    for name in (socket.gethostname(), socket.getfqdn()):
        if name and name not in dns and not _is_ip(name):
            dns.append(name)
    for name in list(dns[1:]):
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(name, None):
                address = str(info[4][0]).split("%")[0]
                if address not in ips:
                    ips.append(address)
    if bind_host and bind_host not in ("0.0.0.0", "::", ""):
        if _is_ip(bind_host):
            if bind_host not in ips:
                ips.append(bind_host)
        elif bind_host not in dns:
            dns.append(bind_host)
    return dns, ips


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def fingerprint(der: bytes) -> str:
    import hashlib

    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def create_self_signed(directory: Path, bind_host: str | None = None) -> None:
    """A new EC P-256 key and a self-signed certificate for this host's names, in `directory`
    (the key readable by its owner only; each file written whole, then renamed into place)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    dns, ips = host_names(bind_host)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, dns[1] if len(dns) > 1 else dns[0]),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ISSUER_ORGANIZATION),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    alternative = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        # Its own trust anchor: a client told to trust this file (cafile, a browser's authority
        # list, the system store) accepts it as the root of its one-certificate chain.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(directory / KEY_FILE, key_pem, 0o600)
    _write(directory / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    partial = path.with_name(f".{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(partial, mode)
    os.replace(partial, path)


def describe(cert_path: Path, key_path: Path, *, created: bool) -> Certificate:
    """The certificate's facts; `UserError` (one line) when the pair cannot serve TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--ssl {cert_path.parent}: {cert_path.name} is not a PEM certificate ({exc})"
        ) from None
    # What uvicorn will do with the pair: a key that is not the certificate's fails here, in words.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert_path), str(key_path))
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc):
            reason = f"{key_path.name} is not the key of {cert_path.name}"
        raise UserError(
            f"--ssl {cert_path.parent}: {cert_path.name} and {key_path.name} do not make a pair ({reason})"
        ) from None
    except OSError as exc:
        raise UserError(f"--ssl {cert_path.parent}: cannot read {key_path.name} ({exc})") from None
    try:
        names_ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(str(n.value) for n in names_ext)
    except x509.ExtensionNotFound:
        names = ()
    organizations = cert.subject.get_attributes_for_oid(x509.oid.NameOID.ORGANIZATION_NAME)
    return Certificate(
        cert=cert_path,
        key=key_path,
        fingerprint=fingerprint(cert.public_bytes(serialization.Encoding.DER)),
        names=names,
        not_after=cert.not_valid_after_utc,
        created=created,
        self_signed_here=any(o.value == ISSUER_ORGANIZATION for o in organizations),
    )


def ensure_certificate(directory: Path, bind_host: str | None = None) -> Certificate:
    """The pair in `directory`: found and checked, or made there when neither file exists."""
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--ssl {directory}: not a directory")
    have_cert, have_key = cert_path.is_file(), key_path.is_file()
    if have_cert != have_key:
        present, absent = (CERT_FILE, KEY_FILE) if have_cert else (KEY_FILE, CERT_FILE)
        raise UserError(
            f"--ssl {directory}: {present} is there but {absent} is not: give both, or neither "
            "(a self-signed pair is then made)"
        )
    created = not have_cert
    if created:
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            create_self_signed(directory, bind_host)
        except OSError as exc:
            raise UserError(f"--ssl {directory}: cannot write a certificate there ({exc})") from None
    return describe(cert_path, key_path, created=created)


def https_url(host: str, port: int) -> str:
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"https://{shown}:{port}/"


def prepare(settings: object, port: int | None = None) -> Certificate | None:
    """For a server's settings (`ssl`, `host`, `port`; `port` given when it was chosen later):
    the certificate to serve, logged; None without `--ssl`."""
    directory = getattr(settings, "ssl", None)
    if directory is None:
        return None
    found = ensure_certificate(Path(directory), getattr(settings, "host", None))
    url = https_url(str(getattr(settings, "host", "")), port or int(getattr(settings, "port", 0)))
    if found.created:
        what = "self-signed certificate created"
    elif found.self_signed_here:
        what = "self-signed certificate reused"
    else:
        what = "certificate"
    log.info(
        "TLS: %s: %s (key %s), SHA-256 fingerprint %s, valid until %s, for %s; serving %s",
        what,
        found.cert,
        found.key.name,
        found.fingerprint,
        found.not_after.date().isoformat(),
        ", ".join(found.names) or "(no alternative names)",
        url,
    )
    if found.self_signed_here:
        log.info(
            "TLS: browsers warn about a self-signed certificate until it is trusted: compare the "
            "fingerprint above and accept it, or import %s (docs/browser.md)",
            found.cert,
        )
    if found.not_after < datetime.datetime.now(datetime.UTC):
        log.warning("TLS: %s expired on %s: clients will refuse it", found.cert, found.not_after.date())
    return found
