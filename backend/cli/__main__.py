"""python -m tritium.cli: the `tritium` command, for an environment whose bin/ is not on PATH."""
import sys

from tritium.cli import main

if __name__ == "__main__":
    sys.exit(main())
