"""`python -m cpkit.cluster CHECK` (under torchrun); see cpkit.cluster."""

import os
import sys

from cpkit.cluster import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # no interpreter teardown: after a failure a rank may still be inside a collective
