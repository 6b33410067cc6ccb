"""Certificates and a policy for the TypeScript TLS tests: a CA, a server
certificate for 127.0.0.1, client certificates whose CN is the principal, and
a policy file with roles and three bearer tokens. Writes them under DIR and
prints their paths (and the tokens) as one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO))

from fencepost_server.auth import token_digest  # noqa: E402
from torture.certs import CA  # noqa: E402

PRINCIPALS = ("alice", "bob", "op", "admin")
TOKENS = {"cli-admin": "ts-admin-token", "script": "ts-script-token", "carol": "ts-worker-token"}
POLICY = """
[roles]
admin = ["admin", "cli-*"]
operator = ["op", "script"]
worker = ["alice", "bob", "carol"]

[tokens]
{tokens}
"""


def main(directory: Path) -> None:
    ca = CA(directory)
    server = ca.server()
    clients = {name: ca.issue(name, cn=name) for name in PRINCIPALS}
    policy = directory / "policy.toml"
    policy.write_text(POLICY.format(tokens="\n".join(
        f'{name} = "{token_digest(token)}"' for name, token in TOKENS.items())))
    print(json.dumps({
        "ca": str(ca.cert),
        "server": {"cert": str(server.cert), "key": str(server.key)},
        "clients": {n: {"cert": str(p.cert), "key": str(p.key)} for n, p in clients.items()},
        "policy": str(policy),
        "tokens": {
            "admin": TOKENS["cli-admin"], "script": TOKENS["script"], "worker": TOKENS["carol"],
        },
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
