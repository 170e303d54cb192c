import sys

from .cli import main

# Guarded: Tango imports every submodule of an included package, this one too.
if __name__ == "__main__":
    sys.exit(main())
