"""The one table of feature combinations (module doc of `graphgen.composition`): every refused cell is a refusal
the runtimes ask for here, every runs cell names the test that runs it. Lifting a refusal: its ``refused(...)``
row becomes ``runs(..., "tests/<file>.py::<test>", "what it compares with")``, plus the runtime's code."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from .launch import BOTH, CPU, NPU, Cell, Launch, _check_cell, _key, refused, runs, turned_off

# ---------------------------------------------------------------------------------------------- the sentences
# Shared by several cells (one sentence, several pairs): lift them together or split the sentence.
PD_SHARED_POOL = ("--role {role} hands the KV over through a shared pool: it needs --pool mooncake://HOST:PORT (not "
                  "host) and a --write other than off (got --pool {pool}, write {write})")
LORA_RANKS = "LoRA adapters are not split over parallel ranks yet (docs/lora.md)"
LORA_RANKS_FIX = "remove the lora: section, or use a parallel layout of one rank"


ASYNC_SCHEDULING_DP = ("async scheduling is off under DP attention (--dp > 1): a DP rank with nothing to run serves "
                          "the other groups' forwards with dummy forwards between the launcher's calls, a protocol of "
                          "whole steps, so step N+1 is planned after step N (docs/parallel.md, \"Async scheduling on "
                          "ranks\")")


def _async_on(dim: str) -> Callable[[Launch], bool]:
    return lambda x: x.async_scheduling and (getattr(x, dim) > 1 if dim != "sp" else x.sp)


# ------------------------------------------------------------------------------------------------- the table
# Order matters only among refusals: the first that applies is the one a launch prints (launch checks before
# spec rules, as before the table: the NPU target's gaps, then the rank runners', then the roles').
CELLS: tuple[Cell, ...] = (
    # --- refused at launch: what only the NPU target lacks (the CPU ranks run it)
    refused(("cp", "dp"), NPU, "context parallel with DP attention does not run on the NPU runner yet (its CP pieces "
                               "are padded to one bucket per CP group, not to the DP ranks' agreed bucket: "
                               "graphgen/npu/run/context_parallel.py); use --target cpu, or run with --cp 1",
            when=lambda x: x.cp > 1 and x.dp > 1),
    refused(("cp", "mtp"), NPU, "context parallel with MTP layers does not run on the NPU runner yet (its CP step "
                                "splits no MTP draft run: the MTP graph's CP gather is not lowered and its draft "
                                "runs are not bucketed per CP rank, graphgen/npu/run/context_parallel.py "
                                "run_cp_step); use --target cpu, or run with --cp 1",
            when=lambda x: x.cp > 1 and x.mtp),
    # --- refused at launch: what the CPU ranks lack
    refused(("cp", "dp", "mtp"), CPU, "--speculative mtp with context parallel inside DP attention is not built yet "
                                      "(a DP group's dummy draft forward runs the MTP graph unsplit, its CP gather "
                                      "without the step's split: graphgen/runtime/parallel/dp_rank.py); run with "
                                      "--dp 1 or --cp 1",
            when=lambda x: x.speculative and x.cp > 1 and x.dp > 1),
    # --- refused at launch: P/D roles (serve --role)
    refused(("mtp", "pd", "tp"), BOTH, "--speculative mtp under --role prefill|decode runs with one rank per instance "
                                       "so far (the handoff of speculative ranks' successor-keyed shards is untested: "
                                       "docs/pd.md, \"MTP through P/D\"); serve the role with --tp 1 --ep 1 --dp 1, "
                                       "or --role both",
            when=lambda x: x.speculative and x.role != "both" and x.world > 1),
    refused(("pd",), BOTH, PD_SHARED_POOL, when=lambda x: x.role != "both" and (
        x.write == "off" or x.pool == "host"), example=(("pool", "host"),)),
    # --- refused by the spec rules (graphgen validate; every launch, whose flags bypass the loader)
    refused(("sp", "mtp"), BOTH, "sp with MTP is not implemented (the sequence-parallel pass does not split the MTP "
                                 "layer: its eh_proj would read the embedding's token shard before the all-gather)",
            "spec", path="parallel.sp", fix="set sp: false, or turn MTP off", when=lambda x: x.mtp and x.sp),
    refused(("lora", "tp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "ep"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "sp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "dp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "cp"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    refused(("lora", "nodes"), BOTH, LORA_RANKS, "spec", path="lora", fix=LORA_RANKS_FIX),
    # --- runs: each test runs the whole combination on tiny specs (so every pair and single of it) and compares
    # its tokens with the reference the note names (greedy; near ties by tests/support/tokens.py's margin rule)
    runs(("async_write", "prefix_cache"), CPU, "tests/e2e/test_e2e_modes.py::test_greedy_tokens_identical_across_"
         "write_modes[deepseek_v3]", "every write mode and granularity, cold and warm, = write off = transformers"),
    runs(("async_write", "prefix_cache", "chunked"), CPU, "tests/e2e/test_e2e_chunked_prefill.py::test_chunked_prefill_"
         "matches_hf_and_unchunked_in_every_write_mode[qwen3_dense]", "= unchunked = transformers"),
    runs(("async_write", "async_scheduling", "prefix_cache"), CPU, "tests/runtime/test_continuous_batching.py::test_"
         "async_scheduling_on_off_and_write_modes_give_identical_tokens[async]", "= async scheduling off"),
    runs(("async_write", "async_scheduling", "chunked", "mtp"), CPU, "tests/runtime/test_mtp_speculative.py::test_"
         "speculative_equals_greedy_every_write_mode[async-True-8]", "= greedy without drafts = transformers"),
    runs(("async_write", "prefix_cache", "mtp"), CPU, "tests/runtime/test_mtp_speculative.py::test_pool_hit_keeps_"
         "the_drafts[async]", "tokens and draft logits after a pool hit = cold"),
    runs(("async_write", "dp", "ep", "mtp"), NPU, "tests/npu/test_npu_speculative.py::test_dp2_ep2_on_the_npu_ranks_"
         "equals_one_rank_with_dummy_draft_and_verify_calls", "= one NPU rank = the CPU run, dummy draft and verify "
         "calls seen"),
    runs(("async_write", "prefix_cache", "chunked", "cp"), CPU, "tests/parallel/test_context_parallel.py::test_qwen3_"
         "cp2_matches_transformers_and_cp1_and_a_swapped_split_does_not", "= cp 1 = transformers"),
    runs(("async_write", "prefix_cache", "chunked", "cp", "tp"), CPU, "tests/parallel/test_context_parallel.py::test_"
         "qwen3_cp2_tp2_matches_transformers_and_cp1", "= cp 1 = transformers"),
    runs(("async_write", "chunked", "cp"), CPU, "tests/serve/test_serve_cp.py::test_serve_cp2_"
         "greedy_equals_cp1", "serve --cp 2 = cp 1"),
    runs(("async_write", "prefix_cache", "sp", "tp"), CPU, "tests/parallel/test_parallel_ranks.py::test_qwen3_tp2_"
         "write_modes_give_the_same_tokens[tp2_sp]", "every write mode, cold and warm, = one rank"),
    runs(("async_write", "prefix_cache", "tp"), CPU, "tests/parallel/test_parallel_ranks.py::test_qwen3_tp2_write_"
         "modes_give_the_same_tokens[tp2]", "every write mode, cold and warm, = one rank"),
    runs(("async_write", "chunked", "tp"), CPU, "tests/parallel/test_parallel_ranks.py::test_qwen3_tp2_mixed_batches_"
         "match_transformers_on_every_rank", "= transformers on every rank, chunks and decodes in one step"),
    runs(("prefix_cache", "structured", "tp"), CPU, "tests/serve/test_serve_tp.py::test_serve_tp2_greedy_equals_run_"
         "tp2_and_seeded_sampling_repeats", "serve --tp 2 = run --tp 2; its structured output = one rank's"),
    runs(("async_write", "async_scheduling", "ep", "prefix_cache", "tp"), CPU,
         "tests/parallel/test_parallel_ranks.py::test_deepseek_tp2_matches_"
         "transformers_and_saves_the_latent_once[ep2_local_experts]", "= transformers, the latent saved once"),
    runs(("async_write", "prefix_cache", "dp", "ep"), CPU, "tests/parallel/test_data_parallel.py::test_dp2_ep2_"
         "matches_transformers_tp1_and_shares_prefixes_across_ranks", "= one rank = transformers"),
    runs(("async_write", "dp", "ep", "tp"), CPU, "tests/parallel/test_data_parallel.py::test_dp2_tp2_ep4_matches_"
         "transformers_and_one_rank", "= one rank = transformers"),
    runs(("async_scheduling", "prefix_cache", "mooncake"), CPU, "tests/serve/test_serve_mooncake.py::"
         "test_two_servers_share_a_prefix_through_one_master", "the second server's hit = the first's cold answer"),
    runs(("async_write", "prefix_cache", "mooncake", "tp"), CPU, "tests/mooncake/test_ranks_pool.py::test_two_tp2_"
         "engines_share_a_prefix_and_a_killed_master_costs_recomputes", "the hit = the cold run"),
    runs(("async_write", "async_scheduling", "pd", "mooncake"), CPU, "tests/serve/test_pd.py::test_router_tokens_"
         "equal_a_single_instance", "2P1D through the router = one instance"),
    runs(("async_write", "pd", "mooncake", "tp"), CPU, "tests/serve/test_pd.py::test_ranks_pd_"
         "through_the_router_equals_a_single_instance_and_a_killed_p_rank_falls_back", "tp-2 P and D = one instance"),
    runs(("async_write", "dp", "ep", "pd", "mooncake", "tp"), CPU,
         "tests/serve/test_pd.py::test_dp_tp_pd_through_the_router_equals_one_rank_and_each_lease_ends_when_d_read_"
         "or_timed_out", "dp 2 x tp 2 P and D through the router = one rank, margin-aware"),
    runs(("async_scheduling", "nodes", "tp"), CPU, "tests/parallel/test_nodes.py::test_qwen3_tp4_serve_on_two_nodes_"
         "equals_four_ranks_on_one_and_a_lost_node_ends_it", "two nodes = four ranks on one"),
    runs(("dp", "ep", "nodes"), CPU, "tests/parallel/test_nodes.py::test_deepseek_dp4_ep4_on_two_nodes_equals_four_"
         "ranks_on_one", "two nodes = four ranks on one"),
    runs(("async_write", "lora"), CPU,
         "tests/lora/test_lora_numerics.py::test_adapters_batched_with_base_requests_match_peft"
         "[deepseek_v3]", "= PEFT"),
    runs(("async_scheduling", "lora", "mooncake", "prefix_cache"), CPU, "tests/mooncake/test_lora_pool.py::test_the_"
         "same_adapter_on_two_servers_shares_blocks_through_mooncake", "the hit = the cold answer"),
    runs(("async_write", "async_scheduling", "tools"), CPU,
         "tests/serve/test_serve_tools.py::test_tool_call_and_reasoning[tiny_"
         "deepseek_v3_chat]", "the calls and the reasoning the chat checkpoint writes"),
    runs(("async_write", "async_scheduling", "structured", "tools"), CPU,
         "tests/serve/test_serve_tools.py::test_named_tool_choice_"
         "is_forced_by_the_grammar[tiny_deepseek_v3_chat]", "the forced call parses"),
    runs(("async_scheduling", "structured"), CPU, "tests/serve/test_serve_structured.py::test_json_schema_validates"
         "[sampling0]", "the output validates against the schema"),
    runs(("async_write", "w8a8"), BOTH,
         "tests/npu/test_w8a8.py::test_w8a8_npu_standin_gives_the_cpu_targets_tokens[deepseek_v3]",
         "the stand-in = the CPU target's int8 emulation, and both move off the unquantized logits"),
    runs(("async_write", "prefix_cache"), NPU, "tests/npu/test_npu_runner.py::test_greedy_tokens_and_logits_match_"
         "the_cpu_target", "= the CPU target, a prompt repeating another's blocks"),
    runs(("async_write", "chunked"), NPU, "tests/npu/test_npu_runner.py::test_mixed_batches_with_chunks_run_on_the_"
         "npu_runner_and_match_the_cpu_target", "= the CPU target"),
    runs(("async_write", "mtp", "prefix_cache"), NPU, "tests/npu/test_npu_speculative.py::test_tokens_equal_the_cpu_"
         "run", "= the CPU target's speculative run, cold and after a pool hit"),
    runs(("async_write", "async_scheduling", "tp"), NPU, "tests/npu/test_npu_ranks.py::test_qwen3_npu_ranks_match_"
         "the_cpu_ranks", "= the CPU ranks (those without async scheduling)"),
    runs(("async_write", "ep", "tp"), NPU, "tests/npu/test_npu_ranks.py::test_deepseek_npu_ranks_cli_match_the_cpu_"
         "ranks", "= the CPU ranks"),
    runs(("async_write", "dp", "ep"), NPU, "tests/npu/test_npu_ranks.py::test_deepseek_npu_dp2_ep2_matches_the_cpu_"
         "dp_ranks", "= the CPU DP ranks"),
    runs(("async_write", "dp", "ep", "tp"), NPU, "tests/npu/test_npu_ranks.py::test_deepseek_npu_dp2_tp2_ep4_cli_"
         "matches_one_rank", "= one rank"),
    runs(("async_write", "async_scheduling", "chunked", "cp", "prefix_cache", "sp", "tp"), CPU,
         "tests/parallel/test_context_parallel.py::test_cp2_tp2_sp_matches_transformers_and_one_rank[deepseek]",
         "the seed's CP/SP with async scheduling = one rank = transformers, a request admitted while a forward runs"),
    runs(("async_write", "dp", "ep", "sp", "tp"), CPU, "tests/parallel/test_data_parallel.py::test_dp2_tp2_ep4_with_"
         "sequence_parallel_matches_transformers_and_one_rank", "= one rank = transformers"),
    runs(("async_write", "chunked", "cp", "dp", "ep", "prefix_cache"), CPU, "tests/parallel/test_context_parallel.py::"
         "test_deepseek_cp2_inside_dp2_matches_transformers_and_one_rank", "= one rank = transformers (13 tokens "
         "chunked by 8, a hit on the other group's blocks)"),
    runs(("async_write", "cp", "mtp", "prefix_cache", "tp"), CPU, "tests/parallel/test_mtp_ranks.py::test_cp2_tp2_"
         "speculative_equals_one_rank_and_keeps_the_drafts_after_a_hit", "= one rank's speculative run, the MTP "
         "layer's draft runs split head-tail, drafts kept after a hit"),
    runs(("async_write", "mtp", "prefix_cache", "tp"), CPU, "tests/parallel/test_mtp_ranks.py::test_tp2_speculative_"
         "equals_one_rank_and_keeps_the_drafts_after_a_hit", "= one rank's speculative run, drafts kept after a hit"),
    runs(("async_write", "dp", "ep", "mtp"), CPU, "tests/parallel/test_mtp_ranks.py::test_dp2_ep2_speculative_drafts_"
         "per_group_with_dummy_draft_runs", "= one rank's speculative run"),
    runs(("async_write", "mooncake", "mtp", "pd"), CPU, "tests/serve/test_pd.py::test_mtp_pd_through_the_router_equals_"
         "the_single_rank_run_and_keeps_the_acceptance", "= the single-rank run, acceptance equal after a handoff"),
    runs(("mooncake", "nodes", "tp"), CPU, "tests/parallel/test_nodes.py::test_ranks_on_mooncake_across_two_nodes_each_"
         "announce_their_own_node", "every rank's puts land through its own node's client"),
    runs(("async_write", "ep", "mooncake", "nodes", "pd", "tp"), CPU, "tests/serve/test_pd_nodes.py::test_32_concurrent_"
         "clients_through_2p1d_of_two_node_instances_equal_one_rank", "2P1D of two-node instances = one rank"),
    runs(("async_write", "async_scheduling", "cp", "prefix_cache", "sp", "tp"), NPU, "tests/npu/test_npu_cp_sp.py::"
         "test_qwen3_npu_cp2_tp2_sp_matches_one_cpu_rank", "the seed's CP/SP with async scheduling = one CPU rank, a "
         "pool hit split over the CP ranks"),
    runs(("async_write", "sp", "tp", "ep"), NPU, "tests/npu/test_npu_cp_sp.py::test_deepseek_npu_tp2_sp_cli_matches_"
         "one_cpu_rank", "= one CPU rank"),
    runs(("async_write", "mtp", "prefix_cache", "tp"), NPU, "tests/npu/test_npu_speculative.py::test_tp2_on_the_npu_"
         "ranks_equals_one_rank_and_keeps_the_drafts_after_a_hit", "= one NPU rank = the CPU greedy run"),
    runs(("lora",), NPU, "tests/lora/test_lora_npu_delta.py::test_npu_engine_on_the_standin_matches_the_cpu_engine_"
         "with_adapters_batched", "= the CPU target with the same adapters"),
    # the NPU stand-in's server, one launch with serve's defaults and the seed's async-write companions on
    # (tests/serve/test_serve_npu.py: one rank, tiny_qwen3_npu's shape trained to answer with a thought and a call)
    runs(("async_write", "async_scheduling"), NPU, "tests/serve/test_serve_npu.py::test_serve_target_npu_standin_"
         "async_scheduling_gives_the_tokens_of_run_without_it", "serve (async scheduling on) = run --target npu "
         "--no-async-scheduling"),
    runs(("async_write", "async_scheduling", "chunked", "prefix_cache", "tools"), NPU, "tests/serve/test_serve_npu.py"
         "::test_tool_call_and_reasoning_equal_the_trained_answer_chunked_and_after_a_prefix_hit",
         "= transformers' greedy answer (the trained call and thought), chunked, and after a prefix hit"),
    runs(("async_write", "async_scheduling", "structured", "tools"), NPU, "tests/serve/test_serve_npu.py::test_named_"
         "tool_choice_is_forced_by_the_grammar", "the forced call parses, exactly the schema's keys"),
    # --- turned off: the launch runs without the feature, and says so (a note on stderr; rank.py's engine_options)
    turned_off(("async_scheduling", "dp"), BOTH, ASYNC_SCHEDULING_DP, when=_async_on("dp")),
    # --- refused per request (a 400 from serve)
    refused(("mtp", "structured"), BOTH, "structured output (response_format) is not supported with --speculative mtp "
                                         "(docs/mtp.md)", "request"),
)


# ------------------------------------------------------------------------------------------ asking the table
def launch_refusal(launch: Launch) -> Optional[str]:
    """The sentence refusing ``launch`` (the first refused cell that applies: launch checks, then spec rules,
    each rendered as the launch prints it), or None. Request-level cells are the engine's, per request."""
    for check in ("launch", "spec"):
        for cell in CELLS:
            if cell.is_refused and cell.check == check and cell.applies(launch):
                return cell.sentence(launch)
    return None


def spec_rules(launch: Launch) -> Iterator[tuple[str, str, str]]:
    """``(path, message, fix)`` of every spec rule refusing ``launch``'s combination (the loader and
    `families.parallel.parallel_rules`; the target is not the spec's business: rules hold on every target)."""
    seen = set()
    for cell in CELLS:
        if cell.check == "spec" and cell.applies(replace(launch, target=cell.targets[0])):
            rule = cell.rule(launch)
            if rule not in seen:  # one sentence refusing several pairs (LoRA with tp, ep and sp) is said once
                seen.add(rule)
                yield rule


def sentence_of(features: tuple[str, ...], target: str = "cpu") -> str:
    """The first refusal sentence of exactly this combination (for a check that refuses it outside a
    `Launch`, e.g. one request's fields); KeyError when the table does not refuse it."""
    for cell in CELLS:
        if cell.is_refused and cell.features == tuple(features) and target in cell.targets:
            return cell.refused
    raise KeyError(f"no refused cell {features} on {target}")


def launch_notes(launch: Launch) -> list[str]:
    """The sentences of every turned-off feature of ``launch`` (each once): run and serve print them."""
    out: list[str] = []
    for cell in CELLS:
        if cell.is_off and cell.applies(launch) and cell.sentence(launch) not in out:
            out.append(cell.sentence(launch))
    return out


def refusals(launch: Launch) -> list[Cell]:
    """Every refused cell that applies to ``launch`` (launch checks and spec rules in table order, as
    `launch_refusal` prints the first; then the request-level ones)."""
    return [c for c in CELLS if c.is_refused and c.check != "request" and c.applies(launch)] + \
        [c for c in CELLS if c.is_refused and c.check == "request" and c.applies(launch)]


@dataclass(frozen=True)
class SeedCombo:
    """A combination the seed ran (its README's list or its results table)."""
    what: str
    features: tuple[str, ...]


SEED: tuple[SeedCombo, ...] = (
    SeedCombo("async write (DeepSeek, Qwen dense)", ("async_write",)),
    SeedCombo("async write + async scheduling", ("async_write", "async_scheduling")),
    SeedCombo("async write + prefix cache", ("async_write", "prefix_cache")),
    SeedCombo("async write + context parallel", ("async_write", "cp")),
    SeedCombo("async write + sequence parallel", ("async_write", "sp")),
    SeedCombo("async write + MTP", ("async_write", "mtp")),
    SeedCombo("async write + function call, reasoning parsing", ("async_write", "tools")),
    SeedCombo("table rows 1-5: CP/SP (DeepSeek V3.1)", ("cp", "sp")),
    SeedCombo("table rows 1-5: CP/SP + async inference", ("async_scheduling", "cp")),
    SeedCombo("table rows 1-5: CP/SP + async inference", ("async_scheduling", "sp")),
    SeedCombo("table rows 6-7: DP/TP (DeepSeek V3.1)", ("dp", "tp")),
    SeedCombo("table rows 8-9: 2P1D of DP/TP instances", ("pd", "dp")),
    SeedCombo("table rows 8-9: 2P1D of DP/TP instances", ("pd", "tp")),
    SeedCombo("its deployments: DeepSeek V3.1 with MTP on DP/TP", ("mtp", "dp")),
    SeedCombo("its deployments: DeepSeek V3.1 with MTP on DP/TP", ("mtp", "tp")),
    SeedCombo("its deployments: CP/SP with MTP", ("mtp", "cp")),
    SeedCombo("its deployments: CP/SP with MTP", ("mtp", "sp")),
)


for _cell in CELLS:  # at import: a bad edit fails every command at once, naming the row
    _check_cell(_cell)
