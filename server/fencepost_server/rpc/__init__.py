"""The gRPC side, and the only package that knows protobuf: decode ->
validate and convert (commands.py) -> the writer or a read -> answer; a
refusal becomes its status in status.py alone."""
