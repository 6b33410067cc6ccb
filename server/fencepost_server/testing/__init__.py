"""The server's public test kit: a real coordinator in a background thread
(``testing.server.ServerThread``), a clock a test moves (``testing.clock``) and
the broken builds the torture run proves its checkers on (``testing.hooks``).
``fencepost.testing``'s pytest fixtures are built on it."""
