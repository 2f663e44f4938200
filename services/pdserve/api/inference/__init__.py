"""Generated gRPC stubs for the KServe v2 protocol. Do not edit: run `make protos`.

Its descriptors live in POOL, not in protobuf's default pool (where tritonclient
registers the same names).
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
