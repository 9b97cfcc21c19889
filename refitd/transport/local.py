"""`local`: a slot with no peers; every copy of its program stays on the slot."""

from __future__ import annotations

import torch

from refitd.transport.base import ConnectInfo, Transport, TransportError, Work


class LocalTransport(Transport):
    """Accepts a world of one; any send or receive is a plan error."""

    name = "local"

    def __init__(self) -> None:
        self._rank = 0

    def connect(self, info: ConnectInfo) -> None:
        if info.world_size != 1:
            raise TransportError(
                f"local transport has no peers, but world_size={info.world_size} was requested"
            )
        self._rank = info.rank

    @property
    def rank(self) -> int:
        return self._rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        raise TransportError(f"local transport cannot send message tag {tag} to rank {peer}")

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        raise TransportError(f"local transport cannot receive message tag {tag} from rank {peer}")

    def close(self) -> None:
        pass
