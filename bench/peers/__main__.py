"""Entry point: ``.venv/bin/python bench/peers [options]`` (see ``--help``)."""

import sys
from pathlib import Path

# bench/ on the path: ``peers`` is imported as a package (so the spawned client
# processes can import it too) next to bench/benchlib.py and bench/e2e.py.
# bench/peers itself (put first by ``python bench/peers``) is taken off, so
# its module names cannot shadow anything else.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from peers.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
