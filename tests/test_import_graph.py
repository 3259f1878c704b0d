"""The modules of src/octlm import each other without a cycle (scripts/import_cycles.py)."""

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
