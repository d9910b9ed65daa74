"""Moving snapshots between nodes: the stream format, its transports (TCP, UCX), sender and receiver."""
