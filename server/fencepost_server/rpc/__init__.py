"""gRPC servicers: validate -> command -> await the writer -> convert."""
