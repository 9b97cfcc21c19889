"""Worker memory that a transfer process reads and writes in place; not a transport.

Worker side (client library): `arena.SharedTensorArena` moves the storage of registered CPU
tensors into POSIX shared memory without replacing the tensor objects, and exports GPU
tensors as CUDA IPC handles. Each registration yields a `handles.MemoryHandle` (the opaque
`memory` bytes of the proto). Transfer side: `mapping.MemoryMapper.map_handle` turns a
handle back into a tensor over the same bytes.

Every arena owns a small state segment with one word per registered storage. The worker
marks a word stale when it finds that storage moved (`check_unmoved`) or when it closes, and
the transfer side refuses stale handles (`mapping.check_live_words`), so moved storage is
never read or written stale.

A worker killed with -9 cannot unlink its segments (POSIX shared memory outlives its
creator), so the creator holds a shared flock on each segment for its lifetime and
`segment_names.reap_orphaned_segments` (run by node agents and new arenas) unlinks the
ones nobody holds.

The package, imported one way: errors, segment_names, handles (no torch: the node agent
and the error mapping import them) <- segments (mappings) <- arena, mapping.
"""
