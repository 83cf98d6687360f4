"""``python -m kernelstudy``: the ``kernelstudy`` command (:func:`kernelstudy.cli.main`)."""

import sys

from kernelstudy.cli import main

if __name__ == "__main__":
    sys.exit(main())
