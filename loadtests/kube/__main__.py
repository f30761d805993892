"""``python -m loadtests.kube`` (``make kube-test``): the Kubernetes manifests of kubernetes/
run with ``podman kube play`` on this host, checked end to end, and removed.

1. Sets up podman (as ``make compose-test`` does: loadtests/compose/podman.py) and builds the
   images compose builds, under the tag ``kube`` (``--no-build``: use those already built).
2. Generates the Secrets as an operator would (``artery nats-config``, a PostgreSQL password),
   renders each StatefulSet, Job and Deployment replica as a Pod podman 4.3 can play
   (render.py says what differs and why), and plays them in a network of their own: the NATS
   cluster and PostgreSQL until ready, the provision Job until done, then the services until
   every readiness probe passes.
3. An agent on the host trains the tiny model 2 steps; the trainer pod's container is SIGKILLed
   mid-step and the step completes after it comes back; PostgreSQL holds everything once; both
   replicas serve the new step; the 3 NATS servers form one cluster with every stream on all.
4. Removes the pods, volumes, secrets and network, even when a check failed (``--keep-running``:
   leave them up). The figures go to loadtests/results/kube.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loadtests import RESULTS_DIR
from loadtests.compose.podman import ROOT, Podman, ensure_tools
from loadtests.kube import images, scenario
from loadtests.kube.deployment import KubeDeployment, log

WORK = ROOT / ".artery" / "kube"
#: Each pod uses one core at most: the machine is small and shared.
ENV_OVERRIDES = {"ARTERY_TRAINER_TORCH_THREADS": "1", "ARTERY_INFERENCE_TORCH_THREADS": "1"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.kube", description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the images already built (tag kube)")
    parser.add_argument("--keep-running", action="store_true", help="leave the pods up at the end")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results: dict = {"ok": False}
    ensure_tools()
    podman = Podman(work=WORK)
    KubeDeployment(podman).teardown()  # what an interrupted earlier run left
    for stale in WORK.glob("run-*"):
        shutil.rmtree(stale, ignore_errors=True)
    deployment = KubeDeployment(podman, env_overrides=ENV_OVERRIDES)
    try:
        if args.no_build:
            missing = images.missing(podman)
            if missing:
                raise SystemExit(f"--no-build, but not built: {missing}")
        else:
            images.build_all(podman, results)
        deployment.prepare()
        up_started = time.monotonic()
        results["ready_after_s"] = {}
        deployment.up(results["ready_after_s"])
        results["time_to_ready_s"] = round(time.monotonic() - up_started, 1)
        with tempfile.TemporaryDirectory(prefix="kube-agent-") as base_path:
            asyncio.run(scenario.training_with_a_kill(deployment, Path(base_path), results))
        scenario.nats_is_one_cluster(deployment, results)
        results["ok"] = True
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED: {results['error']}")
        for plan in deployment.plans:
            print(f"--- {plan.name} (last lines)\n{deployment.logs(plan.name, 15)}", file=sys.stderr)
    finally:
        if not args.keep_running:
            left = deployment.teardown()
            results["cleaned_up"] = not left
            if left:
                log(f"left over: {left}")
        results["total_s"] = round(time.monotonic() - started, 1)
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "kube.json").write_text(json.dumps(results, indent=2) + "\n")
        log(f"{'ok' if results['ok'] else 'FAILED'} in {results['total_s']:.0f} s: {json.dumps(results)}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
