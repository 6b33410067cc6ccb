"""The single writer and the committed state it moves (DESIGN.md): ``Writer``
takes commands, decides them in batches and commits; everything else reads."""

from .writer import ALL, ChangeEvent, Writer, WriterClosed, WriterStats
from .writer import LedgerState as LedgerState

__all__ = ["ALL", "ChangeEvent", "LedgerState", "Writer", "WriterClosed", "WriterStats"]
