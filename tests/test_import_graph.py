"""The modules of src/octlm import each other without a cycle, and the product never imports
the lab (octlm.lab: bench, report, verify), as scripts/import_cycles.py checks."""

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_cycles.py"


def run(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(source)], capture_output=True, text=True, check=False
    )


def test_src_octlm_has_no_import_cycle():
    done = run(SCRIPT.parents[1] / "src")
    assert done.returncode == 0, done.stderr
    assert "no import cycle" in done.stdout


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg import c
            def f():
                from . import a
            """
        )
    )
    (package / "c.py").write_text("import pkg.a\n")
    done = run(tmp_path)
    assert done.returncode == 1
    assert "import cycle among: pkg.a, pkg.b, pkg.c" in done.stderr


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
