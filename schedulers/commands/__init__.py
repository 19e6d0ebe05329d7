"""``rlflow`` subcommands, one module each (``COMMANDS`` in ``rlflow.schedulers.cli`` maps names to them).

``OUT_DIR`` is where ``show``, ``plan`` and ``profile`` write when ``--out`` is not given: relative to the
working directory, and ignored by git in a clone (``.gitignore``), so running the README's commands in the
repository leaves its tree clean.
"""

from pathlib import Path
from typing import Final

OUT_DIR: Final = Path("out")
