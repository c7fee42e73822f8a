"""`python -m jaxrl_llm.cli ...` is `jaxrl-llm ...`."""

import sys

from jaxrl_llm.cli.main import main

sys.exit(main())
