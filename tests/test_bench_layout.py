"""The lab (octlm.lab: bench, report, verify) stands apart: the product never imports it."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_cycles.py"


def run(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(source)], capture_output=True, text=True, check=False
    )


def test_no_product_module_imports_the_lab():
    done = run(SCRIPT.parents[1] / "src")
    assert done.returncode == 0, done.stderr
    assert (SCRIPT.parents[1] / "src" / "octlm" / "lab" / "bench" / "driver.py").is_file()


def test_a_product_module_that_imports_the_lab_is_named(tmp_path):
    """Lazy imports count; the lab importing the product and the command line importing the
    lab do not."""
    octlm = tmp_path / "octlm"
    (octlm / "lab").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "records.py": "",
        "cli.py": "from octlm.lab import bench\n",
        "model.py": "def f():\n    from octlm.lab.bench import g\n",
        "lab/__init__.py": "",
        "lab/bench.py": "from octlm import records\n",
    }.items():
        (octlm / name).write_text(text)
    done = run(tmp_path)
    assert done.returncode == 1
    assert done.stderr == "octlm.model imports the lab: octlm.lab.bench\n"
