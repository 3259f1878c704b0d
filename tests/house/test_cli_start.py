"""Every verb's --help builds its parser without the training loop, torch's compiler or a model:
what the options need is read from configs, so octlm answers about as fast as torch imports."""

import subprocess
import sys

VERBS = ["verify", "bench", "report", "train", "finetune", "sample", "chat"]
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


LIGHT = """
import sys
from octlm.cli import main
try:
    main([{flag!r}])
except SystemExit as exit:
    assert exit.code == 0, exit.code
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("octlm.lab")))
"""


def test_octlm_version_and_help_import_neither_torch_nor_the_lab():
    for flag in ("--version", "--help"):
        probe = LIGHT.format(flag=flag)
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        )
        assert done.stdout.strip().splitlines()[-1] == "[]", flag


def test_every_name_octlm_exports_loads_on_first_use():
    probe = (
        "import sys, octlm\n"
        "assert 'torch' not in sys.modules\n"
        "print(all(getattr(octlm, name) is not None for name in octlm.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
