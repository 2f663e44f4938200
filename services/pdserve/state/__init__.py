"""Redis: request state, the worker registry, and the private server for tests and `pdserve up`."""
