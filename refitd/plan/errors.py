"""The one error type of the planner: bad layouts or registrations, found at plan time."""

from __future__ import annotations


class PlanError(ValueError):
    """A registration or layout the planner cannot serve; the message names the tensor,
    pool and rank involved and what is inconsistent."""
