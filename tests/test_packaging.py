"""The installed package: one import namespace (``nodraft.*``), its data, its command.

Builds the wheel ``pip install .`` would install and installs it into a folder of its own,
then imports from that folder with ``site`` off, so neither this checkout nor an editable
install can answer for it."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def source_tree(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked but not ignored) copied to ``dest``:
    a build in place would leave ``build/`` in the checkout, whose stale files (modules
    since removed) setuptools would pack into later wheels."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = source_tree(tmp_path_factory.mktemp("src"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    (found,) = out.glob("nodraft-*.whl")
    return found


PACKAGES = ("micro", "drafters", "engine", "server", "clients")


def test_the_wheel_holds_every_module_of_the_checkout(wheel):
    """Each tracked module of the five folders, subpackages included (``drafters/eagle``
    was once left out: ``pip install .`` -- the Docker image -- had no EAGLE), is in the
    wheel; ``clients/examples`` are scripts, run from a checkout."""
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    modules = [m for m in tracked if m.endswith(".py") and not m.startswith("clients/examples/")]
    assert any("/" in m.split("/", 1)[1] for m in modules)  # subpackages are among them
    missing = [m for m in modules if f"nodraft/{m}" not in names]
    assert not missing, f"modules left out of the wheel (pyproject.toml's packages): {missing}"


def test_the_wheel_installs_one_namespace_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"nodraft"}
    for package in PACKAGES:
        assert f"nodraft/{package}/__init__.py" in names
    assert "nodraft/micro/checkpoints/micro.safetensors" in names
    assert "nodraft/micro/checkpoints/tokenizer.json" in names
    from nodraft.micro import gemm

    for source in gemm.SOURCES + gemm.HEADERS:  # every kernel source, and the headers
        assert f"nodraft/micro/csrc/{source.name}" in names
    assert any(n.startswith("nodraft/server/static/") for n in names)
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "nodraft = nodraft.server.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_modules_are_not_bare_top_level_names(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # -S: no site module, so no .pth file (an editable install's finder) is read; the
    # dependencies come from this interpreter's site-packages, nodraft only from the wheel
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])}
    # every registered drafter's class imports from the wheel (EAGLE's subpackage among them)
    script = ("import importlib.util, nodraft.server.cli, nodraft.micro.checkpoint as c\n"
              "from nodraft.drafters.registry import Registry\n"
              "r = Registry()\n"
              "assert r.names() and all(r.drafter_class(n) for n in r.names()), r.names()\n"
              "print(nodraft.server.cli.__file__)\n"
              "print(c.load_tokenizer(c.CHECKPOINT_DIR / 'tokenizer.json').encode('def f')[:1])\n"
              "print([n for n in ('server', 'micro', 'drafters', 'engine', 'clients')"
              " if importlib.util.find_spec(n)])\n")
    out = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target / "nodraft" / "server"))
    assert lines[2] == "[]"
    cli = subprocess.run([sys.executable, "-S", "-m", "nodraft.server.cli", "--help"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr
