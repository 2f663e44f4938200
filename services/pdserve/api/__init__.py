"""Generated gRPC stubs (pdserve.v1). Regenerate with `make protos`."""
