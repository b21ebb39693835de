"""spkernels: fused mHC mixing + sequence-parallel collectives.

Importing the package loads the compiled library, which registers ``torch.ops.spkernels.*``
(schemas, CUDA kernels), then the Python side adds fake and CPU implementations. Model code calls
the typed functions of :mod:`spkernels.api`, re-exported here (``spkernels.sp_boundary(...)``).
"""

from . import (
    _library,  # noqa: F401  (loads the .so: must come first)
    ops,  # noqa: F401  (fake + CPU kernels)
    reference,
)
from .api import (
    BoundaryResult,
    MhcParams,
    Mixes,
    PreResult,
    mhc_head,
    mhc_post,
    mhc_post_pre,
    mhc_pre,
    sp_all_gather,
    sp_boundary,
    sp_post,
    sp_pre,
    sp_shard,
    tp_boundary,
    tp_post,
)
from .comm import Communicator
from .policy import SPPolicy
from .version import __version__

__all__ = [
    "Communicator", "SPPolicy", "reference", "ops", "__version__",
    "MhcParams", "Mixes", "PreResult", "BoundaryResult",
    "mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head",
    "sp_pre", "sp_post", "sp_boundary", "sp_all_gather", "sp_shard",
    "tp_post", "tp_boundary",
]  # fmt: skip
