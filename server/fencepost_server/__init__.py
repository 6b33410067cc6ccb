"""fencepost coordinator server."""
