"""The group-major tensor dims of the SSD mixers (Mamba 2, discrete Mamba 2): one layout, one definition.

Head h reads B/C group h // (heads / groups), so the heads are laid out group by group. Only the group dim is
split between tensor-parallel ranks: a rank holds whole groups with their heads, their channels and their B/C
rows, and every dim built here splits alike.
"""

from __future__ import annotations

from blockzoo.api import CompositeTensorDim, TensorDim


class GroupMajorDims:
    """The dims of `heads` heads of `head_size` channels sharing `groups` B/C groups of `state_size`."""

    def __init__(self, *, heads: int, groups: int, head_size: int, state_size: int):
        self.group = TensorDim("groups", groups, parallel=True)
        self.group_heads = TensorDim("group_heads", heads // groups)
        self.head_size = TensorDim("head_size", head_size)
        self.state = TensorDim("state", state_size)

    def heads(self, role: str = "heads") -> CompositeTensorDim:
        """One entry per head (dt, dt_bias, A_log, D)."""
        return CompositeTensorDim(role, (self.group, self.group_heads))

    def inner(self, role: str) -> CompositeTensorDim:
        """One entry per channel of every head (x, z, the scan's output)."""
        return CompositeTensorDim(role, (self.group, self.group_heads, self.head_size))

    def group_state(self, role: str) -> CompositeTensorDim:
        """One state vector per group (B, C)."""
        return CompositeTensorDim(role, (self.group, self.state))
