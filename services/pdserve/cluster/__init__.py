"""Running pdserve processes locally: one process, or a whole cluster (`pdserve up`)."""
