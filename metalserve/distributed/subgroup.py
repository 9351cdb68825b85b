"""The tensor-parallel ranks of one pipeline stage, inside the world group of every stage's ranks.

Where the backend splits groups (JACCL, MPI) a stage's ranks get their own sub-group and `all_sum` on it.
MLX's ring backend refuses `Group.split` ("Group split not supported"), so there a stage of two ranks
sums its partials by exchanging them over the world group with `send` / `recv`: each all-reduce is
evaluated at once, the lower rank sending first and the higher receiving first, so the two blocking
transfers never wait on each other (a lazy graph would leave their order to the scheduler). A world
rank's stage neighbours are its ring neighbours (ranks `stage * tp + t`), which the ring's send needs.
"""

from __future__ import annotations

import mlx.core as mx

from metalserve.config import ConfigError


class PairGroup:
    """Two ranks of `world` (`members`, this rank among them) that sum their partials by send/recv."""

    def __init__(self, world: mx.distributed.Group, members: tuple[int, int]) -> None:
        self.world = world
        self.members = members
        self._rank = members.index(world.rank())
        self.partner = members[1 - self._rank]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def all_sum(self, x: mx.array) -> mx.array:
        mx.eval(x)
        if self._rank == 0:
            mx.eval(mx.distributed.send(x, self.partner, group=self.world))
            other = mx.distributed.recv_like(x, self.partner, group=self.world)
            mx.eval(other)
        else:
            other = mx.distributed.recv_like(x, self.partner, group=self.world)
            mx.eval(other)
            mx.eval(mx.distributed.send(x, self.partner, group=self.world))
        return x + other  # IEEE addition commutes: both ranks hold the same sum


TensorGroup = mx.distributed.Group | PairGroup


def reduce_sum(x: mx.array, group: TensorGroup) -> mx.array:
    """The sum of `x` over the tensor-parallel ranks of `group`."""
    if isinstance(group, PairGroup):
        return group.all_sum(x)
    return mx.distributed.all_sum(x, group=group)


def stage_tensor_group(world: mx.distributed.Group, tp: int) -> TensorGroup:
    """This rank's stage's tensor-parallel ranks (world ranks `stage * tp .. stage * tp + tp - 1`)."""
    stage, first = world.rank() // tp, world.rank() // tp * tp
    if world.size() == tp:
        return world
    try:
        return world.split(stage, world.rank() % tp)
    except RuntimeError as exc:  # the ring backend: no sub-groups
        if tp != 2:
            raise ConfigError(
                f"--tensor-parallel-size {tp} with --pipeline-parallel-size > 1: this backend cannot split the "
                f"group ({exc}); without sub-groups a stage's ranks sum over send/recv, which serves 2 ranks"
            ) from exc
        return PairGroup(world, (first, first + 1))
