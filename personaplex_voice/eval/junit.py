"""`junit.xml`: one test case per expectation of each scenario, so any CI can gate a persona change.

A scenario is a `<testsuite>` (named after it, with its file); each expectation a `<testcase>`
(`classname` = the scenario, `name` = the expectation, e.g. `responds_within_ms 800`), failed
when it held in fewer repeats than the scenario's `pass_rate`; the failure lists each failing
repeat's message. A call that could not run at all is an `<error>` on every expectation of its
scenario. `time` is the audio seconds of the scenario's calls.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from .results import RunSummary, ScenarioResult


def _suite(sr: ScenarioResult) -> ET.Element:
    seconds = sum(c.trace.duration_s for c in sr.calls)
    errors = [c for c in sr.calls if c.trace.error is not None]
    suite = ET.Element(
        "testsuite",
        name=sr.scenario.name,
        file=str(sr.scenario.file),
        tests=str(len(sr.expectations)),
        failures=str(0 if errors else sum(not e.passed for e in sr.expectations)),
        errors=str(len(sr.expectations) if errors else 0),
        skipped="0",
        time=f"{seconds:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("persona", sr.scenario.persona_name),
        ("line", sr.calls[0].trace.plan.line.name if sr.calls else sr.scenario.line),
        ("repeats", str(len(sr.calls))),
        ("pass_rate", f"{sr.pass_rate:.4f}"),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    for exp in sr.expectations:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"eval.{sr.scenario.name}",
            name=exp.label,
            file=exp.where.rsplit(":", 1)[0],
            line=exp.where.rsplit(":", 1)[1],
            time=f"{seconds / max(1, len(sr.expectations)):.3f}",
        )
        if errors:
            text = "\n".join(f"repeat {c.trace.plan.repeat + 1}: {c.trace.error}" for c in errors)
            ET.SubElement(
                case, "error", message=f"{len(errors)} call(s) failed to run", type="CallError"
            ).text = text
        elif not exp.passed:
            message = f"held in {exp.passes} of {exp.runs} repeats (needs {exp.required_rate:.0%})"
            failure = ET.SubElement(case, "failure", message=message, type="ExpectationFailed")
            failure.text = "\n".join(f"repeat {r + 1}: {msg}" for r, msg in exp.failures)
        ET.SubElement(case, "system-out").text = "\n".join(
            f"repeat {i + 1}: {msg}" for i, msg in enumerate(exp.messages)
        )
    return suite


def write_junit(out: Path, summary: RunSummary) -> Path:
    suites = [_suite(sr) for sr in summary.scenarios]
    root = ET.Element(
        "testsuites",
        name="personaplex-voice eval",
        tests=str(sum(int(s.get("tests", "0")) for s in suites)),
        failures=str(sum(int(s.get("failures", "0")) for s in suites)),
        errors=str(sum(int(s.get("errors", "0")) for s in suites)),
        time=f"{summary.run.get('wall_s', 0.0):.3f}",
    )
    root.extend(suites)
    ET.indent(root)
    path = out / "junit.xml"
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path
