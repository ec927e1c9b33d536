"""A cluster's Redis URL as it is handed around, and as redis-py reads it (torch-free).

An embedded Redis reachable beyond loopback serves TLS with a certificate of the cluster's
CA (control/tls.py) or of the deployment's own. Its URL (`rediss://`) carries that CA itself
(`splitserve_ca=`, its DER, a bundle's certificates in a row, in URL-safe base64: a CA
certificate is public), so any process given the URL (a worker on
another node, `splitserve status`) verifies the server without the secret. `readable` makes
it what redis-py reads: the CA in a file of this process's own, no host name check (the
certificate names the cluster, not a host). Any other URL is left as it is.
"""
from __future__ import annotations

import atexit
import base64
import functools
import shutil
import ssl
import tempfile
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

CA_PARAM = "splitserve_ca"


def with_ca(url: str, ca_pem: bytes) -> str:
    """`url` (rediss://) naming `ca_pem` as the only CA its server's certificate may be of."""
    text = ca_pem.decode()
    ends = "-----END CERTIFICATE-----"
    pems = [part + ends for part in text.split(ends) if "-----BEGIN CERTIFICATE-----" in part]
    der = b"".join(ssl.PEM_cert_to_DER_cert(pem.strip()) for pem in pems)  # a bundle: its certificates in a row
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query), (CA_PARAM, base64.urlsafe_b64encode(der).decode().rstrip("="))]
    return urlunsplit(parts._replace(query=urlencode(query)))


def readable(url: str) -> str:
    """`url` as redis-py's `from_url` reads it."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    ca = [v for k, v in query if k == CA_PARAM]
    if not ca:
        return url
    rest = [(k, v) for k, v in query if k != CA_PARAM]
    rest += [("ssl_ca_certs", _ca_file(ca[0])), ("ssl_check_hostname", "false")]
    return urlunsplit(parts._replace(query=urlencode(rest)))


@functools.lru_cache(maxsize=4)
def _ca_file(encoded: str) -> str:
    """The CA as a PEM file in a directory only this process made (gone when it exits)."""
    try:
        der = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        context = ssl.create_default_context(cadata=der)  # certificates, or ssl.SSLError (a ValueError's kin)
        pem = "".join(ssl.DER_cert_to_PEM_cert(one) for one in context.get_ca_certs(binary_form=True))
    except (ValueError, TypeError, ssl.SSLError) as e:
        raise ValueError(f"the Redis URL's {CA_PARAM} is not a certificate: {e}") from None
    directory = tempfile.mkdtemp(prefix="splitserve-redis-ca-")
    atexit.register(shutil.rmtree, directory, True)
    path = Path(directory) / "ca.pem"
    path.write_text(pem)
    return str(path)
