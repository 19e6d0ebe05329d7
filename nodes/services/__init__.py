"""Reward services: rewards computed outside the trainer process.

- :mod:`~rlflow.nodes.services.sandbox`: the sandbox, one isolated and limited process per execution of
  untrusted code (bubblewrap namespaces, rlimits, a pids cgroup), and the probe of its isolation;
- :mod:`~rlflow.nodes.services.seccomp`: the sandbox's seccomp filter (system calls refused);
- :mod:`~rlflow.nodes.services.code_exec`: code extracted from a response, run against a sample's tests in
  the sandbox by a pool, each execution's reason and the sample's score;
- :mod:`~rlflow.nodes.services.http_client`, :mod:`~rlflow.nodes.services.http_protocols`: reward models
  and judges served over HTTP.
"""
