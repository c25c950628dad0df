"""`python -m d3d_hf.cli`: the `d3d-hf` console script."""

import sys

from . import main

sys.exit(main())
