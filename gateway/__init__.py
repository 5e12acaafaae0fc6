"""The public gRPC API and the `gramserve` command."""
