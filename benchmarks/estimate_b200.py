"""On paper (issue #20 item 4): the 40-layer V4.1-Flash on 4 x B200 with EP x DP, from the slice's numbers.

An estimate, not a measurement. Two parts:

Memory per GPU, exact from the released config (spec §1.1) and storage: every parameter's bytes in memory once
loaded (model/released.py `memory_plan` on the meta device: FP8 dense with e8m0 tile scales, FP4 experts with e8m0
scales, FP8 Engram tables as stored; the head and ratio-2 compressor fp32 and wo_a bf16, wider than the files'
bf16, bf16 and FP8), split as the engine's EP x DP splits them (model/parallel.py): the routed experts evenly
across ranks, the Engram tables by rows, everything else replicated; plus the paged KV state of `--batch`
sequences of `--context` positions a GPU (model/paged.py `bytes_per_block`, `bytes_per_slot`: the engine's own
tensors) and the workspace the slice measured beyond its weights and KV (its peak less both, at the same batch
and context; the head kernel's bf16 copy, kernels/head.py, is in it: the slice's head is the released one).

Decode time per GPU, scaled from the slice's profile (`bench_slice.py --profile BxC --json`, an H200 or H100): each
slice layer's device ms stands for the real layers of its role (spec §1.3: 1 window-only layer, 1 window-only
with Engram, 3 ratio-2 sources, 15 ratio-2 consumers, 1 ratio-1 source, 15 ratio-1 consumers, 4 re-index
layers; layer 14's Engram block counted once more), split in three:
- the routed experts' kernels (`_gate_up_kernel`, `_down_kernel`): under EP each GPU runs the picks of all
  ranks' rows (ranks x batch x top-k) over its E/ranks experts, so it reads the weights of the experts those
  picks touch, E/ranks x (1 - (1 - 1/E)^(ranks x batch x k)) under uniform routing (the released gate is
  trained toward balance), against the experts the profiled slice step read: the count the profile took
  (`bench_slice.py` `profile_run`: the random slice routes 64 rows to ~30 of 384 experts a layer, not the
  uniform 243.8), or that uniform expectation for a profile without the count (said so); their time scales
  with that ratio (they are bound by the expert bytes at decode);
- everything else of the layer (attention, the indexer, hyper-connections, norms, the shared expert): the
  same work per GPU under DP (each rank its own batch);
- both then scaled by HBM bandwidth, B200 over the profiled GPU (nominal TB/s: `PROFILED_GPUS` by the profile's
  hardware name, H200 or H100, or `--profiled-bw`; `--b200-bw`; a decode step
  at batch 64 is bound by the bytes it reads, RESULTS.md "The slice at context");
- the profile's eager kernel time is converted to a CUDA-graph step by the slice's measured ratio of graph
  step to profiled kernel time (the graph ms/step `bench_slice.py --profile` times on the same rows, or
  `--graph-step-ms`);
- plus per layer the EP exchange (an all-gather of the ranks' rows, bf16, and a reduce-scatter of the
  outputs, fp32) over NVLink at `--nvlink` GB/s one way, with a fixed `--collective-us` latency each, and
  the head, embedding and sampler once (the slice's non-layer kernel time, scaled by bandwidth).

It assumes CUDA graphs (or a host that keeps up) under EP: the engine turns graphs off when world_size > 1
(issue #9), and an eager step is host-bound (the slice's eager batch-1 step is 4-6x its graph step), so as
the engine stands an EP x DP decode step would be bound by its host, not by this estimate.

Usage: python benchmarks/estimate_b200.py PROFILE.json [--slice-peak-gb 69.8] [--batch 64] [--context 32768]
Prints markdown tables for benchmarks/RESULTS.md. Runs on any machine (no GPU: meta tensors only).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from model.config import BLOCK_SIZE, cdiv, preset
from model.paged import bytes_per_block, bytes_per_slot
from model.released import Storage, memory_plan

GB = 1e9
# the slice's layer (model/config.py _v41_slice) that stands for each real layer of the released config
ROLES = {0: [0], 1: [1], 2: [2, 8, 14], 3: [*range(3, 8), *range(9, 14), *range(15, 20)], 4: [20],
         5: [*range(21, 24), *range(25, 28), *range(29, 32), *range(33, 36), *range(37, 40)], 6: [24, 28, 32, 36]}
MOE_KERNELS = ("_gate_up_kernel", "_down_kernel")
# nominal HBM TB/s and SMs of the GPUs a profile may come from, by a part of the name torch reports
PROFILED_GPUS = {"H200": (4.8, 132), "H100 80GB HBM3": (3.35, 132)}


def released_args(context: int):
    """The released 40-layer config (spec §1.1) on the slice's widths: its layer roles and full Engram tables
    (the token map stays the slice's stub, which sizes no table)."""
    a = preset("v41-slice")
    return replace(a, n_layers=40, compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20, kv_source_layers=(2, 8, 14, 20),
                   index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer=20,
                   engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
                   engram_vocab_size=16000000,
                   max_seq_len=max(a.max_seq_len, context)).check()


def hit(experts: int, picks: int) -> float:
    """The chance that one of `experts` is hit by at least one of `picks` uniform picks."""
    return 1 - (1 - 1 / experts) ** picks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("profile", help="bench_slice.py --json output with a --profile of the slice")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="sequences a GPU decodes (DP: each rank its own batch)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--graph-step-ms", type=float, default=None,
                   help="the slice's CUDA-graph ms/step at the profile's batch and context (default: the profile's)")
    p.add_argument("--slice-peak-gb", type=float, default=None, help="the slice's peak GB at that batch and context")
    p.add_argument("--profiled-bw", type=float, default=None,
                   help="the profiled GPU's HBM TB/s (default: by its name, PROFILED_GPUS)")
    p.add_argument("--b200-bw", type=float, default=8.0, help="B200 HBM TB/s (nominal)")
    p.add_argument("--b200-gb", type=float, default=180.0, help="B200 memory a process can use, GB")
    p.add_argument("--profiled-sms", type=int, default=None,
                   help="the profiled GPU's SMs, for kernels bound by issuing instructions (default: by its name)")
    p.add_argument("--b200-sms", type=int, default=148, help="B200 SMs")
    p.add_argument("--nvlink", type=float, default=900.0, help="NVLink GB/s one way per GPU (B200: NVLink 5)")
    p.add_argument("--collective-us", type=float, default=20.0, help="latency of one small NCCL collective, us")
    a = p.parse_args()
    try:
        with open(a.profile) as f:
            report = json.load(f)
        prof = report["profile"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"cannot read a slice profile from {a.profile}: {e}.")
    if prof is None or prof["batch"] != a.batch or prof["context"] != a.context:
        sys.exit(f"{a.profile} has no profile at batch {a.batch} and context {a.context}; run bench_slice.py "
                 f"--profile {a.batch}x{a.context}.")
    gpu = report.get("hardware", "")
    known = next((v for name, v in PROFILED_GPUS.items() if name in gpu), None)
    if known is None and (a.profiled_bw is None or a.profiled_sms is None):
        sys.exit(f"{a.profile} was profiled on {gpu or 'an unnamed GPU'}, whose bandwidth and SMs this script does "
                 f"not know; give --profiled-bw and --profiled-sms.")
    profiled_bw = a.profiled_bw or known[0]
    profiled_sms = a.profiled_sms or known[1]
    gpu = gpu.removeprefix("NVIDIA ") or "the profiled GPU"
    slice_args, full = preset("v41-slice"), released_args(a.context)
    E, k, G = full.n_routed_experts, full.n_activated_experts, a.gpus

    # ---- memory per GPU -------------------------------------------------------------------------------
    loaded = memory_plan(full, Storage(), G)
    whole = {"routed experts": loaded["routed experts"], "Engram tables": loaded["Engram tables"],
             "replicated (attention, shared expert, HC, embed, head)": loaded["replicated"]}
    per_gpu = {name: v / G if name in ("routed experts", "Engram tables") else v for name, v in whole.items()}
    kv = a.batch * (cdiv(a.context, BLOCK_SIZE) * bytes_per_block(full) + bytes_per_slot(full))
    per_gpu[f"KV blocks and state slots ({a.batch} x {a.context:,} positions)"] = kv
    slice_kv = a.batch * (cdiv(a.context, BLOCK_SIZE) * bytes_per_block(slice_args) + bytes_per_slot(slice_args))
    if a.slice_peak_gb:
        workspace = a.slice_peak_gb * GB - report["weight_GB"] * GB - slice_kv
        per_gpu["workspace (the slice's peak less its weights and KV)"] = max(workspace, 0.0)
    total = sum(per_gpu.values())
    print(f"### Memory per GPU: {full.n_layers} layers, {G} x B200, EP {G} x DP {G}, batch {a.batch} a GPU, "
          f"context {a.context:,}\n")
    print("| part | GB per GPU | whole model GB |")
    print("|---|---|---|")
    for name, v in per_gpu.items():
        print(f"| {name} | {v / GB:.1f} | {whole.get(name, v * G) / GB:.1f} |")
    print(f"| total | {total / GB:.1f} (of {a.b200_gb:.0f}) | |\n")

    # ---- decode step per GPU --------------------------------------------------------------------------
    d = prof["decode"]
    # the routed experts' kernels cost alike in every layer (one launch each)
    moe = sum(x["ms"] for x in d["top"] if x["name"] in MOE_KERNELS) / len(d["layers"])
    layers = {x["layer"]: x for x in d["layers"]}
    outside = d["device_ms"] - sum(x["total_ms"] for x in d["layers"])  # embed, head, sampler, step inputs
    graph_ms = a.graph_step_ms or d.get("graph_ms_per_step")
    if graph_ms is None:
        sys.exit(f"{a.profile} has no CUDA-graph step time; give --graph-step-ms.")
    graph = graph_ms / d["device_ms"]  # graph step per ms of profiled kernel time
    bw = profiled_bw / a.b200_bw
    per_gpu_experts = E / G * hit(E, G * a.batch * k)
    one_gpu_experts = d.get("experts_per_layer")
    counted = one_gpu_experts is not None
    if not counted:
        one_gpu_experts = E * hit(E, a.batch * k)
    moe_scale = per_gpu_experts / one_gpu_experts
    rows = []
    for role, real in ROLES.items():
        x = layers[role]
        other = x["total_ms"] - moe
        if role == 2:
            other += layers[1]["engram_ms"] / len(real)  # layer 14, a ratio-2 source, has an Engram block too
        rows.append((role, len(real), other))
    print(f"### Decode step per GPU (estimate), from the slice's profile at batch {a.batch}, context {a.context:,}\n")
    print(f"Profiled on {gpu} ({profiled_bw} TB/s, {profiled_sms} SMs). "
          f"Scales: B200/profiled bandwidth {1 / bw:.2f}x; the profile's kernel time to a graph step {graph:.3f}x; "
          f"routed experts read per GPU {per_gpu_experts:.1f} of {E // G} (EP, uniform routing) against "
          f"{one_gpu_experts:.1f} of {E} in the profiled slice step ("
          f"{'counted' if counted else 'the uniform expectation: this profile has no count'}; {moe_scale:.3f}x).\n")
    print(f"| slice layer (role) | real layers | {gpu} ms a layer, non-MoE | {gpu} ms a layer, routed experts | "
          "B200 ms, all its layers |")
    print("|---|---|---|---|---|")
    step = experts_profiled = 0.0
    for role, n, other in rows:
        ms = n * (other + moe * moe_scale) * graph * bw
        step += ms
        experts_profiled += n * moe * moe_scale * graph
        print(f"| {role} (ratio {layers[role]['ratio']}) | {n} | {other:.3f} | {moe:.3f} | {ms:.2f} |")
    head = outside * graph * bw
    dim = full.dim
    gather = (G - 1) * a.batch * dim * 2  # bf16 rows from the other ranks
    scatter = (G - 1) * a.batch * dim * 4  # fp32 partial outputs to the other ranks
    comm = full.n_layers * (2 * a.collective_us / 1e3 + (gather + scatter) / (a.nvlink * GB) * 1e3)
    engram_comm = len(full.engram_layer_ids) * (2 * a.collective_us / 1e3)
    step += head + comm + engram_comm
    print(f"| embed, head, sampler (once) | - | {outside:.3f} | - | {head:.2f} |")
    print(f"| EP exchange: {full.n_layers} MoE + {len(full.engram_layer_ids)} Engram layers x (all-gather + "
          f"reduce-scatter) | - | - | - | {comm + engram_comm:.2f} |")
    print(f"| **step** | {full.n_layers} | | | **{step:.1f} ms** |\n")
    print(f"Decode per GPU at batch {a.batch}, context {a.context:,}: ~{a.batch / step * 1e3:,.0f} tokens/s "
          f"({G} GPUs: ~{G * a.batch / step * 1e3:,.0f} tokens/s), an estimate.")
    # kernels/fp4_moe.py at decode is bound by issuing its decode instructions on an H200, not by HBM
    # (benchmarks/RESULTS.md): the bandwidth scale above assumes a B200 kernel bound by the expert bytes (a
    # block-scaled MMA, say); the same kernel as it is would scale by SMs at a like clock
    sm = profiled_sms / a.b200_sms
    issue = step + experts_profiled * (sm - bw)
    print(f"\nWith the routed experts' kernels bound by instruction issue (scaled by SMs, "
          f"{a.b200_sms} over {profiled_sms}, not by bandwidth): the routed experts {experts_profiled * sm:.1f} ms of a "
          f"**{issue:.1f} ms** step, ~{a.batch / issue * 1e3:,.0f} tokens/s a GPU.")


if __name__ == "__main__":
    main()
