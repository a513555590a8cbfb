"""torch_sdcp: Shared-DCP, peer-addressable decode data paths for Decode Context
Parallelism."""

import torch

# Loading the extension registers every torch.ops.sdcp operator. A failure here
# is an installation problem and must be loud.
from torch_sdcp import _C  # noqa: F401
from torch_sdcp import fake  # noqa: F401  (registers the fake implementations)
