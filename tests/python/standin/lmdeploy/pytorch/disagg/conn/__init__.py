"""Stand-in (tests/python/standin/README.md)."""
