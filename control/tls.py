"""Mutual TLS between the members of one cluster (torch-free).

Every member (worker, router, KV store) holds the cluster secret. From it each derives the
same cluster CA key (HKDF of the secret, an EC P-256 scalar) and issues itself a leaf
certificate for a fresh key of its own. Members trust that CA alone and present their leaf
both ways, under one fixed name (`SERVER_NAME`) so that addresses do not matter. Nothing but
the secret is handed out: whoever holds it can join, as before; whoever does not can neither
serve nor call a member, and nothing sent can be read or replayed.

A deployment with its own PKI gives each member a certificate instead (`given_tls`: a CA
bundle, a certificate naming `SERVER_NAME`, its key); members then trust that CA.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import ssl
from dataclasses import dataclass, field
from typing import Any

import grpc

SERVER_NAME = "splitserve-cluster"
"""The name every member's certificate carries and every member checks (not a DNS name)."""
_CA_LABEL = b"splitserve cluster ca v1"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_VALID = datetime.timedelta(days=3650)
NO_CRYPTOGRAPHY = ("internal TLS needs the `cryptography` package (pip install cryptography); or turn it off "
                   "(--no-internal-tls) on every member of a cluster on a network you trust")


@dataclass(frozen=True)
class MemberTLS:
    """One member's TLS identity: the cluster CA and this member's certificate and key (PEM)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A gRPC server's: callers must show a certificate of this cluster's CA."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """A socket's (kvfabric tcp): TLS 1.3, each side verifying the other's certificate. No
        name is checked: every member's certificate carries the same one, and only members
        hold certificates of this CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        _load_chain(ctx, self.cert_pem, self.key_pem)
        return ctx


def _load_chain(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """ssl takes a certificate and key only from files: a private temporary file, gone at once."""
    import tempfile

    with tempfile.NamedTemporaryFile("wb", prefix="splitserve-tls-", suffix=".pem") as f:  # mode 0600
        f.write(key_pem + cert_pem)
        f.flush()
        ctx.load_cert_chain(f.name)


@functools.lru_cache(maxsize=4)
def member_tls(secret: bytes) -> MemberTLS:
    """This process's identity in the cluster of `secret` (made once per process and secret)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as e:
        raise RuntimeError(NO_CRYPTOGRAPHY) from e
    seed = hmac.new(secret, _CA_LABEL, hashlib.sha512).digest()
    ca_key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    fingerprint = hashlib.sha256(ca_key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()[:16]
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"splitserve cluster CA {fingerprint}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    start = now - datetime.timedelta(days=1)  # clocks of members differ a little
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(int(fingerprint, 16))
               .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
               .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(now + _VALID)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return MemberTLS(ca_cert.public_bytes(pem), cert.public_bytes(pem),
                     key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def given_tls(ca_file: str, cert_file: str, key_file: str) -> MemberTLS:
    """A member's identity from the deployment's own PKI: PEM files of the CA (a bundle may
    hold several), this member's certificate (a chain may follow it) and its unencrypted
    key. Checked here, at start, so that a wrong file is an error naming it, not a refused
    handshake later: the certificate must name `SERVER_NAME` (every member checks that name,
    not an address), be valid now, be issued by one of the CA's certificates (or the chain
    after it) and belong to the key. Raises ValueError."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError as e:
        raise RuntimeError(NO_CRYPTOGRAPHY) from e
    from pathlib import Path

    from control.auth import check_private

    check_private(Path(key_file), "--tls-key")  # as ssh insists of a private key
    pems = {}
    for flag, path in (("--tls-ca", ca_file), ("--tls-cert", cert_file), ("--tls-key", key_file)):
        try:
            pems[flag] = Path(path).read_bytes()  # (closed at once, unlike a bare open())
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror or e}") from None

    def certificates(flag: str, path: str) -> list[Any]:
        try:
            return list(x509.load_pem_x509_certificates(pems[flag]))
        except ValueError:
            raise ValueError(f"{flag} {path} holds no PEM certificate") from None

    cas, chain = certificates("--tls-ca", ca_file), certificates("--tls-cert", cert_file)
    leaf = chain[0]
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if SERVER_NAME not in names:
        raise ValueError(f"--tls-cert {cert_file} does not name {SERVER_NAME} (its DNS names: "
                         f"{', '.join(names) or 'none'}): members check that name, not an address; issue it with "
                         f"subjectAltName DNS:{SERVER_NAME}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ValueError(f"--tls-cert {cert_file} is valid from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                         f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")
    if not any(_issued_by(leaf, issuer) for issuer in [*cas, *chain[1:]]):
        raise ValueError(f"--tls-cert {cert_file} was not issued by a certificate of --tls-ca {ca_file} (nor by "
                         "one following it in its own file)")
    try:
        key = serialization.load_pem_private_key(pems["--tls-key"], password=None)
    except TypeError:
        raise ValueError(f"--tls-key {key_file} is encrypted: give the key without a passphrase, in a file only "
                         "the member's user can read") from None
    except ValueError:
        raise ValueError(f"--tls-key {key_file} holds no PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.DER, public)
            != leaf.public_key().public_bytes(serialization.Encoding.DER, public)):
        raise ValueError(f"--tls-key {key_file} is not the key of --tls-cert {cert_file}")
    return MemberTLS(pems["--tls-ca"], pems["--tls-cert"], pems["--tls-key"])


def _issued_by(cert: Any, issuer: Any) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(issuer)  # the issuer's name and its signature
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", SERVER_NAME),)


def member_channel(address: str, tls: MemberTLS | None, options: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.Channel:
    """An asyncio channel to another member: mutual TLS when `tls`, else plain."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*CHANNEL_OPTIONS, *options])


def member_channel_sync(address: str, tls: MemberTLS | None) -> grpc.Channel:
    """A blocking channel to another member (as `member_channel`)."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=list(CHANNEL_OPTIONS))


def add_member_port(server: Any, address: str, tls: MemberTLS | None) -> int:
    """Bind a gRPC server (sync or asyncio) that other members call: mutual TLS when `tls`."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, tls.server_credentials()))


def server_context(tls: MemberTLS | None) -> ssl.SSLContext | None:
    return tls.ssl_context(server=True) if tls else None


def client_context(tls: MemberTLS | None) -> ssl.SSLContext | None:
    return tls.ssl_context(server=False) if tls else None


def tls_of(secret: bytes | None, enabled: bool, given: MemberTLS | None = None) -> MemberTLS | None:
    """A member's identity when internal TLS is on: the one the deployment `given` it, else the
    one made from the cluster secret; None when off, or with neither."""
    if not enabled:
        return None
    return given or (member_tls(secret) if secret else None)
