"""The node agent process: one per host, it relays the controller's commands to the transfer
process of each device slot and reports back. It never imports torch or the executor."""
