"""The refit coordinator, one idea per module.

- run: a refit run, its states and attempt ids
- scheduler: the barrier and coalescing (which version runs next)
- membership: registry snapshot + plan -> Membership (the one slot -> agent mapping)
- commander: the only place that builds agent commands and gathers their reports
- events: version events (PAUSE, COMMIT, ABORT, INCOMPLETE) to destination workers
- lifecycle: the attempts of one refit (pause, transfer, apply, commit, retry)
- acks: COMMIT acks collected off the critical path
- catchup: restarted destination ranks caught up from replicas
- leases: lease expiry, and paused re-registrations told how their refit ended
- records: final states, history and metrics
- checksums: the senders' and receivers' checksums compared
- coordinator: composes them; the Refit RPC and the per-model driver threads
"""
