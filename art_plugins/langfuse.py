"""Langfuse for training runs: every rollout a trace, every reward a score, every step a link.

    agent = trainable(graph, model, langfuse=True)          # or TrainableRunner(model, langfuse=True)
    group = await agent.group(task, n=8, reward=my_reward)  # 8 traces, rewards as scores
    await model.train([group])                              # a "training-step" trace; best/worst links printed
    run = await evaluate(agent, "my-dataset", run_name="before")   # a Langfuse dataset run

``langfuse=True`` builds a ``Langfuse`` client from ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY`` and
``LANGFUSE_BASE_URL``; pass a ``Langfuse`` client, or a ``LangfuseTracing`` for more options. Off (the
default), the adapters import nothing from here and send nothing.

What goes where (names as they appear in Langfuse):

- **Rollout traces** (trace name ``rollout``): the trace id is ``Langfuse.create_trace_id(seed=trajectory.id)``
  and is kept in ``trajectory.metadata["langfuse_trace_id"]``. Session id: the training run
  (``"<project>/<model name>"`` unless ``session_id=``). Trace metadata: ``model``, ``step``, ``group``,
  ``task``, ``framework``, ``rollout_id``, ``trajectory_id``. Under the root observation ``rollout`` sits the
  framework's own structure: LangGraph's graph, nodes, LLM calls and tools through Langfuse's LangChain
  ``CallbackHandler``; the Agents SDK's workflow, agents, LLM calls, tools, handoffs and guardrails through
  the OpenInference instrumentation Langfuse documents for it.
- **Trainable calls**: each LLM observation that called the trainable model carries, as metadata,
  ``rollout_id``, ``adapter_step`` (the checkpoint that served it), ``request_id`` (the gateway record),
  ``prompt_tokens`` and ``completion_tokens``, and the same counts as its usage. They come from the
  gateway's response headers, read in the task that made the call while the framework's observation is the
  current OpenTelemetry span; a live-streamed call's headers leave before any token is sampled, so its
  completion count is read from the gateway's record of the call when its body has been read (still inside
  the observation). In LangGraph's node observations, the graph state's LangChain messages are shown
  compactly, as Langfuse shows a generation's (role, content, tool calls); routing functions get no
  observation of their own (the route they chose is their node's metadata ``langgraph_route``) and LangGraph's
  bookkeeping metadata is left out (see ``art_plugins._langfuse_langchain``).
- **Scores** on each rollout trace: ``reward``; each custom reward component of ``score_group`` by its name;
  ``ruler`` with the judge's explanation as the comment. Sent when the rollout is scored and again when
  the step trains (same score ids: the final values replace the first ones, e.g. after RULER).
- **Step traces** (trace name ``training-step``): the step's metrics as output, its trajectories' trace ids
  (also written to ``history.jsonl`` as ``langfuse_trace_ids``); the best and worst trajectory's URLs are
  printed when the step ends.
- **Dataset runs** (``evaluate``): each dataset item runs once through the agent inside Langfuse's
  experiment runner (``DatasetClient.run_experiment``), so the item is linked to its trace and the reward
  scores are attached; runs before and after training sit side by side under the dataset.

Faults: a Langfuse that is down, failing or hanging never fails a rollout, a step or an evaluation. Spans
and scores leave in the SDK's background threads; each step waits at most ``flush_timeout`` seconds for
them; export errors the SDK logs are counted and reported once per step (a warning with the count).

Global effects, each installed once, when Langfuse is first turned on: for the Agents SDK, the OpenInference
instrumentation (``OpenAIAgentsInstrumentor().instrument()``) registers a trace processor with the SDK, which
exports every traced Agents SDK run of the process to Langfuse, as Langfuse's own setup does; with Langfuse
on, art-plugins' runs are traced (``RunConfig.tracing_disabled`` is False), so the SDK's own exporter sees
them too (it sends to OpenAI only with an OpenAI key set; ``agents.set_tracing_disabled`` or
``set_trace_processors`` control it). A logging handler counts the errors of the ``langfuse`` and
OpenTelemetry exporter loggers while a ``LangfuseTracing`` is open (``aclose()`` removes it). The client made
for ``langfuse=True`` gets its own OpenTelemetry ``TracerProvider``: the global one is left alone.

Where it lives: ``LangfuseTracing`` is a tracer of ``art_plugins._tracing`` (the interface rollout scopes tell
what happens), written in ``_langfuse_traces`` (rollout and step traces, scores) over ``_langfuse_delivery``
(bounded waits, counted failures); ``_langfuse_options`` resolves the adapters' ``langfuse=`` option;
``_langfuse_datasets`` holds ``evaluate``; ``_langfuse_langchain`` the LangGraph handler; ``_langfuse_sdk`` every
use of the SDK's non-public parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from ._langfuse_datasets import DatasetRun, current_dataset_item, evaluate
from ._langfuse_traces import LangfuseTracing

if TYPE_CHECKING:
    from langfuse import Langfuse

__all__ = ["DatasetRun", "LangfuseOption", "LangfuseTracing", "current_dataset_item", "evaluate"]

LangfuseOption: TypeAlias = "bool | Langfuse | LangfuseTracing | None"
"""What ``trainable(..., langfuse=)`` and ``TrainableRunner(..., langfuse=)`` take."""
