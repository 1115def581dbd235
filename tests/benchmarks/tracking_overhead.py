"""What ``report_to`` with all four trackers adds to a demo-sized training step, measured inside the same steps.

A model on the embedded SmolLM2-135M reports to W&B (offline files), MLflow (a real ``mlflow server`` on
127.0.0.1 with a sqlite store), TensorBoard and Trackio at once. Each step samples ``--prompts`` x ``--n``
replies of up to ``--max-tokens`` tokens and trains one GRPO step on them, as a demo step does. Timed by
wrapping (benchmark instrumentation only):

- ``added_s``: what reporting adds to the loop: the time ``model.train`` spends in ``_report`` (waiting for the
  previous step's report, if still in flight, and handing this one to the tracking thread).
  Goal: at most 2% of the step (rollouts + train) in steady state, and of the first step.
- ``report_s``: the report itself (``TrackingSession.report``), sent on the tracking thread while the next
  rollouts run; ``start_s``: the first one, which also opens the four runs. Per tracker: each ``log_step``.

    /work/tools/heavy python tests/benchmarks/tracking_overhead.py [--steps 4] [--prompts 4] [--n 8] [--base-model M]

The last line is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from art_core import LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup
from art_core.tracking import MLflowTracker, TensorBoardTracker, TrackingSession, TrackioTracker, WandbTracker

PROMPTS = ["Name a color.", "Name a fruit.", "Name an animal.", "Name a country.", "Name a tool.", "Name a planet."]


def start_mlflow(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--artifacts-destination", str(folder / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("mlflow server did not start")


async def run(args: argparse.Namespace, folder: Path, mlflow_url: str) -> dict[str, float]:
    reports: list[float] = []
    added: list[float] = []
    original = TrackingSession.report
    original_report = TrainableModel._report

    async def timed_report(self: TrainableModel, *args: object) -> None:
        t0 = time.perf_counter()
        try:
            await original_report(self, *args)  # type: ignore[arg-type]
        finally:
            added.append(time.perf_counter() - t0)

    TrainableModel._report = timed_report  # type: ignore[method-assign]

    def timed(self: TrackingSession, **kwargs: object) -> None:
        t0 = time.perf_counter()
        try:
            original(self, **kwargs)  # type: ignore[arg-type]
        finally:
            reports.append(time.perf_counter() - t0)

    TrackingSession.report = timed  # type: ignore[method-assign]  # benchmark instrumentation only
    trackers = [WandbTracker(mode="offline"), MLflowTracker(tracking_uri=mlflow_url), TensorBoardTracker(),
                TrackioTracker()]
    per_tracker: dict[str, list[float]] = {t.name: [] for t in trackers}
    for tracker in trackers:  # each tracker's log_step timed too (benchmark instrumentation only)
        def log_step(report: object, _inner=tracker.log_step, _name=tracker.name) -> None:
            t0 = time.perf_counter()
            try:
                _inner(report)
            finally:
                per_tracker[_name].append(time.perf_counter() - t0)
        tracker.log_step = log_step  # type: ignore[method-assign]
    model = TrainableModel(name="bench", project="tracking-bench", base_model=args.base_model, report_to=trackers)
    steps: list[float] = []
    async with LocalBackend(path=folder / "art", show_progress=False, serve=False) as backend:
        await model.register(backend)
        for step in range(args.steps):
            t0 = time.perf_counter()
            groups = []
            for k in range(args.prompts):
                replies = await model.sample([{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}], n=args.n,
                                             max_tokens=args.max_tokens, seed=1000 * step + k)
                for t in replies:
                    t.reward = len(t.messages[-1].text()) / 100  # differs between replies: every step trains
                groups.append(TrajectoryGroup(replies))
            await model.train(groups, config=TrainConfig(learning_rate=1e-4))
            steps.append(time.perf_counter() - t0)
            print(f"step {step + 1}: {steps[-1]:.2f} s, of which reporting added {added[-1] * 1000:.1f} ms",
                  flush=True)
        await model.finish_tracking()
    assert model.tracking is not None and model.tracking.failures == 0, "a tracker failed: the figures are not valid"
    shares = [a / (s - a) for a, s in zip(added, steps, strict=True)]
    return {"steps": float(args.steps), "first_step_s": steps[0], "first_added_s": added[0],
            "first_added_share": shares[0], "step_without_reporting_s_median": statistics.median(
                s - a for a, s in zip(added[1:], steps[1:], strict=True)),
            "added_s_median": statistics.median(added[1:]), "added_share_median": statistics.median(shares[1:]),
            "added_share_max": max(shares[1:]), "start_s": reports[0], "report_s_median": statistics.median(reports[1:]),
            **{f"log_step_s_median_{name}": statistics.median(times[1:]) for name, times in per_tracker.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="smollm2-135m-instruct",
                        help="the demo's model (default: %(default)s); a tiny local folder shows the fixed cost alone")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first report also opens the runs)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ.update(WANDB_SILENT="true", TRACKIO_DIR=str(folder / "trackio"))
        process, url = start_mlflow(folder)
        try:
            figures = asyncio.run(run(args, folder, url))
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    print(f"\n{'':<42}{'seconds':>10}")
    print(f"{'step without reporting (median)':<42}{figures['step_without_reporting_s_median']:>10.3f}")
    print(f"{'reporting adds to a step (median)':<42}{figures['added_s_median']:>10.4f}   ratio "
          f"{figures['added_share_median']:.3%} (max {figures['added_share_max']:.3%}; goal <= 2%)")
    print(f"{'reporting adds to the first step':<42}{figures['first_added_s']:>10.4f}   ratio "
          f"{figures['first_added_share']:.3%} of {figures['first_step_s']:.1f} s")
    print(f"{'report, sent in the background (median)':<42}{figures['report_s_median']:>10.3f}")
    print(f"{'first report (opens the four runs)':<42}{figures['start_s']:>10.3f}")
    for key in sorted(k for k in figures if k.startswith("log_step_s_median_")):
        print(f"{'  of which ' + key.removeprefix('log_step_s_median_'):<42}{figures[key]:>10.3f}")
    print(json.dumps({k: round(v, 5) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
