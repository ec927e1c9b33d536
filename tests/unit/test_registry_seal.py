"""Registry entries sealed with the cluster's key (control/auth.py): a reader with the key takes
only entries sealed for their own Redis key; a reader without it (`status`) shows them."""
from __future__ import annotations

import pytest

from control.auth import Unsealed, registry_key, seal, unseal

KEY = registry_key(b"the cluster's secret")


def test_an_entry_opens_only_with_the_key_and_under_its_own_redis_key() -> None:
    sealed = seal(KEY, "ns:hb:decode-0", b"payload")
    assert unseal(KEY, "ns:hb:decode-0", sealed) == b"payload"
    assert unseal(None, "ns:hb:anything", sealed) == b"payload"  # unchecked, for a reader without the secret
    with pytest.raises(Unsealed, match="another key's entry"):
        unseal(KEY, "ns:hb:decode-7", sealed)  # copied under another worker's key
    with pytest.raises(Unsealed, match="another secret"):
        unseal(registry_key(b"another secret"), "ns:hb:decode-0", sealed)
    with pytest.raises(Unsealed, match="not sealed"):
        unseal(KEY, "ns:hb:decode-0", b"payload")  # written by anyone who can write the Redis
    tampered = sealed[:-1] + b"X"
    with pytest.raises(Unsealed):
        unseal(KEY, "ns:hb:decode-0", tampered)
