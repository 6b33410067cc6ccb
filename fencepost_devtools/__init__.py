"""Development and test tools of the checkout, never shipped: throwaway
PostgreSQL clusters (``pgcluster``) and free loopback ports (``ports``) for the
tests, bench/ and torture/. Installed by the checkout's own pyproject.toml."""
