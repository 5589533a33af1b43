"""Process-level code every server process shares (the embedded server, cluster front-ends,
engine workers, the supervisor): nothing here knows the app's routes or the cluster.

| module | job |
| --- | --- |
| `settings` | `ServerSettings` (flags and `PERSONAPLEX_*` environment variables), from a file too |
| `engine_loader` | the engine the settings ask for (echo without torch; dtype, threads, files), warmed |
| `logs` | log format and filters (API keys out of request lines) |
| `checks` | the files the settings name exist, before anything starts |
| `http_guard` | uvicorn protocol classes: request-line/header limits, head timeouts, answered upgrades |
| `uvicorn_setup` | the uvicorn config and server class every HTTP process runs |
| `tls` | `--ssl DIR`: the pair found and checked, or a self-signed one made there and reused |
| `runtime` | process-wide interpreter settings for realtime (gc.freeze, GIL switch interval) |
| `loop_monitor` | the event loop's lag and load, sampled into the process's headroom (saturation) |
"""
