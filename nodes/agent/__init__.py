"""Multi-turn agent rollouts with tools: environments and tools (:mod:`.env`), the batched rollout loop
(:mod:`.loop`) and the ``agent_generate`` node function (:mod:`.functions`, registered through the
``rlflow.node_functions`` entry point)."""

from rlflow.nodes.agent.env import ENVIRONMENTS, TOOLS, EnvStep, ToolEnv
from rlflow.nodes.agent.loop import AgentRollout, run_agent

__all__ = ["ENVIRONMENTS", "TOOLS", "AgentRollout", "EnvStep", "ToolEnv", "run_agent"]
