"""KV transfer: pushing a prompt's KV blocks from prefill to decode workers over gRPC."""
