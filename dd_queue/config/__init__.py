"""One typed, frozen configuration tree, loaded from YAML with environment overrides.

    cfg = load_config("config/demo.yaml", os.environ)
    cfg.synchronizer.quorum, cfg.digest

See :mod:`dd_queue.config.schema` for the sections and :mod:`dd_queue.config.loader` for the
precedence of files and ``DDQ__SECTION__FIELD`` overrides.
"""

from dd_queue.config.loader import (
    CONFIG_HELP,
    ENV_PREFIX,
    PRESETS,
    config_path,
    load_config,
    preset_names,
    validate_config,
)
from dd_queue.config.schema import (
    AuthConfig,
    ControlConfig,
    DataConfig,
    DDQConfig,
    FaultsConfig,
    FaultSpec,
    LearnerConfig,
    MembershipConfig,
    ModelConfig,
    RedisConfig,
    RunConfig,
    SynchronizerConfig,
    TrackingConfig,
    WireConfig,
    digest_mismatch,
)

__all__ = [
    "CONFIG_HELP",
    "ENV_PREFIX",
    "PRESETS",
    "AuthConfig",
    "ControlConfig",
    "DDQConfig",
    "DataConfig",
    "FaultSpec",
    "FaultsConfig",
    "LearnerConfig",
    "MembershipConfig",
    "ModelConfig",
    "RedisConfig",
    "RunConfig",
    "SynchronizerConfig",
    "TrackingConfig",
    "WireConfig",
    "config_path",
    "digest_mismatch",
    "load_config",
    "preset_names",
    "validate_config",
]
