"""Identity providers' key sets as the server reads them from a file (``access.tokens``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.access.support import AUDIENCE, ISSUER, bearer

GRANTS = ["stream/jwks/:read,append,manage"]


def _public(key: Any, algorithm: type[jwt.algorithms.Algorithm]) -> dict[str, Any]:
    return json.loads(algorithm.to_jwk(key.public_key()))  # type: ignore[attr-defined]


def _token(key: Any, algorithm: str) -> str:
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "jwks", "exp": int(time.time()) + 600,
              "ds_grants": GRANTS, "jti": str(time.time_ns())}  # fmt: skip
    return jwt.encode(claims, key, algorithm=algorithm)  # no kid


def test_keys_without_kids_and_a_key_file_gone(start_server: Any, tmp_path: Path) -> None:
    """Review: of a key set whose keys have no ``kid``, only the first was tried, so a token
    signed with the second was refused; and a key file removed while the server ran (a
    rotation done as delete, then write) made every token a 500. The key that fits the token's
    algorithm is chosen; an unreadable file refuses tokens (401) until it is back."""
    ec_key = ec.generate_private_key(ec.SECP256R1())
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = tmp_path / "jwks.json"
    keys = [
        _public(ec_key, jwt.algorithms.ECAlgorithm),
        _public(rsa_key, jwt.algorithms.RSAAlgorithm),
    ]
    jwks.write_text(json.dumps({"keys": keys}))
    env = {"DS_AUTH__MODE": "keys", "DS_AUTH__JWT_JWKS_FILE": str(jwks),
           "DS_AUTH__JWT_ISSUER": ISSUER, "DS_AUTH__JWT_AUDIENCE": AUDIENCE}  # fmt: skip
    server = start_server(env=env)
    text = {"Content-Type": "text/plain"}
    for key, algorithm in ((ec_key, "ES256"), (rsa_key, "RS256")):
        url = server.stream_url(f"jwks/{algorithm}-{time.time_ns()}")
        created = httpx.put(url, headers=text | bearer(_token(key, algorithm)))
        assert created.status_code == 201, (algorithm, created.text)
    jwks.unlink()
    gone = httpx.get(f"{server.base_url}/v1/auth/whoami", headers=bearer(_token(rsa_key, "RS256")))
    assert gone.status_code == 401, gone.text
