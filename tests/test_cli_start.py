"""Every verb's --help builds its parser without the training loop, torch's compiler or a model:
what the options need is read from configs, so octlm answers about as fast as torch imports."""

import subprocess
import sys

VERBS = ["verify", "bench", "report", "train", "sample"]
HEAVY = ["octlm.training.loop", "octlm.training.distributed", "torch._dynamo"]
PROBE = f"""
import sys
from octlm.cli import main
for argv in [[], *([verb] for verb in {VERBS!r})]:
    try:
        main([*argv, "--help"])
    except SystemExit:
        pass
print([name for name in {HEAVY!r} if name in sys.modules])
"""


def test_help_of_octlm_and_of_every_verb_loads_none_of_the_heavy_modules():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.count("usage: octlm") == 1 + len(VERBS)
    assert done.stdout.strip().splitlines()[-1] == "[]"
