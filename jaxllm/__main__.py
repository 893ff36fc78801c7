"""`python -m jaxllm`: the same command line as the `jaxllm` script."""

import sys

from jaxllm.cli import main

sys.exit(main())
