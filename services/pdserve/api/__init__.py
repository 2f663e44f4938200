"""Generated gRPC stubs: `v1` (pdserve.v1, our own API) and `inference` (KServe v2).
Regenerate with `make protos`."""
