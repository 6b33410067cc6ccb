"""fencepost SDK (placeholder, replaced below)."""
