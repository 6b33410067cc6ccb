"""Storage backends. The writer is the only component that writes through them."""

from .sqlite import Durability, LoadedState, SqliteStorage

__all__ = ["Durability", "LoadedState", "SqliteStorage", "is_url"]


def is_url(target: str) -> bool:
    """Whether ``--db`` names a PostgreSQL database rather than a file (the
    PostgreSQL store, and psycopg with it, is imported only then)."""
    return target.startswith(("postgresql://", "postgres://"))
