"""Front doors beside the router's native gRPC API: other protocols over one `Frontend`.

Each gateway translates its protocol to the public `router_pb2.GenerateRequest` and back
(`openai/`: OpenAI-compatible HTTP; `kserve/`: KServe v2 gRPC), and adds no path of its own
to the workers: the checks, the sessions and the cancellation are the router's.
"""
