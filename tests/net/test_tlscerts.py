"""TLS mode's credentials (issue 38, graphdist/_net/tlscerts.py): the folders `graphdist certs`
makes (layout, modes, names, no CA key anywhere), a real mutual-TLS handshake between them over
loopback TCP, the handshakes they refuse, and the folders and arguments they refuse."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import socket
import ssl
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

import graphdist
from graphdist._net.tlscerts import (
    CA_FILE,
    CERT_FILE,
    CLIENT,
    CLIENT_NAME,
    KEY_FILE,
    Credentials,
    client_context,
    client_folder,
    host_folder,
    identity_folder,
    load_credentials,
    make_credentials,
    server_context,
)
from tests.cli.test_cli import assert_user_error, gd
from tests.conftest import CliResult, run_python

pytestmark = [pytest.mark.timeout(60)]

HOSTS = ["10.1.2.3", "fd00::3", "node-1.example"]
FILES = {CA_FILE, CERT_FILE, KEY_FILE}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_credentials(HOSTS, str(tmp_path_factory.mktemp("certs") / "out"))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Another cluster's credentials, for the same hosts."""
    return make_credentials(HOSTS, str(tmp_path_factory.mktemp("other") / "out"))


def _cert(folder: str, name: str = CERT_FILE) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(folder, name).read_bytes())


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _copy(folder: str, tmp_path: Path) -> str:
    """A copy of an identity's folder that a test may spoil (modes kept)."""
    copy = str(tmp_path / "copy")
    shutil.copytree(folder, copy)
    return copy


# -- making them ----------------------------------------------------------------------------------


def test_make_credentials_writes_one_private_folder_per_identity(cluster: dict[str, str]) -> None:
    out = os.path.dirname(cluster[CLIENT])
    assert list(cluster) == [*HOSTS, CLIENT]
    assert cluster == {
        **{host: host_folder(out, host) for host in HOSTS},
        CLIENT: client_folder(out),
    }
    assert cluster["fd00::3"] == os.path.join(out, "hosts", "fd00__3")
    assert sorted(os.listdir(out)) == ["client", "hosts"]
    assert sorted(os.listdir(os.path.join(out, "hosts"))) == [
        "10.1.2.3",
        "fd00__3",
        "node-1.example",
    ]
    for folder in (out, os.path.join(out, "hosts"), *cluster.values()):
        assert _mode(folder) == 0o700, folder
    for folder in cluster.values():
        assert set(os.listdir(folder)) == FILES
        assert _mode(os.path.join(folder, KEY_FILE)) == 0o600
        # one CA: every folder holds the same ca.pem
        assert Path(folder, CA_FILE).read_bytes() == Path(cluster[CLIENT], CA_FILE).read_bytes()


def test_each_certificate_names_its_host_as_an_ip_or_a_dns_name(cluster: dict[str, str]) -> None:
    def sans(folder: str) -> x509.SubjectAlternativeName:
        return _cert(folder).extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    def usages(folder: str) -> set[x509.ObjectIdentifier]:
        return set(_cert(folder).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    both = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    for host in ("10.1.2.3", "fd00::3"):
        assert sans(cluster[host]).get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address(host)
        ]
        assert sans(cluster[host]).get_values_for_type(x509.DNSName) == []
        assert usages(cluster[host]) == both
    assert sans(cluster["node-1.example"]).get_values_for_type(x509.DNSName) == ["node-1.example"]
    assert sans(cluster["node-1.example"]).get_values_for_type(x509.IPAddress) == []
    assert sans(cluster[CLIENT]).get_values_for_type(x509.DNSName) == [CLIENT_NAME]
    assert usages(cluster[CLIENT]) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    ca = _cert(cluster[CLIENT], CA_FILE)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    [cn] = ca.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    assert str(cn.value).startswith("graphdist cluster CA ") and len(str(cn.value)) == 29
    leaf = _cert(cluster["10.1.2.3"])
    assert leaf.issuer == ca.subject
    start, end = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    assert end - start == datetime.timedelta(days=365, minutes=5)  # valid 5 minutes early
    now = datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(minutes=4) < now - start < datetime.timedelta(minutes=6)
    # loaded: the names as the dataclass gives them, and covers() in any spelling
    loaded = load_credentials(cluster["fd00::3"])
    assert loaded.names == ("fd00::3",)
    assert loaded.covers("FD00:0:0::3") and loaded.covers("[fd00::3]")
    assert not loaded.covers("fd00::4") and not loaded.covers("node-1.example")
    named = load_credentials(cluster["node-1.example"])
    assert named.names == ("node-1.example",) and named.covers("NODE-1.Example")
    assert load_credentials(cluster[CLIENT]).names == (CLIENT_NAME,)


def test_no_file_holds_the_ca_key(cluster: dict[str, str]) -> None:
    out = os.path.dirname(cluster[CLIENT])
    holding = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(out)
        for name in names
        if b"PRIVATE KEY" in Path(root, name).read_bytes()
    )
    assert holding == sorted(os.path.join(folder, KEY_FILE) for folder in cluster.values())
    assert len(holding) == len(HOSTS) + 1
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ca_public = _cert(cluster[CLIENT], CA_FILE).public_key().public_bytes(*spki)
    for path in holding:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), None)
        assert key.public_key().public_bytes(*spki) != ca_public, path


# -- handshakes -----------------------------------------------------------------------------------


def _handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str
) -> tuple[BaseException | bytes, BaseException | bytes]:
    """One connection over loopback TCP: the server (a thread) answers the client's b"ping" with
    b"pong!"; each side's result is what it received, or the exception that stopped it."""
    results: dict[str, BaseException | bytes] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(20)

        def serve() -> None:
            try:
                raw, _ = listener.accept()
                raw.settimeout(20)
                with server.wrap_socket(raw, server_side=True) as tls:
                    results["server"] = tls.recv(4)
                    tls.sendall(b"pong!")
            except (OSError, ssl.SSLError) as exc:
                results["server"] = exc

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            raw = socket.create_connection(listener.getsockname(), timeout=20)
            with client.wrap_socket(raw, server_hostname=server_hostname) as tls:
                tls.sendall(b"ping")
                results["client"] = tls.recv(5)  # TLS 1.3: a refused certificate shows here
        except (OSError, ssl.SSLError) as exc:
            results["client"] = exc
        thread.join(30)
    assert not thread.is_alive()
    return results["server"], results["client"]


def _creds(cluster: dict[str, str], who: str) -> Credentials:
    return load_credentials(cluster[who])


def test_a_mutual_tls_handshake_between_a_host_and_the_client(cluster: dict[str, str]) -> None:
    server = server_context(_creds(cluster, "10.1.2.3"))
    client = client_context(_creds(cluster, CLIENT))
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert server.verify_mode == client.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname
    assert _handshake(server, client, "10.1.2.3") == (b"ping", b"pong!")


def test_a_host_may_be_the_client_of_another_host(cluster: dict[str, str]) -> None:
    server = server_context(_creds(cluster, "node-1.example"))
    client = client_context(_creds(cluster, "fd00::3"))
    assert _handshake(server, client, "node-1.example") == (b"ping", b"pong!")


def test_another_clusters_client_fails_on_both_sides(
    cluster: dict[str, str], other: dict[str, str]
) -> None:
    server = server_context(_creds(cluster, "10.1.2.3"))
    client = client_context(_creds(other, CLIENT))
    on_server, on_client = _handshake(server, client, "10.1.2.3")
    assert isinstance(on_server, ssl.SSLError), on_server
    assert isinstance(on_client, ssl.SSLCertVerificationError), on_client


def test_a_client_without_a_certificate_is_refused(cluster: dict[str, str]) -> None:
    server = server_context(_creds(cluster, "10.1.2.3"))
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cafile=_creds(cluster, CLIENT).ca)  # trusts the server, shows none
    on_server, on_client = _handshake(server, bare, "10.1.2.3")
    assert isinstance(on_server, ssl.SSLError), on_server
    assert "certificate" in str(on_server).lower(), on_server
    assert isinstance(on_client, (ssl.SSLError, OSError)), on_client


@pytest.mark.parametrize("wrong", ["10.1.2.4", "fd00::3", "node-1.example"])
def test_the_client_checks_the_servers_name(cluster: dict[str, str], wrong: str) -> None:
    server = server_context(_creds(cluster, "10.1.2.3"))
    client = client_context(_creds(cluster, CLIENT))
    on_server, on_client = _handshake(server, client, wrong)
    assert isinstance(on_client, ssl.SSLCertVerificationError), on_client
    assert "mismatch" in on_client.verify_message, on_client.verify_message
    assert isinstance(on_server, (ssl.SSLError, OSError)), on_server


# -- refusals -------------------------------------------------------------------------------------


def test_load_refuses_a_key_others_can_read(cluster: dict[str, str], tmp_path: Path) -> None:
    folder = _copy(cluster[CLIENT], tmp_path)
    key = os.path.join(folder, KEY_FILE)
    os.chmod(key, 0o640)
    with pytest.raises(graphdist.CredentialsError, match="chmod 600") as caught:
        load_credentials(folder)
    message = str(caught.value)
    assert key in message and "0640" in message and "\n" not in message
    body = Path(key).read_text().splitlines()[1]  # a line of the key itself
    assert body not in message
    os.chmod(key, 0o600)
    assert load_credentials(folder).names == (CLIENT_NAME,)


@pytest.mark.parametrize("missing", sorted(FILES))
def test_load_refuses_a_folder_missing_a_file(
    cluster: dict[str, str], tmp_path: Path, missing: str
) -> None:
    folder = _copy(cluster["10.1.2.3"], tmp_path)
    os.remove(os.path.join(folder, missing))
    with pytest.raises(graphdist.CredentialsError, match="is missing") as caught:
        load_credentials(folder)
    assert caught.value.path == os.path.join(folder, missing)


def test_the_whole_folder_certs_made_gives_each_role_its_own(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    """``connect(tls=)`` and ``serve --tls`` take the folder ``graphdist certs`` made, whole, or
    one identity's folder; a whole folder without the host's sub-folder is refused in one line
    naming the sub-folder it lacks and the hosts it has."""
    whole = os.path.dirname(cluster[CLIENT])
    assert identity_folder(whole) == cluster[CLIENT]
    assert identity_folder(whole, "fd00::3") == cluster["fd00::3"]
    assert identity_folder(cluster["10.1.2.3"], "10.1.2.3") == cluster["10.1.2.3"]  # itself
    with pytest.raises(graphdist.CredentialsError, match="holds no credentials for host") as no:
        identity_folder(whole, "10.9.9.9")
    assert host_folder(whole, "10.9.9.9") in str(no.value)
    assert "10.1.2.3, fd00__3, node-1.example" in str(no.value)
    copy = str(tmp_path / "hosts-only")
    shutil.copytree(os.path.join(whole, "hosts"), os.path.join(copy, "hosts"))
    with pytest.raises(graphdist.CredentialsError, match="holds no client's folder"):
        identity_folder(copy)
    empty = str(tmp_path / "empty")
    os.mkdir(empty, 0o700)
    assert identity_folder(empty) == empty  # load_credentials says what is missing, truly
    with pytest.raises(graphdist.CredentialsError, match="DIR/client, DIR/hosts/HOST"):
        load_credentials(empty)


def test_load_refuses_a_certificate_another_ca_signed(
    cluster: dict[str, str], other: dict[str, str], tmp_path: Path
) -> None:
    folder = _copy(cluster["10.1.2.3"], tmp_path)
    shutil.copyfile(os.path.join(other["10.1.2.3"], CA_FILE), os.path.join(folder, CA_FILE))
    with pytest.raises(graphdist.CredentialsError, match="is not signed by") as caught:
        load_credentials(folder)
    assert os.path.join(folder, CERT_FILE) in str(caught.value)


def test_load_refuses_a_key_that_is_not_the_certificates(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    folder = _copy(cluster["10.1.2.3"], tmp_path)
    os.remove(os.path.join(folder, KEY_FILE))
    shutil.copy2(os.path.join(cluster[CLIENT], KEY_FILE), os.path.join(folder, KEY_FILE))
    with pytest.raises(graphdist.CredentialsError, match="is not the key of"):
        load_credentials(folder)


def test_make_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "old.pem").write_text("anything")
    with pytest.raises(graphdist.CredentialsError, match="is not empty") as caught:
        make_credentials(HOSTS, str(tmp_path))
    assert str(tmp_path) in str(caught.value)
    assert os.listdir(tmp_path) == ["old.pem"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_credentials(["10.0.0.1"], str(empty))["10.0.0.1"] == host_folder(
        str(empty), "10.0.0.1"
    )


@pytest.mark.parametrize(
    ("hosts", "days", "named"),
    [
        (["10.1.2.3", "bad host!"], 365, "Host 'bad host!' is no IP address nor DNS name"),
        (["10.1.2.300"], 365, "Host '10.1.2.300'"),
        ([], 365, "No hosts"),
        (["10.1.2.3"], 0, "days must be a whole number from 1 to 3650, not 0"),
        (["10.1.2.3"], 3651, "not 3651"),
    ],
)
def test_make_refuses_bad_hosts_and_days(
    tmp_path: Path, hosts: list[str], days: int, named: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(graphdist.CredentialsError, match=named.replace("(", r"\(")):
        make_credentials(hosts, str(out), days=days)
    assert not out.exists()  # refused before anything is written


def test_importing_the_module_does_not_import_cryptography() -> None:
    code = "import sys, graphdist._net.tlscerts; print('cryptography' in sys.modules)"
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# -- the command ----------------------------------------------------------------------------------


def test_graphdist_certs_makes_a_folder_per_host_and_says_where(
    tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    spec = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.1:2223"]}
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    out = str(tmp_path / "creds")
    result = gd("certs", "--cluster", str(cluster_file), "--out", out)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    one, two = host_folder(out, "10.0.0.1"), host_folder(out, "10.0.0.2")
    assert result.stdout.splitlines() == [
        f"10.0.0.1: {one}  (copy to 10.0.0.1; graphdist serve --tls {one})",
        f"10.0.0.2: {two}  (copy to 10.0.0.2; graphdist serve --tls {two})",
        f"client: {client_folder(out)}  (for graphdist.connect(cluster, tls=...))",
    ]
    for folder, names in ((one, ("10.0.0.1",)), (two, ("10.0.0.2",)), (client_folder(out), None)):
        assert set(os.listdir(folder)) == FILES
        assert names is None or load_credentials(folder).names == names
    again = run_cli("certs", "--cluster", str(cluster_file), "--out", out)
    assert_user_error(again, "is not empty")


@pytest.mark.parametrize(
    ("write", "argv", "named"),
    [
        ("{not json", [], "cluster file"),
        ('{"worker": ["10.0.0.1:2222"]}', ["--days", "0"], "--days must be a whole number"),
        (None, [], "cluster"),
    ],
)
def test_graphdist_certs_refuses_in_one_line(
    tmp_path: Path,
    write: str | None,
    argv: list[str],
    named: str,
    run_cli: Callable[..., CliResult],
) -> None:
    cluster_file = tmp_path / "cluster.json"
    if write is not None:
        cluster_file.write_text(write)
    out = tmp_path / "creds"
    result = run_cli("certs", "--cluster", str(cluster_file), "--out", str(out), *argv)
    assert_user_error(result, named)
    assert result.stdout == "" and not out.exists()
