"""`python -m deviceplugin.cli`: the `gpu-share` command."""

import sys

from .main import main

sys.exit(main())
