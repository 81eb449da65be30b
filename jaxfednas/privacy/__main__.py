"""``python -m jaxfednas.privacy ...`` = ``jaxfednas privacy ...``."""
import sys

from jaxfednas.cli import main

sys.exit(main(["privacy", *sys.argv[1:]]))
