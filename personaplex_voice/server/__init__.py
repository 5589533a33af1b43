"""The native server: `/api/chat` (PersonaPlex/Moshi protocol), prompts, voices, health, metrics, `web/`.

| module | job |
| --- | --- |
| `app` | `create_app(settings, host=None)`: routes, lifespan (engine load, session host start/stop) |
| `run` | `run(settings)`: the embedded server under uvicorn (what `serve` runs without cluster flags) |
| `chat` | one `/api/chat` WebSocket bridged to one Session |
| `protocol` | message kinds, encoders/decoders and `ChatParams` (reused by clients) |
| `access` | API key and Origin checks |
| `prompts` | `PromptStore`: prompts stored by `POST /api/prompts` for `?prompt_id=` |
| `info` | what the server says about itself (model names without paths, the reference client's fields) |
| `metrics` | the one Prometheus converter: every metrics snapshot of the process (server, host, workers) |
| `static` | where `web/` is at runtime |

Settings, engine loading, logging and the uvicorn setup every server process shares are
`personaplex_voice.process`'s.
"""
