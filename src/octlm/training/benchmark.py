"""``python -m octlm.training.benchmark overhead|attention``: the ``training`` suite of ``octlm
bench`` (:mod:`octlm.bench.training`), one of its two measurements."""

import sys

from octlm.bench.training import main

if __name__ == "__main__":
    what, *rest = sys.argv[1:] or ["--help"]
    sys.exit(main(["--what", what, *rest] if not what.startswith("-") else [what, *rest]))
