"""The engine: the core (chunk length, route, dtype, backend) and the backend-neutral chunked algorithm."""
