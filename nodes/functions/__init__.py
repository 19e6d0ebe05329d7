"""The builtin node functions graph files name (``function: ppo_actor``), registered in ``NODE_FUNCTIONS``.

This package is rlflow's entry point in the ``rlflow.node_functions`` group: importing it imports its
modules, whose decorators register the functions. One module per job:

- :mod:`~rlflow.nodes.functions.generate`: ``generate`` (the built-in decode loop or the vLLM engine);
- :mod:`~rlflow.nodes.functions.inference`: ``logprobs``, ``sequence_logps``, ``values``, ``rm_score``,
  ``rule_reward``;
- :mod:`~rlflow.nodes.functions.policy`: the clipped policy-gradient actors (``ppo_actor``, ``grpo_actor``,
  ``rloo_actor``, ``remax_actor``, ``reinforce_pp_actor``) and ``ppo_critic``;
- :mod:`~rlflow.nodes.functions.supervised`: ``sft``, ``dpo``, ``reward_model``;
- :mod:`~rlflow.nodes.functions.overlong`: ``overlong_penalty`` (DAPO's over-long reward shaping) and the
  check of the train nodes' over-long filtering;
- :mod:`~rlflow.nodes.functions.distill`: ``distill_actor`` (on-policy distillation from a frozen teacher);
- :mod:`~rlflow.nodes.functions.filters`: ``filter_groups`` (a filter node: dynamic sampling's groups);
- :mod:`~rlflow.nodes.functions.code_reward`: ``code_reward`` (code run against tests in a sandbox);
- :mod:`~rlflow.nodes.functions.services`: ``http_reward``, ``judge_reward`` (reward services over HTTP);
- :mod:`~rlflow.nodes.functions.schemas`: the argument schemas several functions share;
- :mod:`~rlflow.nodes.functions.common`: the helpers they share.

Each is called by the runtime as ``fn(ctx, batch, **args) -> NodeResult`` (see :mod:`rlflow.nodes.context`);
``batch`` holds the canonical inputs listed in the decorator, in the padded batch format of the contract
(prompts ``[B,S]`` left-padded, responses ``[B,R]`` right-padded with ``response_mask``).
The RL maths lives in :mod:`rlflow.nodes.rl`; these modules only wire it to models and the optimisation loop.

Every function declares its arguments (:class:`rlflow.dataflow.args.Arg`: type, range or choices, default,
meaning, source); graph validation checks a node's ``args`` against them before anything runs and the
function receives every declared argument, checked, with the schema's default where the graph file leaves
it out (``rlflow functions NAME`` prints them).

Truncation convention (Pardo et al. 2018, "Time Limits in Reinforcement Learning"): a response that ends
with EOS or a stop token is *terminal* (the value after its last token is 0); one cut at ``max_new_tokens``
without a stop token is *truncated*: the episode did not end, so PPO's GAE and the critic's target
bootstrap from ``V(s_T)``, the critic's value of the state after the last generated token. ``generate``
reports ``truncated`` ``[B]`` (0/1) and ``values`` ``bootstrap_values`` ``[B]``; ``ppo_actor`` and
``ppo_critic`` read both when the graph binds them (unbound: every response is treated as terminal).
"""

from rlflow.nodes.functions import (
    code_reward,
    distill,
    filters,
    generate,
    inference,
    overlong,
    policy,
    services,
    supervised,
)

__all__ = [
    "code_reward",
    "distill",
    "filters",
    "generate",
    "inference",
    "overlong",
    "policy",
    "services",
    "supervised",
]
