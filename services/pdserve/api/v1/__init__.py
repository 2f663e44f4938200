"""Generated gRPC stubs for pdserve.v1. Do not edit: run `make protos`."""
