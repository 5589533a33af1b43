"""A whole eval run: scenarios -> calls -> results -> the files in `--out`.

`plan_calls` makes one `CallPlan` per scenario and repeat (repeat r of a scenario uses seed
`base + r`, the base being the scenario's `seed`, else its persona's, else `--seed`). `run_suite`
runs them (in process through one batched `SessionManager`, or against `--url`), and as calls
finish, in batches, measures them (`results.analyze`, a worker thread: the VAD batches across
calls, the recogniser hears each agent), writes each call's files (and its Full-Duplex-Bench
sample) and keeps only the results:
the audio of a finished call is not held for the rest of the run. Then the aggregates,
`results.json`, `junit.xml` and `report.html`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from personaplex_voice.engine.base import Engine

from . import phone
from .call import CallPlan, CallTrace
from .fdb import FdbWriter
from .junit import write_junit
from .lines import get_line
from .outputs import write_call_files, write_results
from .progress import Progress
from .recognizer import Recognizer
from .report import AudioBudget, prepare_media, write_report
from .results import CallResult, RunSummary, aggregate, analyze
from .scenario import Scenario
from .speech import ClipBook

WORD_SOURCES = ("heard", "text")
ANALYSIS_BATCH = 16  # calls measured together (32 VAD streams in one batch)


def plan_calls(
    scenarios: Sequence[Scenario], *, repeat: int = 1, base_seed: int = 0, line: str | None = None
) -> list[CallPlan]:
    plans = []
    for scenario in scenarios:
        base = scenario.seed if scenario.seed is not None else scenario.spec.persona.seed
        base = base_seed if base is None else base
        persona = phone.render(scenario.spec, scenario.variables, scenario.call_facts())
        for r in range(repeat):
            plans.append(
                CallPlan(
                    scenario=scenario,
                    repeat=r,
                    seed=base + r,
                    persona=replace(persona, seed=base + r),
                    line=get_line(line or scenario.line),
                )
            )
    return plans


@dataclass
class _Finisher:
    """Measures finished calls in batches and writes their files; keeps the results."""

    out: Path
    fdb: FdbWriter | None
    progress: Progress
    recognizer: Recognizer | None
    results: list[CallResult] = field(default_factory=list)
    pending: list[CallTrace] = field(default_factory=list)
    budget: AudioBudget = field(default_factory=AudioBudget)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def add(self, trace: CallTrace) -> None:
        self.progress.call_done(trace.plan.id, trace.error)
        self.pending.append(trace)
        if len(self.pending) >= ANALYSIS_BATCH:
            await self.flush()

    async def flush(self) -> None:
        async with self.lock:  # one batch at a time, in the order calls finished
            batch, self.pending = self.pending, []
            if batch:
                self.results.extend(await asyncio.to_thread(self._finish, batch))

    def _finish(self, batch: list[CallTrace]) -> list[CallResult]:
        results = analyze(batch, self.recognizer)
        for result in results:
            write_call_files(self.out, result)
            if self.fdb is not None:
                self.fdb.add(result)
            result.media = prepare_media(result, self.budget)
            result.trace.release_audio()
        return results


async def run_suite(
    scenarios: Sequence[Scenario],
    plans: Sequence[CallPlan],
    clips: ClipBook,
    out: Path,
    *,
    engine: Engine | None = None,
    url: str | None = None,
    api_key: str | None = None,
    concurrency: int = 4,
    fdb_dir: Path | None = None,
    progress: Progress | None = None,
    run_info: dict[str, Any] | None = None,
    words: str = "heard",
) -> tuple[RunSummary, list[CallTrace]]:
    """Run every plan, write every output; (summary, the calls' traces in plan order).
    `words`: "heard" (the recogniser decides the word checks and counts) or "text" (the
    model's own text stream does, as before the recogniser; nothing is decoded)."""
    if (engine is None) == (url is None):
        raise ValueError("run_suite needs an engine or a url")
    if words not in WORD_SOURCES:
        raise ValueError(f"words must be one of {WORD_SOURCES}")
    out.mkdir(parents=True, exist_ok=True)
    progress = progress or Progress(len(plans), enabled=False)
    recognizer = Recognizer() if words == "heard" else None
    finisher = _Finisher(out, FdbWriter(fdb_dir) if fdb_dir is not None else None, progress, recognizer)
    try:
        if engine is not None:
            from .runner import run_batched

            traces, stats = await run_batched(
                engine, plans, clips, on_frame=progress.frame, on_call=finisher.add
            )
        else:
            assert url is not None
            from .remote import run_remote

            traces, stats = await run_remote(
                url,
                plans,
                clips,
                api_key=api_key,
                concurrency=concurrency,
                on_frame=progress.frame,
                on_call=finisher.add,
            )
        await finisher.flush()
    finally:
        progress.close()
    if finisher.fdb is not None:
        finisher.fdb.close()
    by_scenario: dict[str, list[CallResult]] = {s.name: [] for s in scenarios}
    for result in finisher.results:
        by_scenario[result.trace.plan.scenario.name].append(result)
    hearing = {"words": words}
    if recognizer is not None:
        hearing.update(
            recognizer_s=round(recognizer.seconds, 3), recognized_audio_s=round(recognizer.audio_s, 3)
        )
    summary = RunSummary(
        scenarios=[aggregate(s, by_scenario[s.name]) for s in scenarios if by_scenario[s.name]],
        run={**(run_info or {}), **stats, **hearing},
    )
    write_results(out, summary)
    write_junit(out, summary)
    write_report(out, summary)
    return summary, traces
