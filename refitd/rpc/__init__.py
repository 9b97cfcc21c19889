"""gRPC plumbing shared by every process that calls the controller (workers and node agents):
a channel with deadlines, TLS and token (`connection.ControllerConnection`), `Backoff` and
`RefitError`."""
