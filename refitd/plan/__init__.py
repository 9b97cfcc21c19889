"""Layouts, canonical names, the planner and its buckets: pure Python + NumPy, no I/O."""

from refitd.plan.layout import Box, TensorSpec
from refitd.plan.program import Copy, Message, SlotProgram

__all__ = ["Box", "Copy", "Message", "SlotProgram", "TensorSpec"]
