"""Every verb's --help builds its parser without the training loop, torch's compiler or a model:
what the options need is read from configs, so octlm answers about as fast as torch imports."""

import subprocess
import sys

import pytest

VERBS = ["verify", "bench", "report", "train", "sample"]
HEAVY = ["octlm.training.loop", "octlm.training.distributed", "torch._dynamo"]


@pytest.mark.parametrize("argv", [[], *([verb] for verb in VERBS)])
def test_help_loads_none_of_the_heavy_modules(argv):
    probe = (
        "import sys\n"
        "from octlm.cli import main\n"
        "try:\n"
        f"    main({[*argv, '--help']!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print([name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "usage: octlm" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"
