"""The single writer and the committed state it moves (DESIGN.md): ``Writer``
takes commands, decides them in batches and commits; ``Reads`` and
``History`` answer committed reads beside it."""

from .apply import EngineHooks
from .reads import History, Reads
from .renewals import ALL
from .state import ChangeEvent, LedgerState, WriterStats
from .writer import Writer, WriterClosed

__all__ = ["ALL", "ChangeEvent", "EngineHooks", "History", "LedgerState", "Reads", "Writer",
           "WriterClosed", "WriterStats"]
