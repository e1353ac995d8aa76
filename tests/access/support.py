"""What the access-control tests share: servers in ``keys`` mode, keys made by the real
management commands, and identity-provider tokens signed by a key pair of the test's own."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import manage

ISSUER = "https://idp.test.example"
AUDIENCE = "durable-streams-tests"
KID = "test-key-1"


@dataclass
class IdentityProvider:
    """An RSA key pair whose public half is published in a JWKS file the servers read."""

    private_key: rsa.RSAPrivateKey
    jwks_file: Path

    @classmethod
    def create(cls, folder: Path) -> IdentityProvider:
        private_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private_key.public_key()))
        public |= {"kid": KID, "use": "sig", "alg": "RS256"}
        jwks_file = folder / "jwks.json"
        jwks_file.write_text(json.dumps({"keys": [public]}))
        return cls(private_key, jwks_file)

    def env(self) -> dict[str, str]:
        return {
            "DS_AUTH__JWT_JWKS_FILE": str(self.jwks_file),
            "DS_AUTH__JWT_ISSUER": ISSUER,
            "DS_AUTH__JWT_AUDIENCE": AUDIENCE,
        }

    def token(self, grants: list[str], *, expires_in: int = 600, **claims: Any) -> str:
        payload = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": "user-42",
            "exp": int(time.time()) + expires_in,
            "ds_grants": grants,
        } | claims
        return jwt.encode(payload, self.private_key, algorithm="RS256", headers={"kid": KID})


def create_key(database_url: str, name: str, *grants: str, extra: tuple[str, ...] = ()) -> str:
    """A new API key from ``manage.py create_api_key``: its plaintext."""
    args = ["create_api_key", name, *(f"--grant={grant}" for grant in grants), *extra]
    result = manage(database_url, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def key_id(key: str) -> str:
    return key.partition(".")[0]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
