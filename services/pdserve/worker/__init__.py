"""Worker processes: the engine on its own thread behind grpc.aio servers."""
