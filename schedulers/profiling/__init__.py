"""``rlflow profile``: measure this machine for one model shape, as rows that
:mod:`rlflow.schedulers.planner.calibration` (torch-free) fits to the cost model's rates and overheads.

Measured (seconds: the mean over at least ``repeats`` calls and 0.1 s after a warm-up call, a sustained
rate), with the torch thread count of a runtime worker on a host with one worker per planner CPU device
(``measure.worker_threads``, set here and recorded per row), so the fitted rates are a worker's. One
module per job:
  * ``model_calls``: forward, backward and one decode step of one transformer block (``transformers``'
    ``LlamaDecoderLayer`` built from the model's config) over a grid of batch sizes × sequence lengths;
    the same calls on the whole model cut to one layer (``rlflow.nodes.models.build_model``), through the
    code the node functions run (``response_logits`` + ``label_logprobs`` forward, its backward, and
    ``rlflow.nodes.generation.generate`` per generated token: ``model_forward`` / ``model_backward`` /
    ``model_decode``), a forward after 20 ms idle (``model_cold``) and a whole train step (``model_step``);
    the same model in the runtime's 2-way layouts (``runtime.distributed.layouts.apply_layout`` on gloo):
    tensor parallel forward, backward, decode (``tp_*``) and an FSDP2 train micro-batch and optimizer
    step (``fsdp_*``); AdamW steps with gradient clipping over a grid of tensor counts × sizes
    (``optimizer``);
  * ``communication``: gloo all-reduce, all-gather, reduce-scatter and broadcast among ``n`` worker
    processes (``torch.multiprocessing.spawn``) for several sizes; train steps of the one-layer model in
    one worker process alone and in the ``n`` processes at once (``parallel``): how much slower ``n`` busy
    workers run, other tenants of the cores included; the controller → worker round trip of a command
    through the runtime's pickled pipe protocol (``runtime.distributed.protocol.send``/``recv``), empty
    and carrying a batch of several sizes (``dispatch``); hashing weights as the weight sync verifies them
    (``realloc.verify.weights_checksum``, ``digest``);
  * ``runtime_probe``: the runtime itself on two workers (a real ``Controller`` run of a tiny GRPO-shaped
    probe graph, read from its trace): the latency from a node's dependency ending to the node starting
    (``runtime_gap``), the controller's own time per iteration (``runtime_iteration``) and whole nodes as
    a worker runs them (``runtime_generate``, ``runtime_inference``, ``runtime_train``);
  * ``engine``: when vLLM is installed (and not with ``--quick``), the vLLM engine serving the one-layer
    model, once (not per round: one start costs 10-20 s on CPU), in a spawned process
    (``profile_engine``): its start (``engine_start``), one generated token after ``batch`` prompts of
    ``seq`` tokens (``engine_prefill``), the seconds per further decode step of ``batch`` rows
    (``engine_decode``), and loading and verifying a weight version (``engine_load``, ``engine_verify``);
  * ``measure``: the timing loops, the row and its Parquet file, medians over rounds;
  * ``run``: ``run_profile``, all of the above.
Every measurement runs ``rounds`` times, one round after another: a row keeps its median over the rounds,
the runtime probe's samples of every round are kept (the fit takes medians), so a burst of other tenants'
load spoils one round, not the fit (on a shared 2-core VM the same run took 9 ms or 20 ms per node a
minute apart). Rows go to Parquet with columns ``hardware, model, op, batch, seq, group_size, count,
bytes, flops, seconds, threads, cores`` (``count``: parameter tensors of an optimizer row; ``cores``: the
CPU cores this process may run on; the runtime probe's nodes add ``steps, first_pass``), keyed by hardware
and model shape key (``ModelShape.key()``).
"""
