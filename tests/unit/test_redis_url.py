"""control/redis_url.py: a URL carrying the cluster CA becomes one redis-py reads; others stay."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from control.redis_url import CA_PARAM, readable, with_ca
from control.tls import member_tls


def test_the_ca_travels_in_the_url_and_lands_in_a_private_file() -> None:
    ca = member_tls(b"redis-url-test-secret").ca_pem
    url = with_ca("rediss://:pw@10.0.0.5:6380/0?socket_timeout=3", ca)
    query = parse_qs(urlsplit(readable(url)).query)
    assert CA_PARAM not in query and query["socket_timeout"] == ["3"] and query["ssl_check_hostname"] == ["false"]
    path = Path(query["ssl_ca_certs"][0])
    assert path.read_text().strip() == ca.decode().strip()
    assert path.parent.stat().st_mode & 0o077 == 0  # a directory of this process's own
    assert urlsplit(readable(url))[:3] == ("rediss", ":pw@10.0.0.5:6380", "/0")


@pytest.mark.parametrize("url", ["redis://:pw@127.0.0.1:6379/0", "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem"])
def test_other_urls_are_left_as_they_are(url: str) -> None:
    assert readable(url) == url


def test_a_ca_that_is_not_a_certificate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=CA_PARAM):
        readable(f"rediss://h:1/0?{CA_PARAM}=bm90LWEtY2VydA")
