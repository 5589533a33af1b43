"""`personaplex-voice eval`: run scenario files as scripted calls and write the report.

Exit status: 0 when the pass rate (expectation checks passed / made, over every repeat) is at
least `--fail-under` and every call ran; 1 otherwise; 2 for a bad scenario file or option (one
line naming the file, the line and the problem).
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
from pathlib import Path
from typing import Annotated

import typer

from personaplex_voice.cli_options import (
    DEFAULT_MODEL,
    DeviceOpt,
    DtypeOpt,
    KvDtype,
    KvDtypeOpt,
    MimiWeightOpt,
    ModelOpt,
    MoshiWeightOpt,
    PrefillMode,
    PrefillOpt,
    QuantizeMode,
    QuantizeOpt,
    ThreadsOpt,
    TokenizerOpt,
    VoiceDirOpt,
)
from personaplex_voice.errors import UserError

from .steps import CallerVoice

# What `--engine scripted` says (a dry run of scenario files without a model).
SCRIPTED_REPLIES = (
    "Thank you for calling. How can I help you today?",
    "I see. Let me check that for you right away.",
)
SCRIPTED_VOICE = CallerVoice(voice="en-us+f2", rate=150)  # a voice the recogniser hears well
SCRIPTED_RESPOND_MS = 300
SCRIPTED_STOP_MS = 200


def eval_command(
    scenarios: Annotated[list[Path], typer.Argument(help="Scenario files (YAML, see docs/eval.md).")],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for report.html, results.json, junit.xml, calls/.")
    ],
    model: ModelOpt = DEFAULT_MODEL,
    engine: Annotated[
        str,
        typer.Option(
            "--engine", help="model (the --model), or scripted: a fixed-timing test agent, no model."
        ),
    ] = "model",
    url: Annotated[
        str | None,
        typer.Option("--url", help="Run against a deployed server in real time: ws://host:port/api/chat."),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="PERSONAPLEX_API_KEY", help="Bearer key for --url.")
    ] = None,
    repeat: Annotated[
        int, typer.Option("--repeat", help="Runs of each scenario (seeds base, base+1, ...).")
    ] = 1,
    line: Annotated[
        str | None, typer.Option("--line", help="Run every scenario on this line instead.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Base seed of scenarios whose persona has none.")] = 0,
    fdb: Annotated[
        Path | None,
        typer.Option("--fdb", help="Also write the `fdb:` scenarios as Full-Duplex-Bench samples here."),
    ] = None,
    words: Annotated[
        str,
        typer.Option(
            "--words",
            help="heard: a speech recogniser on the agent's audio decides agent_says and the word "
            "counts (the model's text is kept beside it); text: the model's own text decides.",
        ),
    ] = "heard",
    fail_under: Annotated[
        float, typer.Option("--fail-under", help="Exit 1 when the pass rate (0-1) is below this.")
    ] = 1.0,
    max_sessions: Annotated[
        int, typer.Option("--max-sessions", help="Calls run together (engine batch slots).")
    ] = 32,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Calls at once with --url.")] = 4,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress output.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    prefill: PrefillOpt = PrefillMode.parallel,
    quantize: QuantizeOpt = QuantizeMode.none,
    kv_dtype: KvDtypeOpt = KvDtype.auto,
    threads: ThreadsOpt = 0,
    moshi_weight: MoshiWeightOpt = None,
    mimi_weight: MimiWeightOpt = None,
    tokenizer: TokenizerOpt = None,
    voice_prompt_dir: VoiceDirOpt = None,
) -> None:
    """Test personas with scripted calls: timing, words and actions, batched, with a report."""
    from .lines import LINES

    if repeat < 1:
        raise UserError(f"--repeat {repeat}: must be at least 1")
    if not 0.0 <= fail_under <= 1.0:
        raise UserError(f"--fail-under {fail_under}: must be between 0 and 1")
    if line is not None and line not in LINES:
        raise UserError(f"--line {line}: unknown line; lines: {', '.join(LINES)}")
    if engine not in ("model", "scripted"):
        raise UserError(f"--engine {engine}: choose model or scripted")
    if url is not None and engine != "model":
        raise UserError("--engine runs calls in this process; --url runs them on the server: give one")
    if url is not None and not url.startswith(("ws://", "wss://")):
        raise UserError(f"--url {url}: must start with ws:// or wss:// (e.g. ws://host:8998/api/chat)")
    if max_sessions < 1 or concurrency < 1:
        raise UserError("--max-sessions and --concurrency must be at least 1")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")

    if words not in ("heard", "text"):
        raise UserError(f"--words {words}: choose heard or text")
    if importlib.util.find_spec("silero_vad") is None:
        raise UserError("eval measures calls with silero-vad: pip install 'personaplex-voice[eval]'")
    if words == "heard" and importlib.util.find_spec("pocketsphinx") is None:
        raise UserError(
            "eval hears the agent with pocketsphinx: pip install 'personaplex-voice[eval]' "
            "(or --words text to judge the model's own text)"
        )

    from .progress import Progress
    from .scenario import load_scenarios
    from .speech import ClipBook
    from .suite import plan_calls, run_suite

    loaded = load_scenarios(scenarios)
    if fdb is not None:
        _check_fdb_samples(loaded)
    plans = plan_calls(loaded, repeat=repeat, base_seed=seed, line=line)
    clips = ClipBook()
    clips.add_scenarios(loaded)
    for option, folder in (("--out", out), ("--fdb", fdb)):
        if folder is None:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"{option} {folder}: cannot make the folder ({exc.strerror or exc})") from None

    built = None
    run_info: dict = {
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "scenario_files": [str(p) for p in scenarios],
        "repeat": repeat,
        "fail_under": fail_under,
    }
    if url is None:
        slots = min(len(plans), max_sessions)
        built = _build_engine(
            engine,
            model,
            slots,
            device=device,
            dtype=dtype,
            prefill=prefill,
            quantize=quantize,
            kv_dtype=kv_dtype,
            threads=threads,
            overrides=(moshi_weight, mimi_weight, tokenizer, voice_prompt_dir),
        )
        _preflight(built, plans)
        run_info.update(engine=engine, model=model if engine == "model" else "scripted", slots=slots)

    progress = Progress(len(plans), enabled=not quiet)
    summary, _ = asyncio.run(
        run_suite(
            loaded,
            plans,
            clips,
            out,
            engine=built,
            url=url,
            api_key=api_key,
            concurrency=concurrency,
            fdb_dir=fdb,
            progress=progress,
            run_info=run_info,
            words=words,
        )
    )
    passed, total = summary.checks
    errors = [c for sr in summary.scenarios for c in sr.calls if c.trace.error is not None]
    typer.echo(
        f"eval: {passed} of {total} expectation checks passed ({summary.pass_rate:.0%}) in "
        f"{len(summary.scenarios)} scenario(s) x {repeat}; report: {out / 'report.html'}"
    )
    for sr in summary.scenarios:
        for exp in sr.expectations:
            if not exp.passed:
                first = exp.failures[0][1] if exp.failures else ""
                typer.echo(f"  FAIL {sr.scenario.name}: {exp.label} ({exp.passes}/{exp.runs}) {first}")
    for call in errors:
        typer.echo(f"  ERROR {call.id}: {call.trace.error}")
    if errors or summary.pass_rate + 1e-9 < fail_under:
        raise typer.Exit(1)


def _check_fdb_samples(loaded) -> None:
    """`--fdb` exports the scenarios that are FDB samples (`fdb:`); whole calls are not: FDB scores
    every word of a sample as one event, so an opening greeting would score as taking the turn."""
    whole_calls = [s.name for s in loaded if s.fdb is None]
    if len(whole_calls) == len(loaded):
        raise UserError(
            "--fdb: no scenario is a Full-Duplex-Bench sample; FDB scores each sample as one event over "
            "its whole output, so a whole call (greeting first) would score as taking the turn. Give the "
            "scenarios to export `fdb: <task>` (docs/eval.md, Full-Duplex-Bench)"
        )
    if whole_calls:
        typer.echo(
            f"warning: --fdb exports only the fdb: scenarios; {len(whole_calls)} whole call(s) are not "
            f"Full-Duplex-Bench samples and are left out: {', '.join(whole_calls)}",
            err=True,
        )


def _build_engine(
    engine: str, model: str, slots: int, *, device, dtype, prefill, quantize, kv_dtype, threads, overrides
):
    if engine == "scripted":
        from personaplex_voice.engine.scripted import Reply, ScriptedEngine

        from .speech import synthesize

        replies = [
            Reply(text, synthesize(text, SCRIPTED_VOICE, "--engine scripted")) for text in SCRIPTED_REPLIES
        ]
        return ScriptedEngine(
            slots,
            replies=replies,
            respond_after_ms=SCRIPTED_RESPOND_MS,
            stop_after_ms=SCRIPTED_STOP_MS,
            greet=True,
        )
    from personaplex_voice.engine.factory import build_engine
    from personaplex_voice.engine.options import (
        configure_threads,
        engine_options,
        parse_dtype,
        source_overrides,
    )

    moshi_weight, mimi_weight, tokenizer, voice_prompt_dir = overrides
    if threads:
        configure_threads(threads, None)
    built = build_engine(
        model,
        num_slots=slots,
        device=device,
        dtype=parse_dtype(dtype),
        **engine_options(prefill, quantize, kv_dtype),
        **source_overrides(moshi_weight, mimi_weight, tokenizer, voice_prompt_dir),
    )
    configure_threads(threads, built)
    return built


def _preflight(engine, plans) -> None:
    """Every distinct persona is accepted by the engine (voice known, prompt not too long)
    before any call starts; a refusal names the scenario."""
    from personaplex_voice.engine.base import PersonaError

    from .yaml_source import ScenarioError

    seen: set = set()
    for plan in plans:
        key = (plan.persona.text_prompt, plan.persona.voice)
        if key in seen:
            continue
        seen.add(key)
        try:
            engine.prepare(plan.persona)
        except PersonaError as exc:
            where = plan.scenario.persona_where or plan.scenario.where
            raise ScenarioError(where, f"scenario {plan.scenario.name!r}: {exc}") from None
