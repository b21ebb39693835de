"""spkernels: fused mHC mixing + sequence-parallel collectives (SPEC.md).

Importing the package loads the compiled library, which registers ``torch.ops.spkernels.*``
(schemas, CUDA kernels), then the Python side adds fake and CPU implementations.
"""

from . import (
    _library,  # noqa: F401  (loads the .so: must come first)
    ops,  # noqa: F401  (fake + CPU kernels)
    reference,
)
from .comm import Communicator
from .policy import SPPolicy
from .version import __version__

__all__ = ["Communicator", "SPPolicy", "reference", "ops", "__version__"]
