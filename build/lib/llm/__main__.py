"""``python -m llm COMMAND ...``: the ``llm`` command (:mod:`llm.cli.main`)."""

import sys

from llm.cli.main import main

sys.exit(main())
