"""Every test module's tier, in one table; ``conftest.py`` marks each test with its module's tier.

A module's tier is the heaviest thing its tests need (a module whose pure tests sit beside ones on
real servers is ``integration``), but for a whole-stack run marked ``slow`` in a unit or service
module, which ``make test-fast`` leaves out:

- ``unit``: pure logic in this process, the tiny model included; no server, no child process.
- ``contract``: the wire contract and the rules read from the source (schemas round-trip, generated
  documents match, layering, packaging, docs links).
- ``service``: one service's logic in this process (or a process that exits at once), driven
  through its handler or its HTTP app, with in-memory doubles of the bus or scripted HTTP peers;
  no nats-server, no PostgreSQL.
- ``integration``: real nats-server and/or PostgreSQL processes (the conftest fixtures), services
  in process or as child processes.
- ``e2e``: the whole stack (``LocalBackend``, ``Stack``, the ``artery`` command), a demo, the
  examples, a benchmark, a browser.

``make test-fast`` runs unit, contract and service, not ``slow``; ``make test`` runs every tier.
``tests/test_tiers.py`` fails when a module is missing here, so a new module must be placed.
"""

from __future__ import annotations

import sys

TIERS = ("unit", "contract", "service", "integration", "e2e")
#: The tiers ``make test-fast`` runs: no servers, no downloads.
FAST_TIERS = ("unit", "contract", "service")

TIER_OF_MODULE: dict[str, str] = {
    # -- unit
    "test_engine_sampling.py": "unit",
    "test_engine_batching.py": "unit",
    "test_engine_fp16_weights.py": "unit",
    "test_engine_lora_reuse.py": "unit",
    "test_engine_transformers.py": "unit",
    "test_gpu.py": "unit",  # in-process CUDA paths; skipped without ARTERY_TEST_CUDA and a GPU
    "test_vllm_cpu_kv_cache.py": "unit",  # the default size of vLLM-CPU's KV cache (no vllm needed)
    "test_gpu_vllm.py": "unit",  # the vLLM engine on CUDA; skipped without ARTERY_TEST_CUDA, a GPU and vllm
    "test_grpo_math.py": "unit",
    "test_tasks.py": "unit",
    "test_inference_tools.py": "unit",
    "test_models.py": "unit",
    "test_off_policy.py": "unit",
    "test_pause_gate.py": "unit",
    "test_sdk_units.py": "unit",
    "test_sdk_utils.py": "unit",
    "test_sequences.py": "unit",
    "test_tiny_model.py": "unit",
    "test_trainer_heap_release.py": "unit",
    "test_trainer_policy.py": "unit",
    "test_adapter_files.py": "unit",
    "test_tensor_bytes.py": "unit",
    "test_lora_slots.py": "unit",
    "test_adapter_users.py": "unit",
    "test_sampler_mismatch.py": "unit",
    "test_trainer_precision.py": "unit",
    "test_auto_trajectory.py": "unit",
    "test_art_newest_names.py": "unit",
    "test_torch_thread.py": "unit",
    # -- contract
    "test_contract.py": "contract",
    "test_docs.py": "contract",
    "test_one_owner.py": "contract",
    "test_packaging.py": "contract",
    "test_locked_versions.py": "contract",  # constraints/ against pyproject and the Makefile
    "test_structure.py": "contract",
    "test_tiers.py": "contract",
    "test_kubernetes.py": "contract",  # the manifests against the Kubernetes schemas, offline
    # -- service
    "test_auto_rl.py": "service",
    "test_capture_scopes.py": "service",
    "test_consumer_settle.py": "service",
    "test_service_in_memory.py": "service",
    "test_engine_choice.py": "service",
    "test_inference_api.py": "service",
    "test_ruler.py": "service",
    "test_trainer_template_variables.py": "service",
    "test_wire_apis.py": "service",
    "test_langfuse.py": "service",
    "test_settings_first.py": "service",
    "test_wandb.py": "service",
    "test_wire_tools.py": "service",
    # -- integration
    "test_adapters.py": "integration",
    "test_distributed_step.py": "integration",  # torchrun child processes (gloo)
    "test_compose.py": "integration",  # also runs nats-server with the generated users
    "test_art_dev.py": "integration",
    "test_broker_faults.py": "integration",
    "test_collector.py": "integration",
    "test_collector_faults.py": "integration",
    "test_console_queries.py": "integration",
    "test_control.py": "integration",
    "test_db_faults.py": "integration",
    "test_db_pool.py": "integration",
    "test_dotted_names.py": "integration",
    "test_embedded_servers.py": "integration",
    "test_export.py": "integration",
    "test_fuzz.py": "integration",
    "test_health.py": "integration",
    "test_inference_hostile.py": "integration",
    "test_inference_service.py": "integration",
    "test_input_edges.py": "integration",
    "test_judge_once.py": "integration",
    "test_mcp.py": "integration",
    "test_node_publisher.py": "integration",
    "test_publish_retry.py": "integration",
    "test_publisher.py": "integration",
    "test_registry_records.py": "integration",
    "test_replica_follows.py": "integration",
    "test_replica_loads_saved.py": "integration",
    "test_reward_hostile.py": "integration",
    "test_reward_service.py": "integration",
    "test_routing.py": "integration",
    "test_security.py": "integration",
    "test_sft.py": "integration",
    "test_tenants.py": "integration",
    "test_trainer_budgets.py": "integration",
    "test_trainer_fairness.py": "integration",
    "test_trainer_pause_outage.py": "integration",
    "test_consumer_subscriber.py": "integration",
    "test_mcp_server_url.py": "integration",
    "test_trainer_state_store.py": "integration",
    "test_trainer_pool.py": "integration",  # two trainer worker processes, one SIGKILLed
    # -- e2e
    "test_loadtests_scale.py": "e2e",  # the scale-out and control-plane benchmarks, tiny
    "test_art_api.py": "e2e",
    "test_art_conformance.py": "e2e",
    "test_no_missed_wakeups.py": "e2e",
    "test_art_surface.py": "e2e",
    "test_chaos.py": "e2e",
    "test_cli.py": "e2e",
    "test_console.py": "e2e",
    "test_credentials_at_rest.py": "e2e",
    "test_demo.py": "e2e",
    "test_demo_agent.py": "e2e",
    "test_engine_vllm.py": "e2e",
    "test_examples.py": "e2e",
    "test_export_model.py": "e2e",
    "test_gpu_loop.py": "e2e",
    "test_langgraph.py": "e2e",
    "test_learning_loop.py": "e2e",
    "test_loadtests_more.py": "e2e",
    "test_loadtests_smoke.py": "e2e",
    "test_lora_config.py": "e2e",
    "test_metrics.py": "e2e",
    "test_multiturn_tokens.py": "e2e",
    "test_operations.py": "e2e",
    "test_pipeline_trainer.py": "e2e",
    "test_replay.py": "e2e",
    "test_s3_transport.py": "e2e",
    "test_sdk_backend.py": "e2e",
    "test_secure_stack.py": "e2e",
    "test_soak_smoke.py": "e2e",
    "test_stack_lifetime.py": "e2e",
    "test_stress_runner.py": "e2e",
    "test_tenant_isolation.py": "e2e",
    "test_traces.py": "e2e",
    "test_trainable_completions.py": "e2e",
    "test_local_train_result.py": "e2e",
    "test_pipeline_autotune.py": "e2e",
    "test_serverless.py": "e2e",
}

#: Modules of a fast tier whose tests take seconds each on a CPU: they run the tiny model
#: (generation, a GRPO step) or start a Python process per test that imports the services or W&B.
#: ``conftest.py`` marks their tests ``slow``, so ``make test-fast`` leaves them out.
SLOW_MODULES = frozenset(
    {
        "test_auto_rl.py",
        "test_engine_batching.py",
        "test_engine_fp16_weights.py",
        "test_engine_lora_reuse.py",
        "test_engine_transformers.py",
        "test_langfuse.py",
        "test_settings_first.py",
        "test_tiny_model.py",
        "test_lora_slots.py",
        "test_trainer_policy.py",
        "test_wandb.py",
        "test_wire_apis.py",
    }
)

#: Fixtures that start a real server: a test of a fast tier that uses one is in the wrong tier.
SERVER_FIXTURES = frozenset({"nats_server", "pg_server", "stack"})


def modules_of(tiers: tuple[str, ...] | list[str], *, slow: bool = True) -> list[str]:
    """The paths of the modules of ``tiers``, from the repository's root (``slow=False``: but
    ``SLOW_MODULES``)."""
    return sorted(
        f"tests/{name}"
        for name, tier in TIER_OF_MODULE.items()
        if tier in tiers and (slow or name not in SLOW_MODULES)
    )


if __name__ == "__main__":
    # `make test-fast` names the modules itself: collecting every module to deselect most of them
    # would import torch, transformers and the whole stack first.
    print(" ".join(modules_of(sys.argv[1:] or FAST_TIERS, slow=False)))
