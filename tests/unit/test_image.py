"""The image the chart runs is the one `make image` builds: repository from the chart's values,
tag the chart's appVersion (= the package version), built by docker or podman from the
Dockerfile, with a clear message when neither can build.

Here a stand-in `docker` or `podman` script records how `make image` calls it (the real
Makefile, make and sh run); tests/integration/test_image_podman.py builds and runs the image with
a real podman."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.e2e.charts import chart_image

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "picker"


def stand_in_engine(directory: Path, name: str, info_exit: int = 0) -> Path:
    """An executable `name` that appends its arguments to calls.txt (`info` exits `info_exit`)."""
    directory.mkdir(exist_ok=True)
    script = directory / name
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {directory / "calls.txt"}\n[ "$1" = info ] && exit {info_exit}\nexit 0\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return directory / "calls.txt"


def make_image(path: str, *variables: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    assert make, "make is needed to run the Makefile"
    env = {**os.environ, "PATH": path}
    env.pop("CONTAINER_ENGINE", None)
    env.pop("BASE_IMAGE", None)
    return subprocess.run(
        [make, "-C", str(ROOT), "image", *variables], env=env, capture_output=True, text=True, check=False, timeout=60
    )


def only_sed(directory: Path) -> Path:
    """A PATH directory holding only sed (the Makefile reads the tag with it)."""
    directory.mkdir(exist_ok=True)
    sed = shutil.which("sed")
    assert sed
    (directory / "sed").symlink_to(sed)
    return directory


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_make_image_builds_the_image_the_chart_runs(engine, tmp_path) -> None:
    calls = stand_in_engine(tmp_path / "bin", engine)
    result = make_image(f"{tmp_path / 'bin'}:{only_sed(tmp_path / 'tools')}")
    assert result.returncode == 0, result.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert calls.read_text().splitlines() == [
        "info",
        f"build --build-arg VERSION={version} -t {chart_image()} .",
    ]
    assert f"kind load docker-image {chart_image()}" in result.stdout


def test_make_image_builds_on_another_base_image_when_asked(tmp_path) -> None:
    calls = stand_in_engine(tmp_path / "bin", "podman")
    result = make_image(f"{tmp_path / 'bin'}:{only_sed(tmp_path / 'tools')}", "BASE_IMAGE=localhost/base:1")
    assert result.returncode == 0, result.stderr
    build = calls.read_text().splitlines()[-1]
    assert "--build-arg BASE_IMAGE=localhost/base:1 " in build
    assert build.endswith(f"-t {chart_image()} .")


def test_the_dockerfile_builds_and_runs_on_its_base_image_argument() -> None:
    """BASE_IMAGE's default is the public Python image; the stage that builds the venv and the
    final stage both use it (the venv runs on the Python it was built with)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "\nARG BASE_IMAGE=python:3.11-slim-bookworm\n" in dockerfile
    assert "\nFROM ${BASE_IMAGE} AS deps\n" in dockerfile
    assert re.findall(r"^FROM (\S+)", dockerfile, re.M)[-1] == "${BASE_IMAGE}"


def stages(dockerfile: str) -> dict[str, str]:
    """The Dockerfile's stages by name (the unnamed last one as "final"), each its lines."""
    named: dict[str, str] = {}
    for stage in re.split(r"^FROM\s", dockerfile, flags=re.M)[1:]:
        name = re.match(r"\S+(?:\s+AS\s+(\S+))?", stage, re.I)
        assert name
        named[name.group(1) or "final"] = stage
    return named


def test_the_dependencies_install_in_layers_that_depend_on_pyproject_alone() -> None:
    """A change to picker's source reuses the layer of its dependencies (the slow one): that stage
    copies pyproject.toml and the tools it runs, never the source; picker comes as a wheel built
    without its dependencies and installed into that venv without them."""
    by_name = stages((ROOT / "Dockerfile").read_text())
    assert list(by_name) == ["core", "deps", "wheel", "final"]
    copied = [line.split()[1:-1] for line in by_name["deps"].splitlines() if line.startswith("COPY ")]
    assert copied == [["pyproject.toml"], ["tools/pyproject-requirements.py", "tools/restore-opentelemetry-proto.sh"]]
    assert "pip install -r requirements.txt" in by_name["deps"]
    assert by_name["wheel"].startswith("deps AS wheel\n")
    assert "COPY picker ./picker" in by_name["wheel"]
    assert "pip wheel --no-deps" in by_name["wheel"]
    final = by_name["final"]
    assert final.index("COPY --from=deps /opt/picker /opt/picker") < final.index("COPY --from=wheel")
    assert "pip install --no-deps --no-index /tmp/wheels/*.whl" in final
    assert "pip check" in final


def test_the_image_is_built_from_the_products_source_alone() -> None:
    """The simulator and the bench are not the product: the build context leaves them out and the
    wheel stage copies picker's source only."""
    wheel = stages((ROOT / "Dockerfile").read_text())["wheel"]
    copied = [line.split()[1:-1] for line in wheel.splitlines() if line.startswith("COPY ")]
    assert copied == [["README.md"], ["picker"]]
    assert {"sim", "bench"} <= set((ROOT / ".dockerignore").read_text().split())


def test_the_compiled_core_builds_in_a_stage_of_its_own_source() -> None:
    """The ext_proc core's wheel: a stage on the same base that copies only the toolchain script
    and native/extproc (crates fetched in a layer keyed by the lock file), so a change to picker's
    Python source or dependencies never rebuilds the Rust; the final stage installs its wheel."""
    by_name = stages((ROOT / "Dockerfile").read_text())
    core = by_name["core"]
    assert core.startswith("${BASE_IMAGE} AS core\n")
    copied = [line.split()[1:-1] for line in core.splitlines() if line.startswith("COPY ")]
    assert copied == [
        ["tools/install-rust.sh"],
        ["native/extproc/Cargo.toml", "native/extproc/Cargo.lock"],
        ["native/extproc"],
    ]
    assert core.index("cargo fetch --locked") < core.index("COPY native/extproc ./")
    assert "pip wheel --no-deps --wheel-dir /wheels ." in core
    assert "COPY --from=core /wheels /tmp/wheels" in by_name["final"]


def pyproject_requirements(*args: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "tools" / "pyproject-requirements.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=False, timeout=60)


def test_pyproject_requirements_are_the_dependencies_and_the_extras_asked_for() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    alone = pyproject_requirements(str(ROOT / "pyproject.toml"), "")
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines() == project["dependencies"]
    both = pyproject_requirements(str(ROOT / "pyproject.toml"), "tokenizers, test")
    assert both.returncode == 0, both.stderr
    extras = project["optional-dependencies"]
    assert both.stdout.splitlines() == project["dependencies"] + extras["tokenizers"] + extras["test"]


def test_pyproject_requirements_refuses_an_unknown_extra_or_file(tmp_path) -> None:
    unknown = pyproject_requirements(str(ROOT / "pyproject.toml"), "tokenizer")
    assert unknown.returncode == 1
    assert "unknown extra tokenizer; pyproject.toml has test, tokenizers" in unknown.stderr
    assert unknown.stdout == ""
    missing = pyproject_requirements(str(tmp_path / "pyproject.toml"))
    assert missing.returncode == 1
    assert "No such file" in missing.stderr
    (tmp_path / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n')
    no_project = pyproject_requirements(str(tmp_path / "pyproject.toml"))
    assert no_project.returncode == 1
    assert "no [project] table" in no_project.stderr
    assert pyproject_requirements().returncode == 2


def test_make_image_without_docker_or_podman_says_so(tmp_path) -> None:
    result = make_image(str(only_sed(tmp_path / "tools")))
    assert result.returncode != 0
    assert "neither docker nor podman is installed" in result.stderr


def test_make_image_with_an_engine_that_cannot_build_says_so(tmp_path) -> None:
    stand_in_engine(tmp_path / "bin", "docker", info_exit=1)
    result = make_image(f"{tmp_path / 'bin'}:{only_sed(tmp_path / 'tools')}")
    assert result.returncode != 0
    assert "cannot reach its engine" in result.stderr


def test_tag_chart_and_dockerfile_agree() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    final_stage = (ROOT / "Dockerfile").read_text().rsplit("\nFROM ", 1)[1]
    assert "\nARG VERSION\n" in final_stage
    assert "org.opencontainers.image.version=$VERSION" in final_stage
    assert chart_image() in (ROOT / "README.md").read_text()


def test_the_charts_stand_in_for_a_reference_image_is_its_default_image() -> None:
    """A reference EPP image in the values is replaced by picker.defaultImage (_helpers.tpl),
    which must be values.yaml's image."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    (fields,) = re.findall(r'define "picker.defaultImage".*?\n\{\{- dict (.*?) \| toJson', helpers, re.S)
    words = re.findall(r'"([^"]*)"', fields)
    default = dict(zip(words[::2], words[1::2]))
    assert default == yaml.safe_load((CHART / "values.yaml").read_text())["inferenceExtension"]["image"]
