"""control/tls.py `given_tls`: a certificate of the deployment's own PKI is checked at start,
and each wrong file is an error naming it and what to do; the flags go three together; a CA
bundle travels in the Redis URL whole."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from cluster.cli import build_parser, _serve_config
from cluster.processes import given_tls_of
from control.redis_url import readable, with_ca
from control.tls import given_tls, tls_of
from tests.pki import DAY, NOW, make_ca


@pytest.fixture
def ca_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    ca = make_ca()
    return ca, ca.write(tmp_path / "ca.pem")


def test_a_certificate_of_the_deployment_ca_is_this_members_identity(ca_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca, ca_path = ca_file
    cert, key = ca.issue(tmp_path, "worker", dns=("worker-7.example", "splitserve-cluster"))
    tls = given_tls(str(ca_path), str(cert), str(key))
    assert (tls.ca_pem, tls.cert_pem, tls.key_pem) == (ca_path.read_bytes(), cert.read_bytes(), key.read_bytes())
    assert tls_of(b"secret", True, tls) is tls  # in place of the one made from the secret
    assert tls_of(b"secret", False, tls) is None  # --no-internal-tls: none at all
    tls.ssl_context(server=True), tls.ssl_context(server=False)  # ssl loads it as given
    tls.server_credentials(), tls.channel_credentials()


def test_an_rsa_key_and_a_ca_bundle_do(ca_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca, _ = ca_file
    other = make_ca("an older CA")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(other.write(tmp_path / "other.pem").read_bytes() + ca.write(tmp_path / "ca.pem").read_bytes())
    cert, key = ca.issue(tmp_path, "router", rsa_key=True)
    assert given_tls(str(bundle), str(cert), str(key)).ca_pem == bundle.read_bytes()


@pytest.mark.parametrize("fault", ["no name", "another CA", "expired", "not yet", "another key", "encrypted key",
                                   "key readable by others", "no such file", "not a certificate"])
def test_a_wrong_file_is_named_with_what_to_do(fault: str, ca_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca, ca_path = ca_file
    kwargs: dict = {}
    if fault == "no name":
        kwargs["dns"] = ("worker-7.example",)
    elif fault in ("expired", "not yet"):
        kwargs["valid"] = (NOW - 3 * DAY, NOW - 2 * DAY) if fault == "expired" else (NOW + DAY, NOW + 2 * DAY)
    issuer = make_ca("someone else's CA") if fault == "another CA" else ca
    cert, key = issuer.issue(tmp_path, "member", **kwargs)
    if fault == "another key":
        _, key = ca.issue(tmp_path, "someone")
    elif fault == "encrypted key":
        from cryptography.hazmat.primitives import serialization
        k = serialization.load_pem_private_key(key.read_bytes(), None)
        key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.BestAvailableEncryption(b"pass")))
    elif fault == "key readable by others":
        key.chmod(0o644)
    elif fault == "no such file":
        cert = tmp_path / "missing.pem"
    elif fault == "not a certificate":
        cert.write_text("-----BEGIN CERTIFICATE-----\nbm9uZQ==\n-----END CERTIFICATE-----\n")
    want = {"no name": rf"--tls-cert {cert} does not name splitserve-cluster \(its DNS names: worker-7.example\).*"
                       "subjectAltName DNS:splitserve-cluster",
            "another CA": rf"--tls-cert {cert} was not issued by a certificate of --tls-ca {ca_path}",
            "expired": rf"--tls-cert {cert} is valid from .* UTC, not now",
            "not yet": rf"--tls-cert {cert} is valid from .* UTC, not now",
            "another key": rf"--tls-key {key} is not the key of --tls-cert {cert}",
            "encrypted key": rf"--tls-key {key} is encrypted: give the key without a passphrase",
            "key readable by others": rf"--tls-key {key} is readable by others \(mode 644\); chmod 600 it",
            "no such file": rf"--tls-cert {cert}: No such file",
            "not a certificate": rf"--tls-cert {cert} holds no PEM certificate"}[fault]
    with pytest.raises(ValueError, match=want):
        given_tls(str(ca_path), str(cert), str(key))


def test_the_flags_go_three_together_and_not_with_tls_off(ca_file, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca, ca_path = ca_file
    cert, key = ca.issue(tmp_path, "router")
    parser = build_parser()
    files = ["--tls-ca", str(ca_path), "--tls-cert", str(cert), "--tls-key", str(key)]
    for command in (["router"], ["worker", "decode"], ["kv-store"], ["serve"]):
        assert given_tls_of(parser.parse_args([*command])) is None
        assert given_tls_of(parser.parse_args([*command, *files])).cert_pem == cert.read_bytes()
        with pytest.raises(ValueError, match="--tls-ca, --tls-cert and --tls-key go together"):
            given_tls_of(parser.parse_args([*command, *files[:4]]))
        with pytest.raises(ValueError, match="which --no-internal-tls turns off"):
            given_tls_of(parser.parse_args([*command, *files, "--no-internal-tls"]))


def test_serve_hands_the_given_certificate_to_its_workers(ca_file, tmp_path: Path, tiny_llama_dir: str) -> None:  # type: ignore[no-untyped-def]
    ca, ca_path = ca_file
    cert, key = ca.issue(tmp_path, "member")
    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--device", "cpu", "--tls-ca", str(ca_path),
                                      "--tls-cert", str(cert), "--tls-key", str(key)])
    worker = _serve_config(args).worker
    assert worker.tls is not None and worker.tls.cert_pem == cert.read_bytes()
    assert "BEGIN PRIVATE KEY" not in repr(worker)  # nor in any log of the config


def test_a_ca_bundle_travels_in_the_redis_url_whole(tmp_path: Path) -> None:
    one, two = make_ca("one"), make_ca("two")
    bundle = one.write(tmp_path / "1.pem").read_bytes() + two.write(tmp_path / "2.pem").read_bytes()
    url = readable(with_ca("rediss://:pw@10.0.0.5:6380/0", bundle))
    path = Path(parse_qs(urlsplit(url).query)["ssl_ca_certs"][0])
    assert path.read_text().replace("\n", "") == bundle.decode().replace("\n", "")
