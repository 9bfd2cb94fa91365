"""`python -m pipeline.harness.demo` (`make demo`): the same as `rollout demo`."""

import sys

from pipeline.harness.demo.run import main

sys.exit(main())
