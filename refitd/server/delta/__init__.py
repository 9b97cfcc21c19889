"""Delta refits on the controller's side: which messages of a refit go as deltas.

- policy: version safety, pure; the ledger of what each worker provably holds and the
  per-message decision (`decide`) and whole-refit mode (`refit_mode`)
- plan: a plan's messages as the policy sees them, computed once per plan digest
- refits: `DeltaRefits`, per refit the DeltaCommands of every slot, the agents' outcomes
  folded into the record and the ledger kept current on commit, failure and catch-up

Imported one way: policy <- plan <- refits. Off unless Settings.delta_refits.
"""
