"""What crosses process boundaries: model config, sampling parameters and their checks,
block hashing, KV chunks and their checksum, worker info, domain errors.

Imports none of torch, redis or grpc (a test enforces it): the engine, the workers, the
router and the client all depend on this package, and it on nothing of theirs.
"""
