"""kda's benchmarks, outside the library: run from the repository root, ``python -m benchmarks.chunk``."""
