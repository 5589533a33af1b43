"""`personaplex-voice eval`: test a persona with scripted calls before a caller hears it.

Scenario files (YAML) say who answers, on which line, what the caller does and what must happen;
every scenario x repeat runs as a batched session of one SessionManager on an offline clock (or
in real time against a server's /api/chat), each call is measured from its audio with a real VAD
and the agent's text, and the run leaves a report, JSON results, JUnit XML and, on request, the
Full-Duplex-Bench layout. docs/eval.md is the user's page.

| module          | job                                                                     |
| --------------- | ----------------------------------------------------------------------- |
| `yaml_source`   | YAML with line numbers; `ScenarioError` (file:line: problem)            |
| `scenario`      | the scenario file format, validated                                     |
| `phone`         | the one adapter onto the phone-call code (personas, action rules, μ-law path) |
| `lines`         | line registry: name -> codec path (wideband, twilio, browser)           |
| `speech`        | caller audio: espeak-ng `say`, `wav` files                              |
| `script`        | the caller playing its script frame by frame (barge-in cues)            |
| `call`          | one call: script + line + action rules + record (transport-neutral)    |
| `runner`        | batched in-process calls through one SessionManager (offline clock)     |
| `remote`        | `--url`: real-time calls over /api/chat                                 |
| `vad`           | silero-vad segments with refined boundaries; the streaming barge-in cue |
| `measures`      | full-duplex measures of a call (pure)                                   |
| `expectations`  | checks and their pass rates over repeats                                |
| `results`       | analysis of finished calls, aggregates                                  |
| `outputs`, `junit`, `report`, `fdb` | the files in --out                                  |
| `suite`, `command`, `progress` | the run and the CLI                                      |
"""
