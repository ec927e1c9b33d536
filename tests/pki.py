"""A throw-away PKI of a deployment's own, for the tests of given certificates
(`control.tls.given_tls`): a CA and leaf certificates it issued, written as PEM files."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


@dataclass
class CA:
    name: x509.Name
    key: Any
    cert: x509.Certificate

    def write(self, path: Path) -> Path:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(self, directory: Path, stem: str, dns: tuple[str, ...] = ("splitserve-cluster",),
              valid: tuple[datetime.datetime, datetime.datetime] = (NOW - DAY, NOW + DAY),
              rsa_key: bool = False) -> tuple[Path, Path]:
        """A leaf certificate naming `dns` and its key (mode 0600): (cert file, key file)."""
        key = rsa.generate_private_key(65537, 2048) if rsa_key else ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(stem)).issuer_name(self.name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid[0]).not_valid_after(valid[1]))
        if dns:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file, key_file = directory / f"{stem}.pem", directory / f"{stem}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.touch(mode=0o600)
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_file, key_file


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(common: str = "test deployment CA") -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(NOW - DAY).not_valid_after(NOW + DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return CA(name, key, cert)
