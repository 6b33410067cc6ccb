"""Background upkeep of a serving coordinator: retention and garbage collection."""
