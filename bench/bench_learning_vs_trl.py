"""Learning parity with TRL: held-out accuracy of rlflow PPO/GRPO vs TRL's trainers, from one SFT checkpoint.

The task is the arithmetic chain's (``examples/arith``): the SFT checkpoint (``--sft CHECKPOINT_DIR``, its
``models/actor`` a Hugging Face model directory with its tokenizer; without it the bench runs
``rlflow run <--sft-graph>`` first) is the starting policy of every run. Per algorithm and seed:

- ``rlflow``: the example graph (``--ppo-graph``, ``--grpo-graph``) through the runtime
  (``trl_compare.run_rlflow_graph``: ``load_graph`` -> ``resolve_plan`` -> ``Controller(graph).run()``), with
  the overrides ``models.actor.path=<sft>/models/actor``, ``run.seed``, ``run.iterations``,
  ``run.eval_interval`` and ``--set`` (applied to both graphs and to the evaluator);
- ``trl``: ``trl.experimental.ppo.PPOTrainer`` of TRL 1.12 (``--trl-ppo-python``) or ``trl.GRPOTrainer``
  of the current TRL (``--trl-grpo-python``), each in its own venv (``bench/setup_trl.sh``), from the same
  checkpoint, on the same training prompts (the graph's data generator, written to a JSONL), the same rule
  reward (the very function ``rlflow.nodes.rewards.resolve_reward`` returns, imported in the TRL venv:
  it sees the system site-packages) and the hyper-parameters the graph sets wherever TRL exposes them
  (:func:`setting`); it saves the policy every ``--eval-interval`` iterations (``learning_trl.py``).

Held-out accuracy is one function on both sides: ``Controller.evaluate`` (greedy decoding, the graph's
``max_new_tokens``, the eval split of the graph's generator). rlflow's runs call it every
``--eval-interval`` iterations; TRL's saved policies are evaluated afterwards by a Controller built from
the same graph with ``models.actor.path`` set to the saved policy. Samples = prompt-response pairs
trained on (both sides: the graph's samples per iteration x iterations).

TRL differs by design (the same in every run; :data:`DESIGN`):
PPO: one AdamW over policy and value model with one learning rate and loss ``pg + vf_coef·vf``
(vf_coef 0.1), rlflow two optimizers with their own rates (critic 1e-3 in the example); no gradient
clipping; the score is added one token after EOS (rlflow: on the last response token, EOS included), so
GAE (γ 1, λ 0.95) reaches the EOS token through one extra λ; the value head is
``LlamaForSequenceClassification.score`` (no bias, N(0, 0.02)), rlflow's a biased ``Linear`` N(0, 1/(H+1));
old log-probs are the sampler's (rlflow recomputes them); new mini-batches every epoch (rlflow: the same
split, rows in order); the learning-rate warm-up counts iterations (rlflow: optimizer steps) and starts from
0. GRPO: the std gets +1e-4 (rlflow 1e-6); the generation batch is shuffled before it is split into
optimizer steps (rlflow: in order, whole groups); the warm-up starts from 0 (rlflow from 1/(warmup+1)).
Both: KL form as the graph says (PPO: k1 per token in the reward; GRPO: k3 loss term), advantages
whitened over the batch (PPO).

Prints, per algorithm and side, the final held-out accuracy (mean, min-max, std over seeds), the mean of
each seed's last three evaluations, and whether rlflow lies within TRL's seed range or above; draws the
curves (``<--out>/learning_vs_trl.png``); writes everything to ``<--out>/results.json`` (``--merge`` reports
several such files as one, e.g. seeds run apart).

Run: ``bench/setup_trl.sh`` (TRL 1.16 at /work/venv-trl) and ``bench/setup_trl.sh /work/venv-trl112
1.12.0`` (PPO), then ``python bench/bench_learning_vs_trl.py --sft runs/arith-sft/checkpoints/latest``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import trl_compare as tc

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "arith"
ALGORITHMS = ("ppo", "grpo")
SIDES = ("rlflow", "trl")
TRL_PYTHON = {"ppo": "/work/venv-trl112/bin/python", "grpo": "/work/venv-trl/bin/python"}
DESIGN = {
    "ppo": "TRL 1.12 PPOTrainer: one AdamW over policy+value (one lr, loss pg + 0.1·vf), no grad clipping, "
    "score one token after EOS, sampler log-probs as π_old, value head score N(0,0.02) no bias, "
    "new mini-batches each epoch, warm-up in iterations from lr 0",
    "grpo": "TRL GRPOTrainer: std + 1e-4 (rlflow 1e-6), generation batch shuffled before its steps, "
    "warm-up from lr 0 (rlflow from lr/(warmup+1))",
}


# ------------------------------------------------------------------------------------------------
# the setting both sides share, read from the rlflow graph


def _one(graph: Any, what: str, pick: Any) -> Any:
    found = [n for n in graph.nodes.values() if pick(n)]
    if len(found) != 1:
        raise SystemExit(f"[bench] {graph.spec.run.output_dir}: expected one {what} node, found {len(found)}")
    return found[0]


def setting(graph: Any, algorithm: str, sft_actor: str, iterations: int, eval_interval: int) -> dict:
    """What the TRL side needs to mirror the rlflow graph (after overrides): samples, sampling, reward,
    mini-batches/epochs, AdamW, clipping, KL. Stops with one line on a setting TRL cannot mirror."""
    gen = _one(graph, "generate", lambda n: n.kind == "generate")
    train = _one(graph, f"{algorithm}_actor", lambda n: n.function == f"{algorithm}_actor")
    rule = _one(graph, "rule_reward", lambda n: n.function == "rule_reward")
    ga, ta = graph.args(gen.name), graph.args(train.name)
    opt = graph.spec.models[train.model].optimizer
    bad = [f"{k}={v}" for k, v in (("schedule", opt.schedule),) if v != "constant"]
    bad += [f"{k}={ta.get(k)}" for k in ("top_k", "top_p", "dual_clip", "clip_eps_high") if ta.get(k)]
    bad += [f"entropy_coef={ta['entropy_coef']}"] if ta["entropy_coef"] else []
    s: dict[str, Any] = {
        "algorithm": algorithm,
        "sft_actor": sft_actor,
        "iterations": iterations,
        "eval_interval": eval_interval,
        "prompts": graph.prompts(gen.name),
        "group": graph.group_size(gen.name),
        "max_new_tokens": int(ga["max_new_tokens"]),
        "temperature": float(ga["temperature"]),
        "reward": graph.args(rule.name)["fn"],
        "mini_batches": train.mini_batches,
        "epochs": train.epochs,
        "lr": opt.lr,
        "betas": list(opt.betas),
        "adam_eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
        "warmup_steps": opt.warmup_steps,
        "clip_eps": 0.2 if ta["clip_eps"] is None else float(ta["clip_eps"]),
    }
    if algorithm == "ppo":
        critic = _one(graph, "ppo_critic", lambda n: n.function == "ppo_critic")
        ca = graph.args(critic.name)
        bad += [] if ta["whiten_advantages"] else ["whiten_advantages=false (TRL always whitens)"]
        bad += [] if ta["kl_estimator"] in ("k1", "k3") else [f"kl_estimator={ta['kl_estimator']}"]
        s.update(
            kl_coef=ta["kl_coef"], kl_estimator=ta["kl_estimator"], gamma=ta["gamma"], lam=ta["lam"],
            value_clip=ca["value_clip"], critic_lr=graph.spec.models[critic.model].optimizer.lr,
        )  # fmt: skip
    else:
        agg = ta["agg"] or "token-mean"
        aggs = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
        bad += [] if ta["kl_loss_type"] == "k3" else [f"kl_loss_type={ta['kl_loss_type']} (TRL: k3)"]
        bad += [] if ta["loss"] == "ppo" else [f"loss={ta['loss']}"]
        bad += [] if agg in aggs else [f"agg={agg}"]
        s.update(kl_coef=ta["kl_loss_coef"], std=ta["std"], loss_type=aggs.get(agg, agg))
    if bad:
        raise SystemExit(f"[bench] {algorithm}: TRL cannot mirror {', '.join(bad)}")
    return s


# ------------------------------------------------------------------------------------------------
# rlflow side and the evaluator (project Python)


def rl_overrides(
    args: argparse.Namespace, sft_actor: str, run_dir: Path, seed: int, iterations: int
) -> list[str]:
    """The overrides of an rlflow RL run (and of the evaluator's graph): start, seed, length, evaluation,
    no checkpoints, then ``--set``."""
    return [
        f"models.actor.path={sft_actor}", f"run.output_dir={run_dir}", f"run.seed={seed}",
        f"run.iterations={iterations}", f"run.eval_interval={args.eval_interval}",
        "run.checkpoint_interval=0", *args.set,
    ]  # fmt: skip


def run_rlflow(graph_path: Path, overrides: list[str], run_dir: Path, iterations: int) -> dict:
    """One rlflow run through the runtime; held-out accuracy by iteration, the train reward, the KL and
    the seconds of ``Controller.run`` (its evaluations included)."""
    from rlflow.schedulers.records.rundir import read_metrics

    run = tc.run_rlflow_graph(graph_path, overrides, run_dir, 1, iterations - 1)
    rows = read_metrics(run_dir).to_pylist()
    acc = {r["iteration"]: r["val/accuracy"] for r in rows if r.get("val/accuracy") is not None}
    return {
        "wall_s": run.run_s,
        "accuracy": acc,
        "train_reward": [r["critic/score/mean"] for r in rows if r.get("critic/score/mean") is not None],
        "kl": [r.get("actor/reward_kl") for r in rows if r["iteration"] > 0],
    }


def evaluate_policies(graph_path: Path, overrides: list[str], policies: list[Path]) -> list[float]:
    """``val/accuracy`` of each saved policy: ``Controller.evaluate`` of the graph with ``models.actor.path``
    set to it (the evaluation rlflow's own runs make)."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.controller import Controller

    out = []
    for policy in policies:
        with tempfile.TemporaryDirectory(prefix="rlflow-eval-") as tmp:
            over = [*overrides, f"models.actor.path={policy}", f"run.output_dir={tmp}"]
            controller = Controller(resolve_plan(load_graph(graph_path, over), None))
            out.append(controller.evaluate()["val/accuracy"])
    return out


# ------------------------------------------------------------------------------------------------
# driver


def worker(args: argparse.Namespace) -> None:
    """In a subprocess: one job of ``job.json`` in ``--workdir``; prints its result behind RESULT_TAG."""
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    job = json.loads((work / "job.json").read_text())
    if args.worker == "trl":
        import learning_trl

        ppo = job["setting"]["algorithm"] == "ppo"
        run = learning_trl.run_trl_ppo if ppo else learning_trl.run_trl_grpo
        result = run(job["setting"], work, job["seed"])
    elif args.worker == "rlflow":
        result = run_rlflow(Path(job["graph"]), job["overrides"], work / "run", job["iterations"])
    else:
        result = {"accuracy": evaluate_policies(Path(job["graph"]), job["overrides"], job["policies"])}
    print(tc.RESULT_TAG + json.dumps(result), flush=True)


def spawn(args: argparse.Namespace, kind: str, work: Path, job: dict, python: str, label: str) -> dict:
    """Run one job (``kind``: rlflow, trl or eval) in its own subprocess under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    cmd = [python, str(Path(__file__).resolve()), "--worker", kind, "--workdir", str(work),
           "--threads", str(args.threads)]  # fmt: skip
    env = tc.worker_env(args.threads, ROOT / "bench", TRL_EXPERIMENTAL_SILENCE="1")
    print(f"[bench] {label} ...", flush=True)
    return tc.run_side(label, cmd, env, ROOT)


def sft_checkpoint(args: argparse.Namespace, out: Path) -> Path:
    """``--sft``, or the checkpoint of ``rlflow run <--sft-graph>`` (run now, into ``out/sft``)."""
    if args.sft is not None:
        return args.sft.absolute()
    run_dir = out / "sft"
    cmd = ["rlflow", "run", str(args.sft_graph), f"run.output_dir={run_dir}", "--overwrite", "--no-progress",
           "--no-dashboard", *args.set]  # fmt: skip
    print(f"[bench] SFT: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=tc.worker_env(args.threads, ROOT / "bench"))
    return run_dir / "checkpoints" / "latest"


def run_algorithm(args: argparse.Namespace, algorithm: str, sft: Path, out: Path) -> dict:
    """Every seed of both sides for ``algorithm``; TRL's saved policies evaluated at the same iterations
    as rlflow's. Per side and seed: accuracy by iteration, train reward, KL, wall seconds."""
    from rlflow.dataflow.data import load_splits
    from rlflow.dataflow.loader import load_graph

    graph_path = getattr(args, f"{algorithm}_graph").resolve()
    actor = str(sft / "models" / "actor")
    iterations = (
        args.iterations
        or load_graph(graph_path, [f"models.actor.path={actor}", *args.set]).spec.run.iterations
    )
    if iterations % args.eval_interval:
        raise SystemExit(f"[bench] {algorithm}: {iterations} iterations, not a multiple of --eval-interval")
    base = rl_overrides(args, actor, out / "scratch", 0, iterations)
    graph = load_graph(graph_path, base)
    s = setting(graph, algorithm, actor, iterations, args.eval_interval)
    root = out / algorithm
    root.mkdir(parents=True, exist_ok=True)
    train, held_out = load_splits(graph.spec.data)
    (root / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": str(a)}) + "\n"
                for p, a in zip(train.columns["prompt"], train.columns["answer"], strict=True))
    )  # fmt: skip
    python = getattr(args, f"trl_{algorithm}_python")
    if "trl" in args.sides:
        tc.check_trl(python, "trl.experimental.ppo" if algorithm == "ppo" else "trl")

    def one(side: str, seed: int) -> tuple[str, int, dict]:
        work = root / f"{side}-seed{seed}"
        label = f"{algorithm} {side} seed {seed}"
        if side == "rlflow":
            over = rl_overrides(args, actor, work / "run", seed, iterations)
            job = {"graph": str(graph_path), "overrides": over, "iterations": iterations}
            return side, seed, spawn(args, "rlflow", work, job, sys.executable, label)
        work.mkdir(parents=True, exist_ok=True)
        (work / "train.jsonl").write_text((root / "train.jsonl").read_text())
        result = spawn(args, "trl", work, {"setting": s, "seed": seed}, python, label)
        policies = sorted((work / "ckpt").iterdir())
        job = {"graph": str(graph_path), "overrides": base, "policies": [str(p) for p in policies]}
        acc = spawn(args, "eval", work / "eval", job, sys.executable, f"{label} evaluation")["accuracy"]
        result["accuracy"] = {int(p.name): a for p, a in zip(policies, acc, strict=True)}
        return side, seed, result

    jobs = [(side, seed) for seed in args.seeds for side in args.sides]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda j: one(*j), jobs))
    runs: dict[str, dict[int, dict]] = {}
    for side, seed, result in done:
        result["accuracy"] = {int(k): v for k, v in result["accuracy"].items()}
        runs.setdefault(side, {})[seed] = result
    start = None
    if "rlflow" in runs:  # iteration 0 (the SFT policy) is the same model on both sides
        start = next(iter(runs["rlflow"].values()))["accuracy"].get(0)
        for r in runs.get("trl", {}).values():
            r["accuracy"].setdefault(0, start)
    per_iteration = s["prompts"] * s["group"]
    return {
        "setting": s,
        "samples_per_iteration": per_iteration,
        "eval_size": len(held_out or ()),
        "runs": runs,
    }


def merge(paths: list[Path]) -> dict:
    """The runs of several ``results.json`` files as one result (seeds of one setting run apart)."""
    results: dict[str, dict] = {}
    for path in paths:
        for algorithm, res in json.loads(path.read_text())["results"].items():
            into = results.setdefault(algorithm, {**res, "runs": {}})
            if into["setting"] != res["setting"]:
                raise SystemExit(f"[bench] {path}: {algorithm} ran another setting than {paths[0]}")
            for side, runs in res["runs"].items():
                for seed, r in runs.items():
                    r["accuracy"] = {int(k): v for k, v in r["accuracy"].items()}
                    into["runs"].setdefault(side, {})[int(seed)] = r
    return results


def summary(results: dict) -> list[dict]:
    """One row per algorithm and side: the final accuracy's mean, min, max and std over seeds; ``tail``: the
    mean over seeds of each seed's last three evaluations (less evaluation noise), with its seed range;
    ``eval_se``: the binomial standard error of one evaluation at the final mean; samples; seconds."""
    import statistics

    rows = []
    for algorithm, res in results.items():
        for side, runs in res["runs"].items():
            finals = [r["accuracy"][max(r["accuracy"])] for r in runs.values()]
            tails = [
                statistics.fmean(r["accuracy"][k] for k in sorted(r["accuracy"])[-3:]) for r in runs.values()
            ]
            last = max(max(r["accuracy"]) for r in runs.values())
            mean = statistics.fmean(finals)
            rows.append({
                "algorithm": algorithm, "side": side, "seeds": sorted(runs),
                "samples": last * res["samples_per_iteration"],
                "start": min(r["accuracy"].get(0, float("nan")) for r in runs.values()),
                "mean": mean, "min": min(finals), "max": max(finals),
                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                "tail": statistics.fmean(tails), "tail_min": min(tails), "tail_max": max(tails),
                "eval_se": (mean * (1 - mean) / res["eval_size"]) ** 0.5 if res.get("eval_size") else 0.0,
                "wall_s": statistics.fmean(r["wall_s"] for r in runs.values()),
                "version": next(iter(runs.values())).get("trl_version", "rlflow"),
            })  # fmt: skip
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Per algorithm: rlflow's mean against TRL's seed range (the issue's "done when"), for the final
    evaluation and for the mean of the last three."""
    out = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        by = {r["side"]: r for r in rows if r["algorithm"] == algorithm}
        if "rlflow" not in by or "trl" not in by:
            continue
        rl, trl = by["rlflow"], by["trl"]
        for what, mean, low, high in (
            ("final", "mean", "min", "max"),
            ("last-3", "tail", "tail_min", "tail_max"),
        ):
            ok = rl[mean] >= trl[low]
            out.append(
                f"{algorithm} {what}: rlflow {rl[mean]:.3f} vs TRL {trl[mean]:.3f} (seeds {trl[low]:.3f}-"
                f"{trl[high]:.3f}; one evaluation's s.e. {trl['eval_se']:.3f}): "
                + ("within TRL's seed range or above" if ok else "BELOW TRL's seed range")
            )
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'algorithm':<9} {'side':<7} {'version':<8} {'samples':>7} {'start':>6} {'final mean':>10} "
          f"{'min-max':>11} {'std':>6} {'last-3 mean':>11} {'min-max':>11} {'train s/run':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['algorithm']:<9} {r['side']:<7} {r['version']:<8} {r['samples']:>7} {r['start']:>6.3f} "
            f"{r['mean']:>10.3f} {r['min']:>5.3f}-{r['max']:.3f} {r['std']:>6.3f} {r['tail']:>11.3f} "
            f"{r['tail_min']:>5.3f}-{r['tail_max']:.3f} {r['wall_s']:>11.0f}"
        )
    for line in verdicts(rows):
        print(line)


def plot(results: dict, path: Path) -> None:
    """Held-out accuracy against samples, one panel per algorithm: each side's mean over seeds, its
    min-max band, and every seed faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (algorithm, res) in zip(axes[0], results.items(), strict=True):
        for side, colour in zip(SIDES, ("tab:blue", "tab:orange"), strict=True):
            runs = res["runs"].get(side)
            if not runs:
                continue
            its = sorted(set.intersection(*(set(r["accuracy"]) for r in runs.values())))
            x = [i * res["samples_per_iteration"] for i in its]
            curves = [[r["accuracy"][i] for i in its] for r in runs.values()]
            for c in curves:
                ax.plot(x, c, color=colour, alpha=0.25, linewidth=0.8)
            mean = [sum(v) / len(v) for v in zip(*curves, strict=True)]
            low, high = (
                [min(v) for v in zip(*curves, strict=True)],
                [max(v) for v in zip(*curves, strict=True)],
            )
            ax.fill_between(x, low, high, color=colour, alpha=0.15)
            name = "rlflow" if side == "rlflow" else f"TRL {next(iter(runs.values()))['trl_version']}"
            ax.plot(x, mean, color=colour, linewidth=2, label=f"{name} (mean of {len(curves)} seeds)")
        ax.set_title(f"{algorithm.upper()}: held-out accuracy (greedy)")
        ax.set_xlabel("samples")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[bench] curves: {path}")


def _seeds(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", type=Path, help="SFT checkpoint directory (with models/actor); default: run SFT")
    p.add_argument("--sft-graph", type=Path, default=EXAMPLES / "sft.yaml")
    p.add_argument("--ppo-graph", type=Path, default=EXAMPLES / "ppo.yaml")
    p.add_argument("--grpo-graph", type=Path, default=EXAMPLES / "grpo.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every graph")
    p.add_argument("--algorithms", default="ppo,grpo", help="comma-separated: ppo, grpo")
    p.add_argument("--sides", default="rlflow,trl", help="comma-separated: rlflow, trl")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2])
    p.add_argument(
        "--iterations", type=int, help="RL iterations per run (default: the graph's run.iterations)"
    )
    p.add_argument("--eval-interval", type=int, default=10, help="held-out evaluation every N iterations")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    p.add_argument("--trl-ppo-python", default=TRL_PYTHON["ppo"], help="Python with trl==1.12.0")
    p.add_argument("--trl-grpo-python", default=TRL_PYTHON["grpo"], help="Python with the current TRL")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-learning", help="work and result dir")
    p.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS", help="report these results.json only")
    p.add_argument("--worker", choices=("rlflow", "trl", "eval"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    algorithms = [a for a in args.algorithms.split(",") if a]
    args.sides = [s for s in args.sides.split(",") if s]
    if set(algorithms) - set(ALGORITHMS) or set(args.sides) - set(SIDES) or not args.seeds:
        p.error("--algorithms: ppo,grpo; --sides: rlflow,trl; --seeds: at least one")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = merge(args.merge)
        print_table(summary(results))
        plot(results, out / "learning_vs_trl.png")
        return
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M")
    sft = sft_checkpoint(args, out)
    results = {a: run_algorithm(args, a, sft, out) for a in algorithms}
    rows = summary(results)
    record = {"started": started, "loadavg_start": load, "loadavg_end": os.getloadavg(), "sft": str(sft),
              "argv": sys.argv[1:], "design": DESIGN, "summary": rows, "results": results}  # fmt: skip
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print(f"\nlearning parity, started {started}, load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}, SFT {sft}")
    print_table(rows)
    for algorithm in algorithms:
        print(f"design ({algorithm}): {DESIGN[algorithm]}")
    plot(results, out / "learning_vs_trl.png")


if __name__ == "__main__":
    main()
