"""The transfer process: one OS process per device slot, holding the slot's communicator,
mapped worker memory and loaded plans, and running the node agent's typed commands."""
