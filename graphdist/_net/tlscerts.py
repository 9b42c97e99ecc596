"""TLS credentials of one cluster: a CA of its own, a key and certificate per host, one client.

TensorFlow's gRPC servers take no credentials, so TLS mode (issue 38) puts a mutual-TLS gateway
on each host in front of them. :func:`make_credentials` makes what those present: a new CA, and
for each host a folder of exactly what is copied there (``ca.pem``; ``cert.pem``, whose
subjectAltName is the host's IP address or DNS name; ``key.pem``), and one for the client. The
CA's private key is only ever in memory, so no one can mint another certificate for the cluster:
a new host means new credentials for all. :func:`load_credentials` checks a folder as ssh checks
a key (yours, ``chmod 600``), and that its certificate is the CA's and valid now; a refusal is
one :class:`CredentialsError` line naming the file and the fix, never anything of the key.
:func:`server_context` and :func:`client_context` are TLS 1.3 only, mutual, and trust the
cluster's CA alone. The cryptography is pyca's ``cryptography`` (imported on first use: ``import
graphdist`` stays light) and Python's ``ssl``, none of our own.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import secrets
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphdist._exceptions import CredentialsError
from graphdist._private import private_dir
from graphdist._validate import show

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = [
    "CA_FILE",
    "CERT_FILE",
    "CLIENT",
    "CLIENT_NAME",
    "KEY_FILE",
    "MAX_DAYS",
    "Credentials",
    "client_context",
    "client_folder",
    "host_folder",
    "identity_folder",
    "load_credentials",
    "make_credentials",
    "server_context",
]

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"  # in every identity's folder
CLIENT = "client"  # the client's folder, and its key in make_credentials' answer
CLIENT_NAME = "graphdist-client"  # the client certificate's DNS subjectAltName
MAX_DAYS = 3650
_LABEL_RE = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")  # one label of a host name
# KeyUsage's nine flags in order: digital_signature, content_commitment, key_encipherment,
# data_encipherment, key_agreement, key_cert_sign, crl_sign, encipher_only, decipher_only
_LEAF_USAGE = (True, False, False, False, False, False, False, False, False)  # ECDSA signing
_CA_USAGE = (False, False, False, False, False, True, True, False, False)  # certificates, CRLs


def _name(text: str) -> str | None:
    """``text`` as a certificate names it: an IP address compressed (an IPv6 zone such as
    ``%eth0`` dropped), a DNS name (letters, digits, '-' and '_') lower-case; else None."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text)).partition("%")[0]
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if not text.isascii() or len(name) > 253 or labels[-1].isdigit():
        return None  # an all-digit last label is a mistyped IPv4 address, not a name
    return name if all(_LABEL_RE.fullmatch(label) for label in labels) else None


@dataclass(frozen=True)
class Credentials:
    """One identity's folder, checked by :func:`load_credentials`: the paths of its three files
    and its certificate's subjectAltNames (IP addresses compressed, DNS names lower-case)."""

    folder: str
    ca: str
    cert: str
    key: str
    names: tuple[str, ...]

    def covers(self, host: str) -> bool:
        """Whether ``host`` (an IP address in any spelling, a DNS name in any case) is named."""
        return _name(host.removeprefix("[").removesuffix("]")) in self.names


def host_folder(out: str, host: str) -> str:
    """The folder of ``host``'s credentials under ``out`` (``:`` of an IPv6 address as ``_``)."""
    return os.path.join(out, "hosts", host.replace(":", "_"))


def client_folder(out: str) -> str:
    return os.path.join(out, CLIENT)


def identity_folder(given: str, host: str | None = None) -> str:
    """The folder of one identity in ``given``, as ``graphdist certs`` handed it out: ``given``
    itself when it is one (it holds ``ca.pem``), else, when ``given`` is the whole folder
    ``certs`` made, its sub-folder for ``host`` (``hosts/HOST``) or, with no host, the
    client's. CredentialsError, one line naming what to give, when that whole folder has no
    such sub-folder; anything else is left to :func:`load_credentials` to say."""
    if os.path.exists(os.path.join(given, CA_FILE)):
        return given
    own = client_folder(given) if host is None else host_folder(given, host)
    if os.path.isdir(own):
        return own
    hosts = os.path.join(given, "hosts")
    if not (os.path.isdir(hosts) or os.path.isdir(client_folder(given))):
        return given
    if host is None:
        raise CredentialsError(
            f"{given} holds no client's folder ({own}): give the folder `graphdist certs` made, "
            "whole, or its client/ folder",
            given,
        )
    made: list[str] = []
    with contextlib.suppress(OSError):
        made = sorted(os.listdir(hosts))
    raise CredentialsError(
        f"{given} holds no credentials for host {host} ({own}; `graphdist certs` made them for "
        f"{', '.join(made) or 'no host'}): give this host's folder, or make new credentials "
        "whose --cluster names this host",
        given,
    )


def _write(path: str, data: bytes, mode: int) -> None:
    """A new file (never an existing one, nor through a link), created with ``mode`` at once."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
    except OSError as exc:
        message = f"Cannot write {path}: {exc.strerror}; remove the folder and make them again"
        raise CredentialsError(message, path) from None


def _certificate(
    key: ec.EllipticCurvePrivateKey,
    days: int,
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None = None,
    san: x509.GeneralName | None = None,
    usages: Sequence[x509.ObjectIdentifier] = (),
) -> x509.Certificate:
    """The CA's own certificate (no ``ca``), or one of ``key`` that ``ca`` (its key and
    certificate) signs, for host ``san`` and extended key usages ``usages``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    cn = f"graphdist cluster CA {secrets.token_hex(4)}" if san is None else str(san.value)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if len(cn) <= 64 else [])
    now, public = datetime.datetime.now(datetime.timezone.utc), key.public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if ca is None else ca[1].subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # for a clock a bit behind
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )
    if ca is None:  # the CA: it signs certificates, of end entities only (path length 0)
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
        return builder.add_extension(x509.KeyUsage(*_CA_USAGE), True).sign(key, hashes.SHA256())
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca[0].public_key())
    builder = (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(*_LEAF_USAGE), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(authority, critical=False)
        # critical where the subject is empty (a name too long for a CN), as RFC 5280 says
        .add_extension(x509.SubjectAlternativeName([san] if san else []), not len(subject))
    )
    return builder.sign(ca[0], hashes.SHA256())


def make_credentials(hosts: Sequence[str], out: str, *, days: int = 365) -> dict[str, str]:
    """A new CA, and under ``out`` a folder for each distinct host (an IP address or a DNS name,
    as the cluster spells it: certificate for TLS servers and clients) and the client's (for
    clients only), valid for ``days`` days from 5 minutes ago; ``{host or CLIENT: folder}``.
    Raises :class:`CredentialsError` for an ``out`` that is not empty, no host, a host that is
    neither an IP address nor a DNS name, or ``days`` outside 1..3650."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID as Usage

    hosts = list(dict.fromkeys([hosts] if isinstance(hosts, str) else hosts))
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise CredentialsError(f"days must be a whole number from 1 to {MAX_DAYS}, not {days!r}")
    if not hosts:
        raise CredentialsError("No hosts to make credentials for; name the cluster's hosts")
    plan: list[tuple[str, str, x509.GeneralName, tuple[x509.ObjectIdentifier, ...]]] = []
    for host in hosts:
        name = _name(host) if isinstance(host, str) else None
        if name is None or host == CLIENT:
            why = "taken by the client" if host == CLIENT else "no IP address nor DNS name"
            raise CredentialsError(f"Host {show(host)} is {why}; fix the cluster's host names")
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            san = x509.DNSName(name)
        plan.append((host, host_folder(out, host), san, (Usage.SERVER_AUTH, Usage.CLIENT_AUTH)))
    plan.append((CLIENT, client_folder(out), x509.DNSName(CLIENT_NAME), (Usage.CLIENT_AUTH,)))
    try:
        full = os.path.isdir(out) and not os.path.islink(out) and bool(os.listdir(out))
    except OSError as exc:
        raise CredentialsError(f"Cannot read {out}: {exc.strerror}", out) from None
    if full:
        raise CredentialsError(f"{out} is not empty; give a new folder for a new CA", out)
    for folder in (out, os.path.join(out, "hosts")):
        private_dir(folder, "the credentials folder")

    ca_key = ec.generate_private_key(ec.SECP256R1())  # in memory only, forgotten on return
    ca = _certificate(ca_key, days)
    pem, plain = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    for identity, folder, san, usages in plan:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(key, days, (ca_key, ca), san, usages)
        private_dir(folder, f"the credentials folder of {identity}")
        _write(os.path.join(folder, CA_FILE), ca.public_bytes(pem), 0o644)
        _write(os.path.join(folder, CERT_FILE), cert.public_bytes(pem), 0o644)
        key_pem = key.private_bytes(pem, plain, serialization.NoEncryption())
        _write(os.path.join(folder, KEY_FILE), key_pem, 0o600)
    return {identity: folder for identity, folder, _, _ in plan}


def _load(path: str, *, key: bool = False) -> Any:
    """The certificate, or the private key, in ``path``: a key only if it is this user's and
    private, as ssh wants. Nothing of a key goes into a message (nor its parser's error)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from cryptography.x509 import load_pem_x509_certificate as load_certificate

    what = "an unencrypted PEM private key" if key else "a PEM certificate"
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            mode = stat.S_IMODE(info.st_mode)
            if key and info.st_uid != os.getuid():
                fix = f"belongs to uid {info.st_uid}, not to you; copy it as your user"
            elif key and mode & 0o077:
                fix = f"is open to others (mode {mode:04o}); a key must be private: run "
                fix += f"`chmod 600 {path}`"
            else:
                data = file.read(1 << 20)
                try:
                    return load_pem_private_key(data, None) if key else load_certificate(data)
                except (ValueError, TypeError, UnsupportedAlgorithm):
                    fix = f"is not {what}; copy it again"
    except FileNotFoundError:
        fix = (
            "is missing: give the folder `graphdist certs` made (whole, or one identity's: "
            "DIR/client, DIR/hosts/HOST), with its ca.pem, cert.pem and key.pem"
        )
    except OSError as exc:
        fix = f"cannot be read ({exc.strerror})"
    raise CredentialsError(f"{path} {fix}", path)


def load_credentials(folder: str) -> Credentials:
    """Check and load one identity's folder (see the module docstring); raises
    :class:`CredentialsError` naming the file and the fix."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    try:
        info = os.stat(folder)
    except OSError as exc:
        raise CredentialsError(f"Cannot read {folder}: {exc.strerror}", folder) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise CredentialsError(f"{folder} is not a folder of yours; copy it as your user", folder)
    ca_path, cert_path, key_path = (os.path.join(folder, f) for f in (CA_FILE, CERT_FILE, KEY_FILE))
    ca, cert, key = _load(ca_path), _load(cert_path), _load(key_path, key=True)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        message = f"{key_path} is not the key of {cert_path}; copy the folder whole"
        raise CredentialsError(message, key_path)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        message = f"{cert_path} is not signed by {ca_path} (another cluster's?); copy it again"
        raise CredentialsError(message, cert_path) from None
    now = datetime.datetime.now(datetime.timezone.utc)
    for path, each in ((ca_path, ca), (cert_path, cert)):
        start, end = each.not_valid_before_utc, each.not_valid_after_utc
        if not start <= now <= end:
            raise CredentialsError(
                f"{path} is valid from {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC, not "
                "now; make new credentials with `graphdist certs` (or set this machine's clock)",
                path,
            )
    # every certificate the cluster's CA signed names its host (make_credentials)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = (str(n.value) if isinstance(n, x509.IPAddress) else n.value.lower() for n in sans)
    return Credentials(folder, ca_path, cert_path, key_path, tuple(names))


def _context(protocol: int, creds: Credentials) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: both sides present a certificate
    context.load_verify_locations(cafile=creds.ca)  # the cluster's CA only, no system CAs
    context.load_cert_chain(creds.cert, creds.key)
    return context


def server_context(creds: Credentials) -> ssl.SSLContext:
    """A TLS 1.3 server context that requires a client certificate signed by the cluster's CA."""
    return _context(ssl.PROTOCOL_TLS_SERVER, creds)


def client_context(creds: Credentials) -> ssl.SSLContext:
    """A TLS 1.3 client context that trusts the cluster's CA only and checks the host name."""
    context = _context(ssl.PROTOCOL_TLS_CLIENT, creds)
    context.check_hostname = True
    return context
