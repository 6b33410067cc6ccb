"""Generated protobuf and gRPC stubs for the ``fencepost.v1`` API (``make proto``)."""
