"""`python -m pipeline.demo` (`make demo`): the same as `rollout demo`."""

import sys

from pipeline.demo.run import main

sys.exit(main())
