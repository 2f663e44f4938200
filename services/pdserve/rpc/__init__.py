"""The gRPC edge: serving skeleton, servicer registration, errors to statuses, proto <-> domain."""
