"""TLS between clients and agents: loading, checking and making certificates.

An agent bound beyond loopback serves TLS (gRPC's SSL credentials) with
``--tls-cert``/``--tls-key``; with ``--tls-client-ca`` it also requires every
client to present a certificate signed by that CA (mutual TLS). Clients trust
agents signed by ``--tls-ca`` and, for mutual TLS, present ``--tls-cert``/
``--tls-key``.

Certificates are checked when loaded, so an expired or not-yet-valid one, a
key that does not belong to its certificate, or a file that is not PEM is
refused with the fix before anything listens or connects, instead of
surfacing later as an opaque handshake failure.

``make_session`` creates a throw-away CA, one server certificate and one client
certificate (ECDSA P-256, valid for a day): the ``--slurm`` session uses it so
every attach has its own keys, and the tests make their certificates with it.
The PEM texts can also travel in the environment (``RANKSCOPE_TLS_*_PEM``),
which only the owner and root can read, so no key is written to a shared disk.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError
from rankscope.wire.tokens import private_file_problem

# Environment variables holding PEM text; used by an agent given no --tls-* files.
ENV_CERT = "RANKSCOPE_TLS_CERT_PEM"
ENV_KEY = "RANKSCOPE_TLS_KEY_PEM"
ENV_CLIENT_CA = "RANKSCOPE_TLS_CLIENT_CA_PEM"
# The name a per-session server certificate is issued for; clients check it via the target-name override.
SESSION_SERVER_NAME = "rankscope-agent"
MAKE_CERT = ("make a CA and a certificate for the agent's host name, e.g. with openssl "
             "(openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 ...), "
             "or use `rankscope attach --slurm JOBID`, which makes per-session certificates itself")


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """What an agent serves TLS with; ``client_ca_pem`` set means mutual TLS."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None = None

    def __repr__(self) -> str:  # never print a private key into a log
        return f"ServerTLS(mutual={self.client_ca_pem is not None})"


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """What a client trusts (``ca_pem``), and its own certificate for mutual TLS."""

    ca_pem: bytes
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    server_name: str | None = None  # check the agents' certificates for this name instead of the address's host

    def __repr__(self) -> str:
        return f"ClientTLS(mutual={self.cert_pem is not None}, server_name={self.server_name!r})"


# --------------------------------------------------------------------------
# loading and checking
# --------------------------------------------------------------------------


def _x509() -> Any:
    try:
        from cryptography import x509
    except ImportError as exc:  # pragma: no cover - a dependency of the agent and tui extras
        raise RankscopeError(f"TLS needs the 'cryptography' package ({exc})", "pip install 'rankscope[agent]'") from None
    return x509


def _read(path: Path, what: str, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise RankscopeError(f"{what} {path} does not exist", f"check {flag}; {MAKE_CERT}") from None
    except OSError as exc:
        raise RankscopeError(f"cannot read {what} {path}: {exc}", f"check {flag} and the file's permissions") from None


def certificates(pem: bytes, source: str) -> list[Any]:
    """Every certificate in a PEM text (a chain or a CA bundle), or a RankscopeError naming the source."""
    x509 = _x509()
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        certs = []
    if not certs:
        raise RankscopeError(f"{source} holds no PEM certificate", f"give a file with '-----BEGIN CERTIFICATE-----'; {MAKE_CERT}")
    return list(certs)


def check_validity(pem: bytes, source: str, *, now: dt.datetime | None = None) -> None:
    """Refuse a certificate (or any in a bundle) that expired or is not valid yet, naming the renewal."""
    moment = now or dt.datetime.now(dt.UTC)
    for cert in certificates(pem, source):
        subject = cert.subject.rfc4514_string() or "(no subject)"
        if cert.not_valid_after_utc < moment:
            raise RankscopeError(
                f"the certificate {subject} in {source} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
                f"issue a new certificate (and key) and restart with it; {MAKE_CERT}",
            )
        if cert.not_valid_before_utc > moment:
            raise RankscopeError(
                f"the certificate {subject} in {source} is not valid before "
                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC",
                "check this machine's clock (timedatectl), or issue a certificate valid from now",
            )


def check_key_pair(cert_pem: bytes, key_pem: bytes, cert_source: str, key_source: str) -> None:
    """The private key must belong to the (first) certificate, or every handshake would fail."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise RankscopeError(f"{key_source} is not an unencrypted PEM private key ({exc})",
                             f"give the key the certificate was issued for; {MAKE_CERT}") from None
    cert = certificates(cert_pem, cert_source)[0]
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, public) != \
            cert.public_key().public_bytes(serialization.Encoding.PEM, public):
        raise RankscopeError(f"the key {key_source} does not belong to the certificate {cert_source}",
                             "pass the key that was made together with this certificate")


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None = None,
               env: Mapping[str, str] | None = None) -> ServerTLS | None:
    """The agent's ``--tls-cert/--tls-key/--tls-client-ca``, else ``RANKSCOPE_TLS_*_PEM``; None: no TLS."""
    environ = os.environ if env is None else env
    if cert is None and key is None:
        if client_ca is not None:
            raise RankscopeError("--tls-client-ca needs --tls-cert and --tls-key", "give the agent's own certificate too")
        if not environ.get(ENV_CERT):
            return None
        cert_pem, key_pem = environ[ENV_CERT].encode(), environ.get(ENV_KEY, "").encode()
        cert_src, key_src = f"${ENV_CERT}", f"${ENV_KEY}"
        ca_pem = environ[ENV_CLIENT_CA].encode() if environ.get(ENV_CLIENT_CA) else None
        ca_src = f"${ENV_CLIENT_CA}"
    elif cert is None or key is None:
        raise RankscopeError("--tls-cert and --tls-key go together", "give both the certificate and its private key")
    else:
        problem = private_file_problem(key, "TLS private key", "--tls-key")
        if problem is not None:
            raise problem
        cert_pem, key_pem = _read(cert, "certificate", "--tls-cert"), _read(key, "private key", "--tls-key")
        cert_src, key_src = str(cert), str(key)
        ca_pem = _read(client_ca, "client CA", "--tls-client-ca") if client_ca is not None else None
        ca_src = str(client_ca)
    check_validity(cert_pem, cert_src)
    check_key_pair(cert_pem, key_pem, cert_src, key_src)
    if ca_pem is not None:
        check_validity(ca_pem, ca_src)
    return ServerTLS(cert_pem, key_pem, ca_pem)


def client_tls(ca: Path | None, cert: Path | None = None, key: Path | None = None,
               server_name: str | None = None) -> ClientTLS | None:
    """A client's ``--tls-ca`` (and ``--tls-cert/--tls-key`` for mutual TLS); None: plaintext."""
    if ca is None:
        if cert is not None or key is not None:
            raise RankscopeError("--tls-cert/--tls-key on a client need --tls-ca", "give the CA that signed the agents' certificates")
        return None
    if (cert is None) != (key is None):
        raise RankscopeError("--tls-cert and --tls-key go together", "give both the client certificate and its key")
    ca_pem = _read(ca, "CA certificate", "--tls-ca")
    check_validity(ca_pem, str(ca))
    cert_pem = key_pem = None
    if cert is not None and key is not None:
        cert_pem, key_pem = _read(cert, "client certificate", "--tls-cert"), _read(key, "client key", "--tls-key")
        check_validity(cert_pem, str(cert))
        check_key_pair(cert_pem, key_pem, str(cert), str(key))
    return ClientTLS(ca_pem, cert_pem, key_pem, server_name)


# --------------------------------------------------------------------------
# gRPC credentials
# --------------------------------------------------------------------------


def server_credentials(tls: ServerTLS) -> Any:
    import grpc

    return grpc.ssl_server_credentials(
        [(tls.key_pem, tls.cert_pem)], root_certificates=tls.client_ca_pem,
        require_client_auth=tls.client_ca_pem is not None,
    )


def channel_credentials(tls: ClientTLS) -> Any:
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=tls.ca_pem, private_key=tls.key_pem,
                                        certificate_chain=tls.cert_pem)


def channel_options(tls: ClientTLS | None) -> tuple[tuple[str, str], ...]:
    return (("grpc.ssl_target_name_override", tls.server_name),) if tls is not None and tls.server_name else ()


# Words in a gRPC status that mean the TLS handshake failed, not that nobody listened.
_HANDSHAKE_WORDS = ("handshake", "ssl", "tls", "certificate", "hostname verification", "alpn")
_CLOSED_WORDS = ("socket closed", "connection reset", "eof")


def handshake_problem(details: str, *, using_tls: bool) -> tuple[str, str] | None:
    """(what went wrong, the fix) when an UNAVAILABLE status was a TLS failure; None otherwise.

    gRPC reports these as "unavailable" with the TLS library's words in the
    details; told apart here so the person learns which side to fix.
    """
    lowered = details.lower()
    handshake = any(word in lowered for word in _HANDSHAKE_WORDS)
    # Closed while connecting (the handshake), not mid-call: an agent that dies during a call closes
    # the stream too, and that is a lost agent, not a TLS problem.
    closed = "failed to connect" in lowered and any(word in lowered for word in _CLOSED_WORDS)
    if not using_tls:
        if handshake or closed:  # a TLS agent drops a plaintext client without a word of TLS
            return ("TLS/handshake failure: the agent closed the plaintext connection; it probably serves TLS",
                    "pass --tls-ca with the CA that signed the agent's certificate")
        return None
    if "wrong_version_number" in lowered:
        return ("TLS/handshake failure: the agent does not speak TLS (started without --tls-cert)",
                "restart the agent with --tls-cert/--tls-key, or drop --tls-ca if it is on loopback")
    if "expired" in lowered:
        return ("TLS/handshake failure: the agent's certificate has expired",
                "issue a new certificate for the agent (rankscope attach --slurm makes one per session) and restart it")
    if "hostname verification" in lowered:
        return ("TLS/handshake failure: the agent's certificate does not name the address connected to",
                "connect by a host name the certificate lists, or pass --tls-server-name NAME with a name it lists")
    if closed or "certificate_required" in lowered or "peer_did_not_return" in lowered:
        return ("TLS/handshake failure: the agent closed the TLS connection; with mutual TLS it refuses clients "
                "without a certificate its --tls-client-ca signed (or this client's certificate expired)",
                "pass --tls-cert and --tls-key with a valid client certificate signed by the agent's --tls-client-ca")
    if handshake:
        return ("TLS/handshake failure: the agent's certificate was not accepted (not signed by the --tls-ca given)",
                "pass --tls-ca with the CA that signed the agents' certificates")
    return None


# --------------------------------------------------------------------------
# making certificates (per session, and in tests)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return "Issued(<certificate and key>)"


@dataclass(frozen=True, slots=True)
class Session:
    """A throw-away CA with one server and one client certificate."""

    ca: Issued
    server: Issued
    client: Issued
    server_name: str

    def server_tls(self, *, mutual: bool = True) -> ServerTLS:
        return ServerTLS(self.server.cert_pem, self.server.key_pem, self.ca.cert_pem if mutual else None)

    def client_tls(self, *, mutual: bool = True) -> ClientTLS:
        return ClientTLS(self.ca.cert_pem, self.client.cert_pem if mutual else None,
                         self.client.key_pem if mutual else None, self.server_name)

    def server_env(self, *, mutual: bool = True) -> dict[str, str]:
        """The agent's TLS as environment variables (see ``server_tls``)."""
        env = {ENV_CERT: self.server.cert_pem.decode(), ENV_KEY: self.server.key_pem.decode()}
        if mutual:
            env[ENV_CLIENT_CA] = self.ca.cert_pem.decode()
        return env


def _issue(subject: str, issuer: Issued | None, *, is_ca: bool, names: Sequence[str], client: bool,
           not_before: dt.datetime, not_after: dt.datetime) -> Issued:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    signing_key: Any = key
    if issuer is None:
        issuer_name = name
    else:
        issuer_cert = x509.load_pem_x509_certificate(issuer.cert_pem)
        issuer_name = issuer_cert.subject
        signing_key = serialization.load_pem_private_key(issuer.key_pem, password=None)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(signing_key, hashes.SHA256())
    return Issued(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def make_ca(name: str = "rankscope session CA", *, days: float = 1.0, now: dt.datetime | None = None) -> Issued:
    start = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(minutes=5)  # tolerate small clock skew
    return _issue(name, None, is_ca=True, names=(), client=False, not_before=start,
                  not_after=start + dt.timedelta(days=days))


def issue(ca: Issued, subject: str, names: Sequence[str] = (), *, client: bool = False, days: float = 1.0,
          now: dt.datetime | None = None) -> Issued:
    """A leaf certificate signed by ``ca`` for ``names`` (DNS names or IP addresses)."""
    start = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(minutes=5)
    return _issue(subject, ca, is_ca=False, names=names, client=client, not_before=start,
                  not_after=start + dt.timedelta(days=days))


def make_session(names: Sequence[str] = (), *, days: float = 1.0) -> Session:
    """A new CA, a server certificate for ``SESSION_SERVER_NAME`` (and ``names``) and a client certificate."""
    ca = make_ca(days=days)
    server = issue(ca, SESSION_SERVER_NAME, (SESSION_SERVER_NAME, *names), days=days)
    client = issue(ca, "rankscope client", client=True, days=days)
    return Session(ca, server, client, SESSION_SERVER_NAME)


def write_private(path: Path, data: bytes) -> Path:
    """Write a key or token readable by its owner only (created 0600, never world-readable for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
    return path
