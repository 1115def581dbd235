"""Learning on the embedded SmolLM2-135M: GRPO must make the demo's LangGraph agent better at its job.

Slow (several minutes on 2 cores); CI runs it. The agent is ``examples/langgraph_tools`` (the one
``make demo`` trains), run through ``art_plugins.langgraph.trainable`` on the real gateway: a calculator
that must call the right tool with the right numbers, then answer with the result. The base model does
the whole job in a minority of held-out runs; a few GRPO steps must raise that rate by a margin well
beyond its sampling noise. The evaluation is seeded: 20 tasks x 2 runs, the same draws before and after
(10 tasks were too few: their seeded draw gave 50%, while 20 tasks gave 27.5-35% over four seeds).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from examples import langgraph_tools

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~9 min on the shared 2-core machine
async def test_grpo_steps_raise_the_agents_held_out_success(smollm2_dir, tmp_path):
    # Exactly the demo's settings (what `make demo` runs), on the embedded model, seed 0.
    settings = dataclasses.replace(langgraph_tools.DEFAULTS, base_model=str(smollm2_dir), path=tmp_path, seed=0)
    result = await langgraph_tools.run(settings)
    (tmp_path / "result.json").write_text(json.dumps(result.to_json()))  # pytest keeps tmp_path for inspection
    print(result.to_json())
    # The held-out runs are seeded (``agent.group(..., seed=)``), so "before" is the same draw every time.
    assert 0.05 <= result.success_before <= 0.45  # the base model does the job sometimes: GRPO has signal
    # Measured: 30% -> 85% (seed 0, 40 held-out runs); 20 points is the bar, ~2 standard errors.
    assert result.success_after >= result.success_before + 0.20
    assert sum(result.rewards[-3:]) > sum(result.rewards[:3])  # the training reward rose too
    assert (result.model_dir / "checkpoints").is_dir() and result.curve_png and result.curve_png.is_file()
