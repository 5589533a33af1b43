"""The native server: `/api/chat` (PersonaPlex/Moshi protocol), prompts, voices, health, metrics, `web/`.

| module | job |
| --- | --- |
| `config` | `ServerSettings` (flags and `PERSONAPLEX_*` environment variables) |
| `app` | `create_app(settings, manager=None)`: routes, lifespan (engine load, manager start/stop) |
| `command` | the `personaplex-voice serve` command (uvicorn) |
| `chat` | one `/api/chat` WebSocket bridged to one Session |
| `protocol` | message kinds, encoders/decoders and `ChatParams` (reused by clients) |
| `access` | API key and Origin checks |
| `http_guard` | uvicorn protocol classes: request-line/header limits, head timeouts, answered upgrades |
| `prompts` | `PromptStore`: prompts stored by `POST /api/prompts` for `?prompt_id=` |
| `info` | what the server says about itself (model names without paths, the reference client's fields) |
| `metrics` | Prometheus export of the manager's and the server's instruments |
| `engine_loader` | the engine the settings ask for (echo without torch; dtype, threads, files) |
| `runtime` | process-wide interpreter settings for realtime (gc.freeze, GIL switch interval) |
| `static` | where `web/` is at runtime |
"""
