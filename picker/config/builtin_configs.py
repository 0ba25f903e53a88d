"""picker's shipped EndpointPickerConfigs (picker/config/builtin/*.yaml, in the wheel and the
image), offered by file name wherever a config file is: `picker serve --config-file
picker-best.yaml`, `picker config show/validate`, and the chart's `pluginsConfigFile`.

An existing path always wins, so a file of the same name in the working directory is read
instead; a bare name that is neither a file nor a built-in is an error naming the built-ins."""

from __future__ import annotations

from pathlib import Path

from picker.config.schema import ConfigError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def builtin_names() -> tuple[str, ...]:
    """The built-in configs' file names, sorted (`picker-best.yaml`, ...)."""
    return tuple(sorted(path.name for path in BUILTIN_DIR.glob("*.yaml")))


def resolve_config_path(file: str | Path) -> Path:
    """The file to read for `file`: `file` itself when it exists or names a directory part (so
    a missing path keeps the plain missing-file error), else the built-in config of that name.
    Raises ConfigError for a bare name that is neither."""
    path = Path(file)
    if path.exists() or path.name != str(file):
        return path
    builtin = BUILTIN_DIR / path.name
    if builtin.is_file():
        return builtin
    known = ", ".join(builtin_names())
    raise ConfigError([f"cannot read {file}: no such file, nor a built-in config of that name (built-in: {known})"])
