"""`personaplex-voice eval`: test a persona with scripted calls before a caller hears it.

Scenario files (YAML) say who answers, on which line, what the caller does and what must happen;
every scenario x repeat runs as a batched session of one SessionManager on an offline clock (or
in real time against a server's /api/chat), each call is measured from its audio with a real VAD
and the words a recogniser hears the agent say (its own text beside them), and the run leaves a
report, JSON results, JUnit XML and, on request, Full-Duplex-Bench samples. docs/eval.md is the
user's page.

| module          | job                                                                     |
| --------------- | ----------------------------------------------------------------------- |
| `yaml_source`   | YAML with line numbers; `ScenarioError` (file:line: problem)            |
| `scenario`      | the scenario file format, validated                                     |
| `steps`         | the caller's script steps                                               |
| `fdb_spec`      | `fdb:` scenarios: one Full-Duplex-Bench sample each, stable ids         |
| `phone`         | the one adapter onto the phone-call code (personas, action rules, μ-law path) |
| `lines`         | line registry: name -> codec path (wideband, twilio, browser)           |
| `speech`        | caller audio: espeak-ng `say`, `wav` files                              |
| `script`        | the caller playing its script frame by frame (barge-in cues)            |
| `call`          | one call: script + line + action rules + record (transport-neutral)    |
| `runner`        | batched in-process calls through one SessionManager (offline clock)     |
| `remote`        | `--url`: real-time calls over /api/chat                                 |
| `vad`           | silero-vad segments with refined boundaries; the streaming barge-in cue |
| `recognizer`    | words heard: pocketsphinx on the agent's speech                         |
| `measures`      | full-duplex measures of a call (pure)                                   |
| `fdb_measures`  | Full-Duplex-Bench's per-sample measures, restated from its scorers      |
| `expectations`  | checks and their pass rates over repeats                                |
| `results`       | analysis of finished calls, aggregates                                  |
| `outputs`, `junit`, `report`, `fdb` | the files in --out                                  |
| `suite`, `command`, `progress` | the run and the CLI                                      |
| `validation`    | the measures against clean audio on noisy, many-voiced conversations    |
"""
