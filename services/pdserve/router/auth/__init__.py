"""Client authentication at the router: API keys, the caller they make, per-key limits.

- `caller`: `Caller` (who is calling: a key's id, name and limits; `ANONYMOUS` when no
  keys are configured) and the call's current caller (`current_caller`).
- `keys`: the key file (`--api-key-file`, written by `pdserve keys`), stored hashed,
  reloaded when it changes; `KeyRing` looks a presented key up in constant time.
- `limits`: requests per minute, concurrent requests and tokens per minute per key, kept
  in Redis so that every router of a cluster enforces the same budget.
- `gate`: the one check every front door runs: a bearer header -> a `Caller`, and the
  admission of a generation under the caller's limits.
- `interceptor`: that check on the router's gRPC port (every service but grpc.health.v1).
"""
