"""`report.html`: one self-contained file (styles, script, plots and audio inside) that opens
offline in any browser.

- A summary table: per scenario its persona, line, repeats, a pass/fail badge per expectation
  (with its pass rate over the repeats) and the main measures.
- Per scenario: each expectation with its failures, the aggregates (mean, p90, min, max), and
  per call a timeline drawn as inline SVG: both waveforms (caller above, agent below), the VAD's
  speech segments behind them, the caller's lines and the agent's words at their times, and the
  expectation markers (response and stop latencies with their values, pauses, keys, actions),
  green when within the scenario's limits and red when not; then an audio player for the stereo
  call (caller left, agent right) whose playhead moves on the timeline.

Audio is embedded as Ogg-Opus while the report's embedded audio stays under
`EMBED_AUDIO_BYTES`; past that the player links to the call's WAV beside the report.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import soundfile

from .outputs import stereo, transcript_text
from .results import FDB_MEASURES, MEASURES, CallResult, RunSummary, ScenarioResult
from .scenario import Scenario

EMBED_AUDIO_BYTES = 48 * 1024 * 1024
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
WIDTH = 1000
X0 = 52  # left margin for lane labels
PLOT_W = WIDTH - X0 - 8
COLUMNS = 600  # waveform envelope resolution
CALLER_Y, AGENT_Y, LANE_H = 50, 128, 64
WORD_Y = 210
MARK_Y = 252
HEIGHT = 282
WORD_ROWS = 3


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _asset(name: str) -> str:
    return resources.files("personaplex_voice.eval").joinpath(name).read_text(encoding="utf-8")


class AudioBudget:
    """Bytes of audio the report may still embed."""

    def __init__(self, limit: int = EMBED_AUDIO_BYTES) -> None:
        self.left = limit


@dataclass
class CallMedia:
    """What the report draws and plays of one call, made while its audio is still at hand."""

    caller: np.ndarray  # [2, columns]: min and max of each column of the waveform
    agent: np.ndarray
    audio_src: str  # a data: URI, or the call's WAV relative to the report


def prepare_media(result: CallResult, budget: AudioBudget) -> CallMedia:
    return CallMedia(_columns(result.trace.caller), _columns(result.trace.agent), _audio_src(result, budget))


def _columns(pcm: np.ndarray) -> np.ndarray:
    if len(pcm) == 0:
        return np.zeros((2, 0), np.float32)
    cols = min(COLUMNS, len(pcm))
    edges = np.linspace(0, len(pcm), cols + 1).astype(int)[:-1]
    return np.stack([np.minimum.reduceat(pcm, edges), np.maximum.reduceat(pcm, edges)]).astype(np.float32)


def _audio_src(result: CallResult, budget: AudioBudget) -> str:
    """An Ogg-Opus data URI of the stereo call while the budget lasts, else the WAV's path."""
    rate = result.trace.plan.line.rate
    if rate in OPUS_RATES and len(result.trace.caller):
        buffer = io.BytesIO()
        soundfile.write(buffer, stereo(result), rate, format="OGG", subtype="OPUS")
        data = buffer.getvalue()
        encoded = len(data) * 4 // 3 + 4
        if encoded <= budget.left:
            budget.left -= encoded
            return "data:audio/ogg;base64," + base64.b64encode(data).decode("ascii")
    return result.files.get("wav", "")


def _x(t: float, duration: float) -> float:
    return X0 + (t / duration) * PLOT_W if duration > 0 else X0


def _envelope(columns: np.ndarray, y_mid: float, cls: str) -> str:
    cols = columns.shape[1]
    if cols == 0:
        return ""
    peak = max(float(np.max(np.abs(columns))), 1e-3)
    scale = (LANE_H / 2 - 2) / max(peak, 0.25)  # quiet calls stay visibly quiet
    top, bottom = [], []
    for c in range(cols):
        x = X0 + (c + 0.5) / cols * PLOT_W
        top.append(f"{x:.1f},{y_mid - float(columns[1, c]) * scale - 0.5:.1f}")
        bottom.append(f"{x:.1f},{y_mid - float(columns[0, c]) * scale + 0.5:.1f}")
    return f'<polygon class="{cls}" points="{" ".join(top + bottom[::-1])}"/>'


def _limits(scenario: Scenario) -> dict[str, int]:
    return {e.key: e.value for e in scenario.expectations if isinstance(e.value, int)}


def timeline_svg(result: CallResult) -> str:
    trace = result.trace
    d = max(trace.duration_s, 0.08)
    limits = _limits(trace.plan.scenario)
    parts: list[str] = [
        f'<svg class="timeline" viewBox="0 0 {WIDTH} {HEIGHT}" data-duration="{d:.3f}" data-x0="{X0}" '
        f'data-width="{PLOT_W}" role="img" aria-label="timeline of {_e(result.id)}" '
        'xmlns="http://www.w3.org/2000/svg">'
    ]
    # Speech as the VAD heard it, behind the waveforms.
    for segs, y, cls in (
        (result.caller_segments, CALLER_Y, "vad-caller"),
        (result.agent_segments, AGENT_Y, "vad-agent"),
    ):
        for s in segs:
            x1, x2 = _x(s.start, d), _x(s.end, d)
            parts.append(
                f'<rect class="{cls}" x="{x1:.1f}" y="{y - LANE_H / 2:.1f}" width="{max(0.5, x2 - x1):.1f}" '
                f'height="{LANE_H}"><title>speech {s.start:.2f}-{s.end:.2f} s</title></rect>'
            )
    # Pauses: red when the agent took the floor and the scenario limits takeovers.
    for p in result.measures.pauses:
        state = "fail" if p.taken_over and "max_pause_takeovers" in limits else "pass"
        x1, x2 = _x(p.start, d), _x(p.end, d)
        title = f"pause after turn {p.after_turn}: {'taken over' if p.taken_over else 'agent kept quiet'}"
        parts.append(
            f'<rect class="pause-band {state}" x="{x1:.1f}" y="{CALLER_Y - LANE_H / 2:.1f}" '
            f'width="{max(0.5, x2 - x1):.1f}" height="{AGENT_Y - CALLER_Y + LANE_H:.1f}">'
            f"<title>{_e(title)}</title></rect>"
        )
    media = (
        result.media
        if result.media is not None
        else CallMedia(_columns(trace.caller), _columns(trace.agent), "")
    )
    parts.append(_envelope(media.caller, CALLER_Y, "wave-caller"))
    parts.append(_envelope(media.agent, AGENT_Y, "wave-agent"))
    parts.append(f'<text class="lane-label" x="4" y="{CALLER_Y + 4}">caller</text>')
    parts.append(f'<text class="lane-label" x="4" y="{AGENT_Y + 4}">agent</text>')
    parts.append(f'<text class="lane-label" x="4" y="{WORD_Y}">words</text>')
    # Time axis.
    step = next(s for s in (0.5, 1, 2, 5, 10, 30, 60, 300) if d / s <= 16)
    parts.append(f'<line class="axis" x1="{X0}" x2="{X0 + PLOT_W}" y1="{HEIGHT - 12}" y2="{HEIGHT - 12}"/>')
    t = 0.0
    while t <= d + 1e-9:
        x = _x(t, d)
        parts.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{HEIGHT - 15}" y2="{HEIGHT - 9}"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - 1}" text-anchor="middle">{t:g}s</text>')
        t += step
    # The caller's lines above their speech, the agent's words at their times.
    for turn in trace.log.turns:
        label = turn.text if len(turn.text) <= 48 else turn.text[:47] + "…"
        parts.append(
            f'<text class="turn-text" x="{_x(turn.start, d):.1f}" y="{CALLER_Y - LANE_H / 2 - 3:.1f}">'
            f"{turn.number}: {_e(label)}<title>{_e(turn.text)}</title></text>"
        )
    # Words heard in the agent's audio (the recogniser) above, the model's own text below.
    for i, word in enumerate(result.heard or []):
        y = WORD_Y - 22 + (i % 2) * 10
        parts.append(
            f'<text class="word heard" x="{_x(word.start, d):.1f}" y="{y}">{_e(word.text)}'
            f"<title>heard {word.start:.2f}-{word.end:.2f} s: {_e(word.text)}</title></text>"
        )
    for i, piece in enumerate(trace.pieces):
        y = WORD_Y + (0 if result.heard is None else 4) - 14 + (i % WORD_ROWS) * 11
        parts.append(
            f'<text class="word meant" x="{_x(piece.t, d):.1f}" y="{y}">{_e(piece.text.strip())}'
            f"<title>model's text {piece.t:.2f} s: {_e(piece.text)}</title></text>"
        )
    parts.extend(_markers(result, d, limits))
    parts.append(
        f'<line class="playhead" x1="{X0}" x2="{X0}" y1="{CALLER_Y - LANE_H / 2 - 12:.1f}" '
        f'y2="{HEIGHT - 12}"/>'
    )
    parts.append("</svg>")
    return "".join(parts)


def _markers(result: CallResult, d: float, limits: dict[str, int]) -> list[str]:
    out: list[str] = []

    def bracket(t1: float, t2: float, y: float, label: str, state: str, title: str) -> None:
        x1, x2 = _x(min(t1, t2), d), _x(max(t1, t2), d)
        out.append(
            f"<g><title>{_e(title)}</title>"
            f'<line class="marker {state}" x1="{x1:.1f}" x2="{x2:.1f}" y1="{y}" y2="{y}"/>'
            f'<line class="marker {state}" x1="{x1:.1f}" x2="{x1:.1f}" y1="{y - 4}" y2="{y + 4}"/>'
            f'<line class="marker {state}" x1="{x2:.1f}" x2="{x2:.1f}" y1="{y - 4}" y2="{y + 4}"/>'
            f'<text class="marker-label {state}" x="{x2 + 3:.1f}" y="{y + 3}">{_e(label)}</text></g>'
        )

    for turn in result.measures.turns:
        if turn.then == "answer":
            limit = limits.get("responds_within_ms")
            if turn.response_ms is None:
                x = _x(turn.end, d)
                state = "fail" if limit is not None else "info"
                out.append(
                    f'<g><title>{_e(turn.label)}: no answer</title><text class="marker-label {state}" '
                    f'x="{x:.1f}" y="{MARK_Y}">no answer</text></g>'
                )
            else:
                state = "info" if limit is None else ("pass" if turn.response_ms <= limit else "fail")
                bracket(
                    turn.end,
                    turn.end + turn.response_ms / 1000,
                    MARK_Y,
                    f"{turn.response_ms:.0f} ms",
                    state,
                    f"{turn.label}: response latency {turn.response_ms:.0f} ms"
                    + (f" (limit {limit} ms)" if limit is not None else ""),
                )
        if turn.stop_ms is not None:
            limit = limits.get("stops_within_ms")
            state = "info" if limit is None else ("pass" if turn.stop_ms <= limit else "fail")
            bracket(
                turn.start,
                turn.start + turn.stop_ms / 1000,
                AGENT_Y + LANE_H / 2 + 6,
                f"stop {turn.stop_ms:.0f} ms",
                state,
                f"{turn.label}: the agent stopped {turn.stop_ms:.0f} ms after the barge-in"
                + (f" (limit {limit} ms)" if limit is not None else ""),
            )
    for t, key in result.trace.log.keys:
        x = _x(t, d)
        out.append(
            f"<g><title>caller pressed {_e(key)} at {t:.2f} s</title>"
            + _flag(x, CALLER_Y, f"key {_e(key)}", bottom=True)
        )
    for action in result.trace.actions:
        x = _x(action.t, d)
        out.append(
            f"<g><title>{_e(action.what)} ({_e(action.trigger)}) at {action.t:.2f} s</title>"
            + _flag(x, AGENT_Y, _e(action.kind), bottom=False)
        )
    return out


def _flag(x: float, lane_y: float, label: str, *, bottom: bool) -> str:
    """A vertical line across a lane with a small label (a key press, an action)."""
    y1, y2 = lane_y - LANE_H / 2, lane_y + LANE_H / 2
    text_y = y2 - 2 if bottom else y1 + 10
    return (
        f'<line class="marker info" x1="{x:.1f}" x2="{x:.1f}" y1="{y1:.1f}" y2="{y2:.1f}"/>'
        f'<text class="marker-label info" x="{x + 2:.1f}" y="{text_y:.1f}">{label}</text></g>'
    )


def _state(passed: bool) -> str:
    return "pass" if passed else "fail"


_DECIMALS = {"ms": 0, "s": 2, "rate": 3, "/s": 3}  # rates as FDB prints them


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    return f"{value:.{_DECIMALS.get(unit, 1)}f}"


def _summary_row(sr: ScenarioResult) -> str:
    badges = (
        " ".join(
            f'<span class="badge {"pass" if e.passed else "fail"}" title="{_e(e.where)}">{_e(e.label)} '
            f"{e.pass_rate:.0%}</span>"
            for e in sr.expectations
        )
        or '<span class="muted">no expectations</span>'
    )
    resp, stop = sr.aggregates["response_ms"], sr.aggregates["stop_ms"]
    line = sr.calls[0].trace.plan.line.name if sr.calls else sr.scenario.line
    state = "pass" if sr.passed else "fail"
    return (
        f'<tr><td><a href="#sc-{_e(sr.scenario.name)}">{_e(sr.scenario.name)}</a></td>'
        f"<td>{_e(sr.scenario.persona_name)}</td><td>{_e(line)}</td><td class=num>{len(sr.calls)}</td>"
        f"<td>{badges}</td><td class='num {state}'>{sr.pass_rate:.0%}</td>"
        f"<td class=num>{_fmt(resp['mean'], 'ms')} / {_fmt(resp['p90'], 'ms')}</td>"
        f"<td class=num>{_fmt(stop['mean'], 'ms')} / {_fmt(stop['p90'], 'ms')}</td></tr>"
    )


def _scenario_section(sr: ScenarioResult) -> str:
    sc = sr.scenario
    parts = [
        f'<section class="scenario" id="sc-{_e(sc.name)}"><h2>{_e(sc.name)} '
        f'<span class="{"pass" if sr.passed else "fail"}">{"passed" if sr.passed else "failed"}</span></h2>',
        f'<p class="muted">{_e(sc.where)} · persona {_e(sc.persona_name)} · {len(sr.calls)} repeat(s)'
        + (f" · {_e(sc.description)}" if sc.description else "")
        + "</p>",
        "<table><tr><th>expectation</th><th>held in</th><th>result</th><th>failures</th></tr>",
    ]
    for e in sr.expectations:
        fails = "<br>".join(f"repeat {r + 1}: {_e(m)}" for r, m in e.failures) or "–"
        parts.append(
            f"<tr><td>{_e(e.label)}<br><span class=muted>{_e(e.where)}</span></td>"
            f"<td class=num>{e.passes}/{e.runs}</td>"
            f'<td class="{_state(e.passed)}">{_state(e.passed)}</td><td>{fails}</td></tr>'
        )
    parts.append("</table>")
    parts.append(
        "<table><tr><th>measure</th><th>mean</th><th>p90</th><th>min</th><th>max</th><th>n</th></tr>"
    )
    for name, (unit, what) in MEASURES.items():
        a = sr.aggregates[name]
        if name in FDB_MEASURES and not a["n"]:
            continue  # FDB's measures: only for scenarios that are its samples
        parts.append(
            f"<tr><td>{_e(what)}{f' ({unit})' if unit else ''}</td>"
            + "".join(f"<td class=num>{_fmt(a[k], unit)}</td>" for k in ("mean", "p90", "min", "max"))
            + f"<td class=num>{a['n']}</td></tr>"
        )
    parts.append("</table>")
    for call in sr.calls:
        parts.append(_call_block(call))
    parts.append("</section>")
    return "".join(parts)


def _call_block(call: CallResult) -> str:
    trace = call.trace
    state = "pass" if call.passed else "fail"
    head = (
        f'<div class="call" id="call-{_e(call.id)}"><h3>{_e(call.id)} '
        f'<span class="muted">seed {trace.plan.seed} · {trace.duration_s:.1f} s · '
        f"line {_e(trace.plan.line.name)}</span> "
        f'<span class="{state}">{"passed" if call.passed else "failed"}</span></h3>'
    )
    if trace.error:
        head += f'<p class="fail">{_e(trace.error)}</p>'
    if trace.ended_by:
        head += f'<p class="muted">call ended by {_e(trace.ended_by)}</p>'
    outcomes = "".join(
        f'<li class="{"pass" if o.passed else "fail"}">{_e(o.label)}: {_e(o.message)}'
        + (
            f' <span class="muted">(on the model\'s text: {_state(o.by_text)})</span>'
            if o.by_text is not None
            else ""
        )
        + "</li>"
        for o in call.outcomes
    )
    src = call.media.audio_src if call.media is not None else call.files.get("wav", "")
    audio = f'<audio controls preload="metadata" src="{_e(src)}"></audio>' if src else ""
    files = " · ".join(f'<a href="{_e(p)}">{_e(Path(p).name)}</a>' for p in call.files.values())
    return (
        head
        + timeline_svg(call)
        + audio
        + _words_block(call)
        + _fdb_block(call)
        + (f'<ul class="outcomes">{outcomes}</ul>' if outcomes else "")
        + f"<details><summary>transcript</summary><pre>{_e(transcript_text(call))}</pre></details>"
        + (f'<p class="muted">{files}</p>' if files else "")
        + "</div>"
    )


def _words_block(call: CallResult) -> str:
    """What the agent said, twice: heard in its audio (what decides) and its own text stream;
    then each words check the two decide differently."""
    text = call.transcript.strip() or "(nothing)"
    if call.heard is None:
        return f'<p class="text-words"><b>model\'s text</b> {_e(text)}</p>'
    parts = [
        f'<div class="words"><p class="heard-words"><b>heard</b> {_e(call.heard_text or "(nothing)")}</p>',
        f'<p class="text-words"><b>model\'s text</b> {_e(text)}</p>',
    ]
    for o in call.disagreements:
        parts.append(
            f'<p class="disagree">audio and text disagree on {_e(o.label)}: heard → {_state(o.passed)}, '
            f"text → {_state(bool(o.by_text))} ({_e(o.text_message)})</p>"
        )
    return "".join(parts) + "</div>"


def _fdb_block(call: CallResult) -> str:
    spec = call.trace.plan.scenario.fdb
    if spec is None or call.fdb is None:
        return ""
    f = call.fdb
    values = [f"TOR {f.tor}"]
    if f.latency_s is not None:
        values.append(f"latency {f.latency_s:.3f} s")
    if f.frequency is not None:
        values.append(f"backchannels {f.backchannels} ({f.frequency:.3f}/s)")
    return (
        f'<p class="fdb">Full-Duplex-Bench sample r{call.trace.plan.repeat + 1}/{_e(spec.task)}/{spec.id}: '
        f"{_e(', '.join(values))} <span class=muted>(FDB's rules, words heard here)</span></p>"
    )


def render(summary: RunSummary) -> str:
    passed, total = summary.checks
    state = (
        "pass"
        if passed == total and not any(c.trace.error for sr in summary.scenarios for c in sr.calls)
        else "fail"
    )
    run = summary.run
    where = run.get("url") or f"{run.get('engine', '?')} · model {run.get('model', '?')}"
    info = (
        f"{run.get('calls', 0)} call(s) · {run.get('audio_s', 0):.1f} s of audio "
        f"in {run.get('wall_s', 0):.1f} s"
        + (f" ({run['x_realtime']:.1f}× real time)" if run.get("x_realtime") else "")
        + f" · {where}"
    )
    body = [
        "<header><h1>Persona eval</h1>",
        f'<p class="muted">{_e(info)}</p>',
        f'<p class="verdict {state}">{passed} of {total} expectation checks passed '
        f"({summary.pass_rate:.0%})</p>",
        '<p class="legend"><span><i style="background:#1f6feb"></i>caller</span>'
        '<span><i style="background:#d4570a"></i>agent</span>'
        '<span><i style="background:#1a7f37"></i>within limits</span>'
        '<span><i style="background:#cf222e"></i>outside limits</span></p></header><main>',
        "<h2>Summary</h2><table><tr><th>scenario</th><th>persona</th><th>line</th><th>repeats</th>"
        "<th>expectations (pass rate)</th><th>all held</th><th>response mean / p90 (ms)</th>"
        "<th>stop mean / p90 (ms)</th></tr>",
        *(_summary_row(sr) for sr in summary.scenarios),
        "</table>",
        *(_scenario_section(sr) for sr in summary.scenarios),
        "</main><footer>personaplex-voice eval · measures defined in docs/eval.md</footer>",
    ]
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,"><title>personaplex-voice eval report</title>'
        f"<style>{_asset('report.css')}</style></head><body>"
        + "".join(body)
        + f"<script>{_asset('report.js')}</script></body></html>\n"
    )


def write_report(out: Path, summary: RunSummary) -> Path:
    path = out / "report.html"
    path.write_text(render(summary), encoding="utf-8")
    return path
