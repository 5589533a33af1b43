"""Past one process: engine workers (one engine each) and front-ends (every transport, no torch).

| module | job |
| --- | --- |
| `wire` | the session protocol's messages and framing (same bytes on Unix sockets and TCP) |
| `worker` | `EngineWorker`: one engine's `SessionManager` served over the protocol; its process |
| `client` | `ClusterClient` / `RemoteSession`: the `SessionManager` API over engine workers |
| `placement` | which worker a session goes to (free slot, persona cache), persona fingerprints |
| `frontend` | a front-end process: the server app on a shared port, drain on SIGTERM |
| `supervisor` | `serve --workers/--engine-workers/--gpus/--ray`: starts, restarts, stops the processes |
| `ray_actors` | engine workers as Ray actors, discovery of them (the `cluster` extra) |
| `observe` | the workers' Prometheus series on a front-end's `/metrics` |
| `procs` | process helpers: CPU time, parent-death signal, hop samples, host identity |

See docs/cluster.md.
"""
