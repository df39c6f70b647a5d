"""ShadowLoader (FlexRL sec. 4): metadata-only planning, per-node decoding on Ray, async materialization.

See docs/shadowloader.md. The trainer calls :func:`build_loader` and then, per step,
``step = loader.next_step()`` -> ``step.metas`` (global batch, same on every rank), ``step.mine``,
``step.materialize()``; ``loader.state_dict()`` / ``load_state_dict()`` / ``close()``.

Importing this package does not import Ray; only building a ShadowLoader does.
"""

from titanrl.data.shadow.centralized import CentralizedLoader
from titanrl.data.shadow.factory import build_loader, load_table, media_settings
from titanrl.data.shadow.loader import ShadowLoader
from titanrl.data.shadow.metadata import MediaMeta, MetadataTable, Problem, SampleMeta, load_metadata
from titanrl.data.shadow.placeholder import PixelPlaceholder, placeholders_for_token_range
from titanrl.data.shadow.plan import ProxyLoader, assign_balanced, assign_round_robin, epoch_permutation
from titanrl.data.shadow.types import (
    BadSample,
    BadSampleError,
    DataUnavailableError,
    Materialized,
    StepData,
)

__all__ = [
    "BadSample",
    "BadSampleError",
    "CentralizedLoader",
    "DataUnavailableError",
    "MediaMeta",
    "Materialized",
    "MetadataTable",
    "PixelPlaceholder",
    "Problem",
    "ProxyLoader",
    "SampleMeta",
    "ShadowLoader",
    "StepData",
    "assign_balanced",
    "assign_round_robin",
    "build_loader",
    "epoch_permutation",
    "load_metadata",
    "load_table",
    "media_settings",
    "placeholders_for_token_range",
]
