"""The router: the public Generate API, worker discovery, routing policy and retries."""
