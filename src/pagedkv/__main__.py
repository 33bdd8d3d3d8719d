"""``python -m pagedkv``: the same as the ``pagedkv`` console script."""
import sys

from pagedkv.cli import main

sys.exit(main())
