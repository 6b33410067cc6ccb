"""Storage backends. The writer is the only component that writes through them."""

from .sqlite import Durability, LoadedState, SqliteStorage

__all__ = ["Durability", "LoadedState", "SqliteStorage"]
