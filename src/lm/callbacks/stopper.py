"""EarlyStopper: stop when another loss point costs more than it is worth, the money runs out, the target loss
is reached or the loss stops improving.

At every validation it records (step, tokens, dollars, loss), fits the loss forecast (the schedule-aware law
of lm.numbers.loss_law), and checks the criteria of `early_stopping`: the marginal dollars per loss point
over a trailing window (or off the forecast), a target loss, classic patience. The budget cap is checked at
every optimizer step (agreed across ranks by `Consensus`: under DDP/FSDP a rank's crossing stops every rank
one step later, with no host sync). Under a flat LR schedule (`wsd`, `constant`) a stop first runs a short
linear LR cooldown, so the stopped model banks the loss a decayed schedule gives; then training stops,
RunCheckpoint writes the final checkpoint, and the reason goes to the log, TensorBoard (`stop/reason`) and
`stop.json`, which `lm report` renders.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lm.base.exits import Refused
from lm.base.scores import DEFAULT_VERSION
from lm.base.tables import fmt_money
from lm.callbacks.consensus import Consensus
from lm.callbacks.cost_meter import CostMeter
from lm.callbacks.milestones import record_failure
from lm.checkpoint.run_state import RunState, ValPoint
from lm.config import EarlyStoppingConfig, OptimConfig
from lm.numbers import core_map
from lm.numbers.loss_law import ScheduleForecast, fit_schedule_law, schedule_forecast, usd_per_loss_point_fit
from lm.numbers.lr_schedule import multipliers
from lm.store import rundir

if TYPE_CHECKING:
    from lm.numbers.reference import Curve, ReferenceForecast

log = logging.getLogger(__name__)


def marginal_usd_per_loss_point(points: list[ValPoint], window: int) -> float | None:
    """Dollars per loss point between the point `window` validations ago and the newest one.

    None until there are window + 1 points (or without prices); inf when the loss did not fall.
    """
    if len(points) <= window or points[-1].usd is None or points[-1 - window].usd is None:
        return None
    old, new = points[-1 - window], points[-1]
    drop = old.smoothed - new.smoothed
    return (new.usd - old.usd) / drop if drop > 0 else math.inf


def usd_per_token(points: list[ValPoint], window: int) -> float | None:
    """The run's all-in $/token over the trailing window (whole run while it is shorter)."""
    if not points or points[-1].usd is None:
        return None
    old = points[max(0, len(points) - 1 - window)]
    new = points[-1]
    if old is new or new.tokens <= old.tokens:
        return new.usd / new.tokens if new.tokens else None
    return (new.usd - (old.usd or 0.0)) / (new.tokens - old.tokens)


class EarlyStopper(Callback):
    """See the module docstring. The plan's end (`plan_end_steps`, or `plan_end_tokens` turned into steps
    once the meter knows the tokens per step) and `chinchilla_tokens` are where the forecast is read."""

    def __init__(
        self,
        cfg: EarlyStoppingConfig,
        meter: CostMeter,
        run_dir: Path,
        *,
        flat_lr: bool,
        plan_end_tokens: int | None = None,
        plan_end_steps: int | None = None,
        chinchilla_tokens: int | None = None,
        optim: OptimConfig | None = None,
        schedule_steps: int | None = None,
        references: list[Curve] | None = None,
        run_state: RunState | None = None,
        consensus: Consensus | None = None,
    ) -> None:
        self.cfg = cfg
        self.consensus = consensus
        """The run's agreement across ranks: rank 0's decision at a validation, on every rank (None: one
        process)."""
        self.meter = meter
        self.run_dir = run_dir
        self.stop_path = run_dir / rundir.STOP
        self.forecast_path = run_dir / rundir.FORECAST
        self.flat_lr = flat_lr
        self.plan_end_steps = plan_end_steps
        self.plan_end_tokens = plan_end_tokens  # turned into steps once the meter knows tokens per step
        self.chinchilla_tokens = chinchilla_tokens
        self.run = meter.run if meter is not None else run_state
        """The run's RunState (the meter's; `run_state` without a meter): the stopper's history and decision
        (`stopper`), the LR cooldown it starts."""
        self.optim, self.schedule_steps = optim, schedule_steps
        """The LR schedule (its config and the steps it spans), for the schedule-aware forecast."""
        self.priors = {}
        if cfg.forecast_prior:
            from lm.numbers.loss_prior import read_priors  # the forecast's priors: loaded when configured

            self.priors = read_priors(cfg.forecast_prior)
        """Shape priors for the forecast (early_stopping.forecast_prior): read once, so a bad file fails at start."""
        self.core_base = core_map.read_map(cfg.core_map) if cfg.core_map else None
        """The CORE forecast's starting map (early_stopping.core_map), read once so a bad file fails at start;
        None: the public prior, loaded when the run first has a CORE milestone."""
        self.references = references or []
        """Reference curves (early_stopping.forecast_reference), read and checked against the run at build."""
        self.last_reference: ReferenceForecast | None = None
        self.last_schedule: ScheduleForecast | None = None
        self.last_choices: dict[str, Any] | None = None
        """The schedule-aware forecast in dollars at the last validation; stop.json keeps the one a stop saw."""
        self.usd_now: float | None = None
        self.usd_before: float | None = None
        """Dollars at the previous optimizer step: the record shows the cap was crossed by this step."""
        self.skipped = 0
        """Validations skipped by `observe` because their loss was not finite (this invocation's)."""

    # --- its state, in RunState ---------------------------------------------------------------------------

    @property
    def points(self) -> list[ValPoint]:
        return self.run.stopper.points

    @property
    def best(self) -> float:
        return self.run.stopper.best

    @property
    def since_best(self) -> int:
        return self.run.stopper.since_best

    @property
    def decision(self) -> dict[str, Any] | None:
        return self.run.stopper.decision

    @decision.setter
    def decision(self, value: dict[str, Any] | None) -> None:
        self.run.stopper.decision = value

    # --- the criteria (pure: no trainer needed, so recorded metrics can be replayed) ---------------------

    def observe(self, step: int, tokens: int, usd: float | None, loss: float) -> tuple[str, str] | None:
        """Add a validation point; returns (criterion, reason) when a criterion says stop. A loss that is not
        finite is skipped, logged and counted (`skipped`): averaged in, one NaN made the smoothed loss NaN for
        good, even at smoothing 0. A smoothed loss or best already NaN (a history from before) starts over."""
        if not math.isfinite(loss):
            self.skipped += 1
            log.warning(
                "early stopping: validation loss %s at step %d is not finite; skipped (%d so far), the criteria "
                "wait for the next finite one",
                loss,
                step,
                self.skipped,
            )
            return None
        a = self.cfg.smoothing
        last = self.points[-1].smoothed if self.points else math.nan
        smoothed = a * last + (1 - a) * loss if math.isfinite(last) else loss
        self.points.append(ValPoint(step, tokens, usd, loss, smoothed))
        s = self.run.stopper
        if math.isnan(s.best):
            s.best, s.since_best = math.inf, 0
        if smoothed < s.best - self.cfg.min_delta:
            s.best, s.since_best = smoothed, 0
        else:
            s.since_best += 1
        self.last_reference = self.fit_reference()
        self.last_schedule = self.fit_schedule()
        self.last_choices = self.schedule_choices()
        return self.check()

    def check(self) -> tuple[str, str] | None:
        """The first criterion (in order: target, patience, $/loss point) that says stop, with its reason."""
        cfg, last = self.cfg, self.points[-1]
        if cfg.target_loss is not None and last.smoothed <= cfg.target_loss:
            return "target_loss", f"validation loss {last.smoothed:.4f} reached target_loss={cfg.target_loss}"
        if cfg.patience is not None and self.since_best >= cfg.patience:
            return "patience", (
                f"no improvement of {cfg.min_delta} over the best loss {self.best:.4f} "
                f"in {self.since_best} validations (patience={cfg.patience})"
            )
        if cfg.max_usd_per_loss_point is not None:
            marginal, how = self.marginal()
            if marginal is not None and marginal > cfg.max_usd_per_loss_point:
                return "max_usd_per_loss_point", (
                    f"the next loss point costs ${marginal:,.2f} ({how}), "
                    f"over max_usd_per_loss_point=${cfg.max_usd_per_loss_point:,.2f}"
                )
        return None

    def marginal(self) -> tuple[float | None, str]:
        """Marginal $/loss point now, and how it was measured."""
        if self.cfg.use_forecast:
            c = self.last_choices
            how = "off the loss forecast: training on before the cooldown, against cooling down now"
            return (c["usd_per_loss_point_now"] if c else None), how
        how = "off the slope" if self.cfg.window_fit else "between the ends"
        return self.window_price(), f"{how} of the last {self.cfg.window} validations"

    def window_price(self) -> float | None:
        """The trailing window's $/loss point: its two ends' difference, or (`window_fit`) the least-squares
        slope through its points, which one noisy validation moves less."""
        w = self.cfg.window
        if not self.cfg.window_fit:
            return marginal_usd_per_loss_point(self.points, w)
        recent = self.points[-1 - w :] if len(self.points) > w else []
        return (
            usd_per_loss_point_fit([p.usd for p in recent], [p.smoothed for p in recent]) if recent else None
        )

    def fit_schedule(self) -> ScheduleForecast | None:
        """The loss forecast (the schedule-aware law of lm.numbers.loss_law) through the validation points so
        far: the final loss if the run cools down now, at the plan's end (after its decay), after twice the
        steps so far and at the Chinchilla token count (None without a schedule or enough points)."""
        if self.optim is None or not self.schedule_steps:
            return None
        last = self.points[-1]
        step = last.step
        plan_steps = max(self.plan_end_steps or self.schedule_steps, step)
        pts = [p for p in self.points if p.tokens >= self.cfg.forecast_skip_tokens]
        steps, losses = [p.step for p in pts], [p.loss for p in pts]
        plan_mult = multipliers(self.optim, self.schedule_steps, plan_steps)
        if self.cfg.forecast_model in ("schedule", "reference") and not self.priors:
            law = fit_schedule_law(steps, losses, plan_mult, min_points=self.cfg.forecast_min_points)
        else:
            model, priors, n = self.cfg.forecast_model, self.priors, self.cfg.forecast_min_points
            from lm.numbers.loss_prior import fit_forecast  # other forecast models: loaded when configured

            law = fit_forecast(steps, losses, plan_mult, model, priors, min_points=n)
        if law is None:
            return None
        cooldown = math.ceil(self.cfg.cooldown_fraction * step)  # what decide() would run
        chinchilla = None
        ramp = self.meter.ramp if self.meter is not None else None
        if self.chinchilla_tokens and ramp is not None and len(ramp.stages) > 1:
            chinchilla = ramp.steps_for_tokens(self.chinchilla_tokens)  # a ramp's first steps train fewer
        elif self.chinchilla_tokens and last.tokens > 0:  # tokens per step from the run itself
            chinchilla = math.ceil(self.chinchilla_tokens * step / last.tokens)
        sf = schedule_forecast(law, self.optim, self.schedule_steps, step, cooldown, plan_steps, chinchilla)
        if self.last_reference is not None:  # the plan's end read off the reference, not the law
            sf = dataclasses.replace(sf, plan_end=self.last_reference.prediction)
        return sf

    def fit_reference(self) -> ReferenceForecast | None:
        """The plan's final loss from the reference curves (lm.numbers.reference), when there are any."""
        if not self.references or self.cfg.forecast_model not in ("reference", "auto"):
            return None
        plan_steps = max(self.plan_end_steps or self.schedule_steps or 0, self.points[-1].step)
        if plan_steps <= 0:
            return None
        steps, losses = [p.step for p in self.points], [p.loss for p in self.points]
        from lm.numbers.reference import forecast  # reference curves: loaded when configured

        return forecast(self.references, steps, losses, plan_steps, self.cfg.forecast_reference_map)

    # --- Lightning hooks ---------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan_end_steps is None and self.plan_end_tokens is not None:
            self.plan_end_steps = self.meter.ramp.steps_for_tokens(self.plan_end_tokens)
        if self.decision is None or not self.decision.get("stopped"):
            return
        # A resumed run that had stopped: stop again if the criterion still holds under today's config,
        # else the user raised the bar and training continues at the scheduled LR.
        again = self.budget_reason() if self.decision["criterion"] == "budget_usd" else None
        again = again or (self.check() if self.points else None)
        if again:
            log.warning(
                "this run stopped early at step %d (%s); set early_stopping=off or raise the threshold to go on",
                self.decision["step"],
                again[1],
            )  # still `stopping`: the step boundary stops the run again
        else:
            log.info("the early stop at step %d no longer applies; training continues", self.decision["step"])
            self.decision = None
            self.run.lr_cooldown = None

    # --- at the step boundary (lm.callbacks.step), after the count --------------------------------------

    def votes(self) -> dict[str, bool]:
        """This rank's votes at an optimizer step: over the budget, and near enough to it that a cooldown
        would end there. Each rank reads its own clock; the step boundary agrees on them across ranks."""
        if self.cfg.budget_usd is None or (self.decision and self.decision.get("stopped")):
            return {}
        self.meter.switch("train")  # bring the meter's clock up to now: the cap is checked every step
        self.usd_before, self.usd_now = self.usd_now, self.meter.usd()
        usd = self.usd_now or 0.0
        near = (
            self.decision is None
            and self.cooldown_applies()
            and usd * (1 + self.cfg.cooldown_fraction) >= self.cfg.budget_usd
        )
        return {"budget_over": usd >= self.cfg.budget_usd, "budget_near": near}

    def at_step(self, trainer: pl.Trainer, agreed: dict[str, bool]) -> None:
        """Act on the agreed budget flags (any rank over the cap stops every rank), and end a cooldown whose
        last step this was (`stopping`: the step boundary stops the run, Lightning validates once more and
        the boundary writes the final checkpoint)."""
        if self.decision and self.decision.get("stopped"):
            return
        step = trainer.global_step
        if self.cfg.budget_usd is not None:
            if agreed.get("budget_over"):
                reason = self.budget_reason() or (
                    "budget_usd",
                    f"another rank reached budget_usd=${self.cfg.budget_usd:,.2f}",
                )
                self.decide(trainer, *reason, cooldown=False)
            elif agreed.get("budget_near") and self.decision is None and self.cooldown_applies():
                usd = self.usd_now or 0.0
                self.decide(
                    trainer,
                    "budget_usd",
                    f"${usd:,.2f} spent; the LR cooldown ends near budget_usd=${self.cfg.budget_usd:,.2f}",
                    cooldown=True,
                )
        if self.decision and not self.decision.get("stopped"):
            start, length = self.decision.get("cooldown") or (step - 1, 0)
            # Lightning steps the LR scheduler before the step boundary, so a cooldown decided at step
            # `start` first shapes the LR of step start + 2, and step start + length + 1 trains at the floor.
            if step >= start + length + 1:
                self.stop(trainer)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        loss = float(trainer.callback_metrics["val/loss"])
        if self.points and self.points[-1].step == trainer.global_step:
            return  # the extra validation Lightning runs when a stop was requested at a validation step
        said = self.observe(trainer.global_step, self.meter.state.tokens, self.meter.usd(), loss)
        if self.consensus is not None:  # rank 0 decides, so every rank stops together
            said = self.consensus.from_rank0(trainer, said)
        elif trainer.world_size > 1:
            raise RuntimeError("EarlyStopper on several ranks needs the run's Consensus")
        self.log_metrics(trainer, pl_module)
        if said and self.decision is None:
            self.decide(trainer, *said, cooldown=self.cooldown_applies())

    # --- deciding and stopping ---------------------------------------------------------------------------

    def budget_reason(self) -> tuple[str, str] | None:
        usd = self.meter.usd()
        if self.cfg.budget_usd is None or usd is None or usd < self.cfg.budget_usd:
            return None
        return "budget_usd", f"${usd:,.2f} spent, at or over budget_usd=${self.cfg.budget_usd:,.2f}"

    def cooldown_applies(self) -> bool:
        return self.flat_lr and self.cfg.cooldown_fraction > 0

    def decide(self, trainer: pl.Trainer, criterion: str, reason: str, cooldown: bool) -> None:
        """Record the decision; stop now, or after an LR cooldown of cooldown_fraction x the steps so far."""
        step = trainer.global_step
        if self.decision is not None and criterion == "budget_usd":
            # The hard cap overrides a cooldown already under way: the budget is not to be exceeded.
            self.decision.update(reason=f"{self.decision['reason']}; then {reason}", criterion=criterion)
            self.stop(trainer)
            return
        self.decision = {
            "criterion": criterion,
            "reason": reason,
            "decided_at_step": step,
            "decided_at_usd": self.meter.usd(),
            "decided_at_tokens": self.meter.state.tokens,
            "usd_per_loss_point": self.marginal()[0] if self.points else None,
            "forecast": self.last_choices,
            "cooldown": None,
            "stopped": False,
        }
        if cooldown:
            length = max(1, math.ceil(self.cfg.cooldown_fraction * step))
            self.decision["cooldown"] = [step, length]
            self.run.lr_cooldown = (step, length)  # the LR schedule reads it from RunState
            log.warning(
                "early stop decided at step %d: %s; cooling the LR down over %d steps", step, reason, length
            )
            self.write(trainer)
        else:
            self.stop(trainer)

    @property
    def stopping(self) -> bool:
        """This stopper's vote: the run stops after this step (the step boundary sets `trainer.should_stop`,
        Lightning validates once more, then the boundary saves the final state)."""
        return bool(self.decision and self.decision.get("stopped"))

    def stop(self, trainer: pl.Trainer) -> None:
        """Decide to stop after this step (`stopping`), with its record in stop.json."""
        d = self.decision
        d.update(
            stopped=True,
            step=trainer.global_step,
            tokens=self.meter.state.tokens,
            usd=self.meter.usd(),
            usd_previous_step=self.usd_before,
        )
        log.warning("stopping early at step %d: %s", trainer.global_step, d["reason"])
        self.write(trainer)
        experiment = getattr(trainer.logger, "experiment", None)
        if trainer.is_global_zero and hasattr(experiment, "add_text"):
            experiment.add_text(
                "stop/reason", f"step {trainer.global_step}: {d['reason']}", trainer.global_step
            )

    def write(self, trainer: pl.Trainer) -> None:
        """stop.json, atomically, on rank 0."""
        if trainer.is_global_zero:
            rundir.write_record(self.stop_path, self.decision)

    def log_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """`stop/*` and `forecast/*` scalars, and forecast.json for the report."""
        metrics = {"stop/smoothed_val_loss": self.points[-1].smoothed}
        marginal = self.window_price()
        if marginal is not None and math.isfinite(marginal):
            metrics["cost/usd_per_loss_point"] = marginal
        sf, c = self.last_schedule, self.last_choices
        if sf is not None and c is not None:
            metrics.update(
                {"forecast/L0": sf.law.L0, "forecast/alpha": sf.law.alpha, "forecast/rms": sf.law.rms}
            )
            values = {
                "loss_if_cooled_now": sf.cooldown_now.loss,
                "loss_at_plan_end": sf.plan_end.loss,
                "loss_at_chinchilla": sf.chinchilla.loss if sf.chinchilla else None,
                # "Another $X buys this much loss", X = what the run has spent so far (twice the steps).
                "loss_drop_if_spend_doubles": sf.cooldown_now.loss - sf.twice_the_steps.loss,
                "usd_per_loss_point_next": c["usd_per_loss_point_next"],
                "usd_per_loss_point_now": c["usd_per_loss_point_now"],
            }
            for name, value in values.items():
                if value is not None and math.isfinite(value):
                    metrics[f"forecast/{name}"] = value
        ref = self.last_reference
        if ref is not None:
            metrics["forecast/reference_final_loss"] = ref.prediction.loss
            log.info(
                "reference forecast: final loss %.3f [%.3f, %.3f] from %s (offset %+.3f at %.0f%% of the plan; "
                "interval from %s)",
                ref.prediction.loss,
                ref.prediction.low,
                ref.prediction.high,
                ref.reference,
                ref.offset,
                100 * ref.fraction,
                ref.interval_from,
            )
        core = None
        if sf is not None and trainer.is_global_zero:
            try:
                core = self.core_forecast()
            except Exception as e:  # optional work on rank 0 alone: recorded, never one rank's crash
                record_failure(trainer, self.run_dir, "the CORE forecast", e)
        if core is not None:
            end = core["plan_end"]
            metrics |= {"forecast/core_at_plan_end": end["core"], "forecast/core_at_plan_end_low": end["low"]}
            metrics["forecast/core_at_plan_end_high"] = end["high"]
            log.info("CORE forecast at the plan's end: %.3f [%.3f, %.3f] (%.0f%%); %s", end["core"], end["low"],
                     end["high"], 100 * end["level"], core["label"])  # fmt: skip
        if (c is not None or ref is not None) and trainer.is_global_zero:
            record = {"schedule": c} | ({"reference": ref.record()} if ref is not None else {})
            record |= {"core": core} if core is not None else {}
            rundir.write_record(self.forecast_path, record)
        for name, value in metrics.items():
            # the CORE forecast is rank 0's (it reads evals.jsonl, which rank 0 writes)
            pl_module.log(
                name,
                float(value),
                on_step=False,
                on_epoch=True,
                rank_zero_only=name.startswith("forecast/core"),
            )

    def core_forecast(self) -> dict[str, Any] | None:
        """The run's final CORE from its loss forecast and the loss-to-CORE map (forecast.json's `core`), once
        evals.jsonl holds a CORE milestone; the map's shift is recalibrated on the milestones that reach CORE
        0.1 (lm.numbers.core_map.run_forecast). None before the first CORE milestone."""
        evals = [r for r in rundir.read_evals(self.run_dir) if r.get("core")]
        if not evals:
            return None
        version = (
            self.core_base.version if self.core_base else evals[-1]["core"].get("version", DEFAULT_VERSION)
        )
        base = self.core_base or core_map.public_prior(version)
        try:
            points, name = core_map.run_points(evals, [(p.step, p.loss) for p in self.points], version)
        except Refused as refusal:  # e.g. milestones scored two ways: no forecast, and the run goes on
            log.warning("no CORE forecast: %s", refusal)
            return None
        sf = self.last_schedule
        endings = {"plan_end": sf.plan_end, "cooldown_now": sf.cooldown_now}
        endings = {k: (v.loss, v.low, v.high) for k, v in endings.items()}
        return core_map.run_forecast(base, points, name, endings)

    def schedule_choices(self) -> dict[str, Any] | None:
        """The forecast as a decision in dollars (forecast.json's `schedule`; stop.json's `forecast` when a
        stop is decided), logged as "cool down now: final loss X, $Y; continue to the plan's end: X', $Y';
        the next loss point costs $Z". Dollars are None while the run has no price."""
        sf, last = self.last_schedule, self.points[-1]
        if sf is None:
            return None
        per_token = usd_per_token(self.points, self.cfg.window)
        per_step = per_token * last.tokens / last.step if per_token is not None and last.step >= 1 else None
        choices = sf.choices(last.usd, per_step)
        now, end, twice = choices["cooldown_now"], choices["plan_end"], choices["twice_the_steps"]
        log.info(
            "cool down now: final loss %.3f [%.3f, %.3f], %s; continue to the plan's end: final loss %.3f "
            "[%.3f, %.3f], %s; twice the steps so far: %.3f, %s; the next loss point costs %s%s",
            now["loss"],
            now["low"],
            now["high"],
            fmt_money(now["usd"]),
            end["loss"],
            end["low"],
            end["high"],
            fmt_money(end["usd"]),
            twice["loss"],
            fmt_money(twice["usd"]),
            fmt_money(choices["usd_per_loss_point_next"]),
            " (the decay's drop from a prior: the LR has not fallen yet)"
            if sf.law.c_source == "prior"
            else "",
        )
        return {"step": sf.step, "law": sf.law.record(), **choices}
