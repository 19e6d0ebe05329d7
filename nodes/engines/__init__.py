"""Generation engines other than the built-in decode loop (:mod:`rlflow.nodes.generation`).

Every engine is an :class:`~rlflow.nodes.engines.protocol.Engine` (what ``NodeContext.engine`` holds).
``engine: vllm`` on a generate node (:mod:`rlflow.nodes.engines.vllm_engine`) serves it with a vLLM engine;
the engine's worker-side helpers live in :mod:`rlflow.nodes.engines.vllm_worker` (imported inside vLLM's
worker). Importing this package does not import vLLM.
"""
