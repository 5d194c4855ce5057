"""Loading the configuration: YAML files (with ``extends``) and ``DDQ__`` environment overrides.

Precedence, lowest first: model defaults < YAML file (and the files it ``extends``) <
``DDQ__SECTION__FIELD`` environment variables < the command line's own flags.

- ``load_config(path, environ)`` reads ``path``; a top-level ``extends: base.yaml`` (relative to
  the file) loads that file first and deep-merges this one over it.
- A bare name such as ``demo`` (no directory, no suffix, no such file here) is a config that
  ships in the package (``dd_queue/config/presets/``: ``base``, ``demo``, ``test``), as
  ``--config demo`` or ``extends: base``. ``extends: base.yaml`` with no ``base.yaml`` next to
  the file also means the packaged one, so a config written outside a checkout can build on it.
- ``DDQ__SYNCHRONIZER__QUORUM=2`` overrides ``synchronizer.quorum``; the value is parsed as a YAML
  scalar (``true``, ``2.5``, ``null``, ``[a, b]``), except that text fields stay text. An override
  naming an unknown key is an error.
- Unknown keys anywhere are rejected with the key's dotted path.

Nothing here reads the environment by itself; the caller passes it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr

from dd_queue.config.schema import DDQConfig
from dd_queue.errors import ConfigError
from dd_queue.validation import deep_merge, read_yaml_mapping, validate_model

ENV_PREFIX = "DDQ__"
PRESETS = Path(__file__).resolve().parent / "presets"
"""The configs that ship in the package (``--config demo``)."""


CONFIG_HELP = "YAML file, or a packaged config's name: base, demo, test (default: %(default)s)"
"""``--config`` help, the same in every command."""


def preset_names() -> list[str]:
    """Names of the packaged configs, sorted."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def config_path(path: str | Path) -> Path:
    """The file ``path`` names: itself, or the packaged config of that bare name.

    Raises:
        ConfigError: a bare name that is neither a file here nor a packaged config.
    """
    given = Path(path)
    if given.exists() or given.suffix or len(given.parts) != 1:
        return given
    if (preset := _preset(given.name)) is not None:
        return preset
    raise ConfigError(
        f"config {str(path)!r} is neither a file nor a packaged config "
        f"(packaged: {', '.join(preset_names())})"
    )


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> DDQConfig:
    """Load ``path`` (following ``extends``), apply ``DDQ__`` overrides, validate.

    Args:
        path: A YAML file, e.g. ``config/demo.yaml``, or a packaged config's name (``demo``).
        environ: Variables to read ``DDQ__SECTION__FIELD`` overrides from (``None``: none).

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key, invalid value or override.
    """
    raw = _read_yaml_tree(config_path(path), seen=())
    for name, value in sorted((environ or {}).items()):
        if name.startswith(ENV_PREFIX):
            _apply_override(raw, name, value)
    return validate_config(raw, source=str(path))


def validate_config(raw: Mapping[str, Any], *, source: str = "<dict>") -> DDQConfig:
    """Validate a plain mapping into a ``DDQConfig``, turning pydantic errors into ConfigError."""
    return validate_model(
        DDQConfig, raw, what="config", source=source, reference="config/base.yaml"
    )


def _read_yaml_tree(path: Path, *, seen: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        raise ConfigError(f"config {path} extends itself (cycle: {[str(p) for p in seen]})")
    loaded = read_yaml_mapping(path, what="config")
    parent = loaded.pop("extends", None)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ConfigError(f"config {path}: 'extends' must be a file name, got {parent!r}")
    base = _read_yaml_tree(_parent_path(path, parent), seen=(*seen, resolved))
    return deep_merge(base, loaded)


def _parent_path(path: Path, parent: str) -> Path:
    """``extends: parent`` of ``path``: next to it, else the packaged config of that name."""
    beside = path.parent / parent
    if beside.exists():
        return beside
    return _preset(parent.removesuffix(".yaml")) or beside  # reading it reports a missing one


def _preset(name: str) -> Path | None:
    """The packaged config called ``name`` (a bare name, no directory), if there is one."""
    path = PRESETS / f"{name}.yaml"
    return path if Path(name).name == name and path.is_file() else None


def _apply_override(raw: dict[str, Any], name: str, value: str) -> None:
    parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"environment override {name} must look like DDQ__SECTION__FIELD")
    model: type[BaseModel] = DDQConfig
    node = raw
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            path = ".".join(parts[: depth + 1])
            raise ConfigError(f"environment override {name}: unknown key {path}")
        if depth == len(parts) - 1:
            node[part] = _parse_override(name, value, field.annotation)
            return
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(
                f"environment override {name}: {'.'.join(parts[: depth + 1])} "
                "is a value, not a section"
            )
        model = annotation
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"environment override {name}: {part} is not a section")
        node = child


def _parse_override(name: str, value: str, annotation: Any) -> Any:
    """Parse an override as a YAML scalar, but keep text fields text (a token may be ``123``)."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"environment override {name}: bad value: {exc}") from None
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    wants_text = any(t in (str, SecretStr) for t in (annotation, *options))
    if wants_text and parsed is not None and not isinstance(parsed, str):
        return value
    return parsed
