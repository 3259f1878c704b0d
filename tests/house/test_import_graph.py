"""The modules of src/octlm import each other without a cycle and only down the layers of
docs/design.md, 'Layout'; the product never imports the lab (octlm.lab: bench, report, verify),
and the tiled engines are reached only through their door; as scripts/import_cycles.py checks."""

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_cycles.py"


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


def write(root: Path, files: dict[str, str]) -> Path:
    """A source tree under ``root`` of ``files`` (path -> text); returns ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_an_import_up_the_layers_and_a_module_in_no_layer_are_named(tmp_path):
    """A leaf that imports the model goes up the layers; a new top-level module must be given
    a layer before it passes."""
    source = write(tmp_path, {
        "octlm/__init__.py": "",
        "octlm/files.py": "def f():\n    from octlm.model import OctLM\n",
        "octlm/model.py": "from octlm import files\n",
        "octlm/stray.py": "",
    })  # fmt: skip
    done = run(source)
    assert done.returncode == 1
    assert "octlm.stray is in no layer of LAYERS" in done.stderr
    assert "octlm.files imports octlm.model, a higher layer" in done.stderr
    assert "import cycle among: octlm.files, octlm.model" in done.stderr


def test_a_package_init_imports_the_modules_of_its_lazy_table(tmp_path):
    """``octlm/__init__.py`` loads its names on first use from a table of module names: each
    entry is an import, so the model importing the package closes a cycle and goes up."""
    source = write(tmp_path, {
        "octlm/__init__.py": '_SOURCES = {"OctLM": "octlm.model"}\n',
        "octlm/model.py": "import octlm\n",
    })  # fmt: skip
    done = run(source)
    assert done.returncode == 1
    assert "import cycle among: octlm, octlm.model" in done.stderr
    assert "octlm.model imports octlm, a higher layer" in done.stderr


def test_only_the_door_reaches_the_tiled_engines(tmp_path):
    tiled = "octlm/attention/tiled/"
    source = write(tmp_path, {
        "octlm/__init__.py": "",
        "octlm/attention/__init__.py": "",
        tiled + "__init__.py": "",
        tiled + "engine.py": "from octlm.attention.tiled import walk, whole\n",
        tiled + "walk.py": "",
        tiled + "whole.py": "",
        tiled + "attention.py": "from octlm.attention.tiled.whole import whole_forward\n",
    })  # fmt: skip
    done = run(source)
    assert done.returncode == 1
    assert done.stderr == (
        "octlm.attention.tiled.attention imports octlm.attention.tiled.whole, which only "
        "octlm.attention.tiled.engine may\n"
    )
