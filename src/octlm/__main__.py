import sys

from octlm.cli import main

sys.exit(main())
