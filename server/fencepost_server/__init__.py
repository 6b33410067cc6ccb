"""fencepost coordinator server."""


def version() -> str:
    """This server's version: always the SDK's, which is where it is written."""
    from fencepost import __version__

    return __version__


def version_text() -> str:
    """What ``fencepost --version`` prints: the release, the gRPC API's proto
    package and the schema each store migrates its database to."""
    from fencepost.v1 import ledger_pb2

    from .storage import postgres, sqlite

    return (
        f"fencepost {version()}\n"
        f"api: {ledger_pb2.DESCRIPTOR.package}\n"
        f"storage schema: sqlite {sqlite.SCHEMA_VERSION}, postgresql {postgres.SCHEMA_VERSION}"
    )
