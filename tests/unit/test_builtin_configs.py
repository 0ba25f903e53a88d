"""picker's shipped configs by name: `picker serve --config-file picker-best.yaml` and `picker
config show/validate` read the built-in config of that name unless a file of that path exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.config import cli
from picker.config.builtin_configs import BUILTIN_DIR, builtin_names, resolve_config_path
from picker.config.schema import ConfigError
from picker.serve.flags import build_parser, serve_options

QUEUE_ONLY = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def serve_config_file(name: str) -> str | None:
    args = build_parser().parse_args(["--endpoints", "10.0.0.1:8000", "--config-file", name])
    return serve_options(args).scheduling.config_file


def test_the_shipped_configs_are_built_in() -> None:
    assert {"picker-best.yaml", "picker-precise.yaml", "picker-e2e.yaml", "picker-conversation.yaml"} <= set(
        builtin_names()
    )
    assert {"picker-pd.yaml", "reference-approx.yaml"} <= set(builtin_names())


def test_a_bare_name_resolves_to_the_built_in_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no file of that name here
    assert resolve_config_path("picker-best.yaml") == BUILTIN_DIR / "picker-best.yaml"
    assert serve_config_file("picker-precise.yaml") == str(BUILTIN_DIR / "picker-precise.yaml")
    assert cli.main(["validate", "picker-best.yaml"]) == 0
    assert capsys.readouterr().out.endswith("valid\n")
    assert cli.main(["show", "--config-file", "picker-precise.yaml"]) == 0
    assert "precise-prefix-cache-scorer" in capsys.readouterr().out


def test_an_existing_file_wins_over_the_built_in_of_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "picker-best.yaml").write_text(QUEUE_ONLY)
    assert resolve_config_path("picker-best.yaml") == Path("picker-best.yaml")
    assert serve_config_file("picker-best.yaml") == "picker-best.yaml"
    assert cli.main(["show", "--config-file", "picker-best.yaml"]) == 0
    shown = capsys.readouterr().out
    assert "queue-scorer" in shown and "ttft-cost-scorer" not in shown


def test_an_unknown_name_is_refused_naming_the_built_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        serve_config_file("picker-bset.yaml")
    (message,) = refused.value.errors
    assert message.startswith("cannot read picker-bset.yaml: no such file, nor a built-in config of that name")
    assert "picker-best.yaml" in message
    assert cli.main(["validate", "picker-bset.yaml"]) == 1
    assert "nor a built-in config" in capsys.readouterr().err


def test_a_missing_path_is_a_missing_file_not_a_built_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("configs/picker-best.yaml") == Path("configs/picker-best.yaml")
    assert cli.main(["validate", "./picker-best.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cannot read picker-best.yaml: [Errno 2]") and "built-in" not in err
