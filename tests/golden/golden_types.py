"""Container classes the golden files use, registered with torch's pytree. The golden test
never imports this module under this name, so loading rebuilds stand-ins."""

import dataclasses

import torch
import torch.utils._pytree as pytree


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor | None = None


pytree.register_dataclass(Pair)
