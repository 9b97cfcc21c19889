"""The executor: prepares a slot program over resolved tensors once and runs its refits
(local copies and pipelined messages, zero-copy where possible, bounded staging)."""
