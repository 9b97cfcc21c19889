"""The slot side of delta refits: the delta exchange of a slot's messages and its view of
the slot program's copies."""
