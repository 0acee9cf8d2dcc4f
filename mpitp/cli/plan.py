"""``mpitp plan``: bytes, shapes, memory and predicted time, without running a job."""

from __future__ import annotations

import json
from pathlib import Path

from ..plan import allreduce as par
from ..plan import fsdp as pfsdp
from ..plan import profiles
from ..plan import tp as ptp
from ..tp.partition import ShardingError
from ..train.sharding import MODES
from ..units import parse_size


def _size(text: str) -> int:
    """A size as every mpitp command reads it (:mod:`mpitp.units`)."""
    from argparse import ArgumentTypeError

    try:
        return parse_size(text, "size")
    except ValueError as e:
        raise ArgumentTypeError(str(e)) from None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n < 1e9 else f"{n / 1e9:,.3f} GB"


def _time(s: float) -> str:
    return f"{s * 1e6:,.1f} us" if s < 1e-3 else f"{s * 1e3:,.3f} ms"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="predict bytes, shapes, memory and time (alpha-beta model)",
        description="Plans from the alpha-beta cost model; nothing is launched. Profiles: "
        + ", ".join(f"{k} ({v.note})" for k, v in profiles.PROFILES.items())
        + ", local (fitted with 'mpiexec -n 2 mpitp plan fit').",
    )
    ps = p.add_subparsers(dest="plan", metavar="WHAT", required=True)

    def common(q):
        q.add_argument("--profile", default=profiles.SEED, help=f"link profile (default {profiles.SEED})")
        for f in ("alpha-intra", "beta-intra", "alpha-inter", "beta-inter"):
            q.add_argument(
                f"--{f}",
                type=float,
                default=None,
                help=f"override {f.replace('-', ' ')} ({'seconds' if 'alpha' in f else 'bytes/s'})",
            )
        q.add_argument("--json", action="store_true", help="print JSON")

    a = ps.add_parser("allreduce", help="bytes per link class and time per all-reduce algorithm")
    a.add_argument("--nodes", type=int, default=2)
    a.add_argument("--ranks-per-node", type=int, default=4)
    a.add_argument("--size", default="8MB", type=_size, help="bytes per rank (8MB = 8e6, 8MiB = 2^23; default 8MB)")
    common(a)
    t = ps.add_parser("tp", help="tensor-parallel shard shapes, all-reduces, bytes and time for a LLaMA model")
    t.add_argument("--model", default="llama2-7b", help=f"preset ({', '.join(ptp.PRESETS)}) or config.json path")
    t.add_argument("--tp", type=int, default=2)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--seq", type=int, default=2048)
    t.add_argument("--dtype", default="fp16", choices=sorted(ptp.DTYPE_BYTES))
    t.add_argument(
        "--weights",
        choices=sorted(ptp.WEIGHT_BYTES),
        help="weights in a block format, as a GGUF file or --weights q8_0 keeps them (bytes per weight as "
        "mpitp holds them: q8_0 1.0625, q4_0 0.5625, q4_1 0.625); default: --dtype",
    )
    common(t)
    f = ps.add_parser("fsdp", help="ZeRO-1/2/3 memory per rank and bytes per step")
    f.add_argument("--model", default=None, help="preset or config.json (or give --params)")
    f.add_argument("--params", type=float, default=None, help="parameter count, e.g. 7.5e9 (ZeRO paper)")
    f.add_argument("--ranks", type=int, default=64)
    f.add_argument("--k", type=int, default=12, help="optimizer bytes per parameter (12: mixed-precision Adam)")
    f.add_argument("--json", action="store_true")
    tr = ps.add_parser(
        "train",
        help="training on a (dp, tp) mesh: memory per rank, bytes per step per link class",
        description="Every way to cut tp x dp ranks (tp groups inside nodes, dp across them), "
        "with the requested one marked: memory per rank, TP and DP bytes per rank per step and "
        "their link class, inter-node bytes per node, communication time (alpha-beta, no overlap).",
    )
    tr.add_argument("--model", default="small", help="tiny, small (mpitp train presets), a plan preset or config.json")
    tr.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (inside a node)")
    tr.add_argument("--dp", type=int, default=2, help="data-parallel ranks (across nodes)")
    tr.add_argument("--nodes", type=int, default=2)
    tr.add_argument("--mode", choices=MODES, default="fsdp")
    tr.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    tr.add_argument("--seq", type=int, default=128)
    tr.add_argument("--dtype", default="fp32", choices=sorted(ptp.DTYPE_BYTES))
    tr.add_argument(
        "--param-dtype",
        choices=sorted(ptp.DTYPE_BYTES),
        help="mixed precision: what the all-gathers and tp activation all-reduces carry (--dtype)",
    )
    tr.add_argument(
        "--reduce-dtype", choices=sorted(ptp.DTYPE_BYTES), help="mixed precision: what the reductions carry (--dtype)"
    )
    common(tr)
    inf = ps.add_parser(
        "infer",
        help="inference across nodes: pipeline stages x tensor parallelism, bytes and messages per token",
        description="One decode step of P pipeline stages of T tensor-parallel ranks on N nodes (ranks in "
        "order, T consecutive ranks a stage): messages and bytes per link class, the alpha-beta time of that "
        "communication, weights and KV cache per rank; and the inter-node latency above which the stages beat "
        "tensor parallelism over all P x T ranks.",
    )
    inf.add_argument("--model", default="llama2-7b", help=f"preset ({', '.join(ptp.PRESETS)}) or config.json path")
    inf.add_argument("--tp", type=int, default=1)
    inf.add_argument("--pp", type=int, default=2)
    inf.add_argument("--nodes", type=int, default=None, help="nodes (default: --pp, one stage a node)")
    inf.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    inf.add_argument("--context", type=int, default=4096, help="KV cache length per row (default 4096)")
    inf.add_argument(
        "--weights", choices=sorted(ptp.WEIGHT_BYTES), help="block format of the weights (default float32)"
    )
    inf.add_argument("--link", default=None, help="inter-node bandwidth: 1gbit, 10gbit, 25gbit, or bytes/s")
    inf.add_argument("--latency", default=None, help="inter-node latency per message: 100us, 2ms, or seconds")
    inf.add_argument("--greedy", action="store_true", help="greedy rows: the head gathers a (value, token) pair a row")
    common(inf)
    fit = ps.add_parser("fit", help="fit the 'local' profile by ping-pong (run under mpiexec -n 2)")
    fit.add_argument("--json", action="store_true")


def _profile(args) -> profiles.Profile:
    return profiles.get(args.profile, args.alpha_intra, args.beta_intra, args.alpha_inter, args.beta_inter)


def run(args) -> int:
    out = {"allreduce": _allreduce, "tp": _tp, "fsdp": _fsdp, "train": _train, "fit": _fit, "infer": _infer}[args.plan](
        args
    )
    return 0 if out is None else out


def _allreduce(args):
    prof = _profile(args)
    res = par.plan(args.nodes, args.ranks_per_node, args.size, prof)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    B = res["bytes_per_rank"]
    print(
        f"all-reduce of {_mb(B)} per rank on {args.nodes} node(s) x {args.ranks_per_node} rank(s), "
        f"profile {prof.name}: intra {prof.intra.beta / 1e9:g} GB/s, inter {prof.inter.beta / 1e9:g} GB/s"
    )
    print(f"{'algorithm':<21} {'intra/node':>14} {'inter/node':>14} {'vs naive':>9} {'time':>12}  model")
    for r in res["algorithms"]:
        red = f"{r['inter_reduction_vs_naive']:.2f}x" if r["inter_reduction_vs_naive"] else "-"
        tag = "" if r["runnable"] else "   (model only)"
        print(
            f"{r['algorithm']:<21} {_mb(r['intra_bytes_per_node']):>14} {_mb(r['inter_bytes_per_node']):>14} "
            f"{red:>9} {_time(r['time_s']):>12}  {r['formula']}{tag}"
        )
    print("bytes are what each node's ranks send (intra: to the same node, inter: across nodes)")


def _tp(args):
    prof = _profile(args)
    m = ptp.load_model(args.model)
    res = ptp.plan(m, args.tp, args.batch, args.seq, args.dtype, prof, args.weights)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    s, pre, dec = res["shards"], res["prefill"], res["decode_step"]
    print(
        f"{ptp.model_name(args.model)}: hidden {m.hidden_size}, {m.num_hidden_layers} layers, "
        f"{m.num_attention_heads} heads ({m.num_key_value_heads} KV), "
        f"intermediate {m.intermediate_size}, vocab {m.vocab_size}; {res['params'] / 1e9:.2f}B parameters"
    )
    print(
        f"TP={args.tp}, {args.dtype}, weights {res['weights']}; per-rank shard shapes [in, out] (HF stores [out, in]):"
    )
    for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"):
        print(f"  {k:<13} {tuple(s[k])}")
    o = s["qkv_local_offsets"]
    print(
        f"  merged qkv_proj local rows: q at {o['q']}, k at {o['k']}, v at {o['v']} "
        f"(shard k starts at sum(output_sizes[:k]) / tp); KV heads per rank {s['kv_heads_per_rank']}, "
        f"each replicated on {s['kv_replication']} rank(s)"
    )
    print(f"  merged gate_up_proj local rows: gate at 0, up at {s['gate_up_local_offsets']['up']}")
    nb = res["weight_bytes_per_weight"]
    ranks = s["per_rank"]
    print("per rank: query heads, KV heads, intermediate columns, vocabulary rows, weights, bytes streamed per token")
    for r in ranks:
        print(
            f"  rank {r['rank']:>2}: q {r['q_heads'][0]:>3}-{r['q_heads'][1] - 1:<3} kv {r['kv_heads'][0]:>2}-"
            f"{r['kv_heads'][1] - 1:<2} inter {r['intermediate']:>6} vocab {r['vocab_rows']:>7}  "
            f"{_mb(r['weights'] * nb):>12} {_mb(r['streamed'] * nb):>12}"
            + (f"  experts: {r['experts']} x {r['expert_columns']:g} columns ({r['moe']})" if "moe" in r else "")
        )
    print(
        f"  a decode step streams {ptp.balance(m, args.tp):.3f}x an even share on its critical path (each all-reduce"
        " waits for the slowest rank of its segment: attention, then the MLP)"
    )
    print(f"weights: {_mb(res['weights_total_bytes'])} in all, {_mb(res['weights_per_rank_bytes'])} per rank")
    for label, c, shape in (
        ("forward", pre, f"batch {args.batch} x seq {args.seq}"),
        ("decode step", dec, f"batch {args.batch} x 1"),
    ):
        print(
            f"{label} ({shape}): {c['allreduces']} all-reduces (2 per layer x {m.num_hidden_layers}) of "
            f"{c['bytes_each'] / 2**20:,.4g} MiB = {c['bytes_total'] / 2**30:,.4g} GiB; "
            f"{_time(c['time_volume_s'])} at {prof.intra.beta / 1e9:g} GB/s (volume/bandwidth), "
            f"{_time(c['time_ring_s'])} as {args.tp}-rank rings (alpha-beta)"
        )


def _fsdp(args):
    if args.params is not None:
        params, name = args.params, f"{args.params:g} parameters"
    else:
        m = ptp.load_model(args.model or "llama2-7b")
        params, name = ptp.params(m), ptp.model_name(args.model or "llama2-7b")
    res = pfsdp.plan(params, args.ranks, args.k)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{name} ({params / 1e9:.2f}B), {args.ranks} ranks, K={args.k} (ZeRO paper Table 1 units: GB = 1e9 B)")
    print(f"{'stage':<7} {'memory/rank':>14} {'volume/step':>12} {'sent/rank/step':>16}")
    for r in res["stages"]:
        print(
            f"{r['stage']:<7} {r['memory_bytes'] / 1e9:>11.2f} GB {r['volume_psi']:>10} Psi "
            f"{_mb(r['sent_per_rank_bytes']):>16}"
        )


def _train_config(name: str):
    """A LlamaConfig from mpitp train's presets, a plan preset, or a config.json."""
    from ..models.config import LlamaConfig
    from ..train.presets import PRESETS, preset_config

    if name in PRESETS:
        return preset_config(name)
    if name in ptp.PRESETS:
        return ptp.PRESETS[name]
    return LlamaConfig.from_path(ptp.config_path(name, [*PRESETS, *ptp.PRESETS]))


def _train(args):
    from ..plan import train as ptrain
    from ..train.layout import llama_units

    cfg = _train_config(args.model)
    name = Path(args.model).name if args.model not in ptp.PRESETS else args.model
    n = args.tp * args.dp
    if args.tp < 1 or args.dp < 1 or n % args.nodes:
        raise ShardingError(f"--tp {args.tp} x --dp {args.dp} = {n} ranks do not fill --nodes {args.nodes} evenly")
    prof = _profile(args)
    if args.tp > cfg.num_key_value_heads:
        raise ShardingError(
            f"--tp {args.tp} exceeds the model's {cfg.num_key_value_heads} KV heads (training cuts by KV head)"
        )
    size = lambda d: ptp.DTYPE_BYTES[d.lower()] if d else None  # noqa: E731
    rows = ptrain.plan(
        cfg, n, args.nodes, args.mode, args.batch, args.seq, ptp.DTYPE_BYTES[args.dtype.lower()], prof,
        param_itemsize=size(args.param_dtype), reduce_itemsize=size(args.reduce_dtype),
    )  # fmt: skip
    psi = sum(u.numel for u in llama_units(cfg))
    if args.json:
        print(
            json.dumps(
                {
                    "model": cfg.to_dict(),
                    "params": psi,
                    "ranks": n,
                    "nodes": args.nodes,
                    "profile": prof.to_dict(),
                    "layouts": rows,
                },
                indent=2,
            )
        )
        return
    print(
        f"{name}: {psi / 1e6:.1f}M parameters, {n} ranks on {args.nodes} node(s), {args.mode}, "
        f"batch {args.batch} x seq {args.seq}, {args.dtype}"
        + (
            f" (gathers {args.param_dtype or args.dtype}, reductions {args.reduce_dtype or args.dtype})"
            if args.param_dtype or args.reduce_dtype
            else ""
        )
        + f", profile {prof.name}"
    )
    print(
        f"  {'layout':<14} {'memory/rank':>12} {'TP bytes/rank':>15} {'DP bytes/rank':>15} "
        f"{'inter-node/node':>16} {'comm time':>11}"
    )
    best = min(r["inter_bytes_per_node"] for r in rows)
    for r in rows:
        mark = "*" if (r["tp"], r["dp"]) == (args.tp, args.dp) else " "
        fewest = "  <- fewest inter-node bytes" if r["inter_bytes_per_node"] == best else ""
        print(
            f"{mark} tp{r['tp']} x {args.mode}{r['dp']:<4} {_mb(r['memory_per_rank_bytes']):>12} "
            f"{_mb(r['tp_bytes_per_rank']):>9} {r['tp_link']:>5} {_mb(r['dp_bytes_per_rank']):>9} {r['dp_link']:>5} "
            f"{_mb(r['inter_bytes_per_node']):>16} {_time(r['comm_time_s']):>11}{fewest}"
        )


def _print_moe(r: dict) -> None:
    w, b, cols = r["other_weights_per_rank_bytes"], r["bytes_per_token"], r["columns_per_rank_tp"]
    turned = " (turned from expert to expert)" if len(set(cols)) > 1 else ""
    print(f"experts over {r['ranks']} rank(s): --moe ep {'/'.join(map(str, r['experts_per_rank_ep']))} whole "
          f"experts a rank, --moe tp {'/'.join(map(str, cols))} columns of each{turned}; auto = "
          f"{r['auto']}; experts {_mb(r['expert_weights_per_rank_bytes'])} a rank (ep), the rest {_mb(w['tp'])} "
          f"(tp attention) or {_mb(w['dp'])} (--dp-attention)\nper token, inter-node / intra-node (all ranks): "
          f"tp attention's all-reduces {_mb(b['tp']['inter'])} / {_mb(b['tp']['intra'])} with the logits gathered "
          f"(sampled rows), {_mb(b['tp_greedy']['inter'])} / {_mb(b['tp_greedy']['intra'])} greedy; --dp-attention's "
          f"all-to-all {_mb(b['dp']['inter'])} / {_mb(b['dp']['intra'])}")  # fmt: skip


def _fit(args):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size < 2:
        raise SystemExit("mpitp plan fit needs 2 ranks: mpiexec -n 2 mpitp plan fit")
    prof = profiles.fit(comm)
    if comm.rank == 0:
        path = profiles.save_local(prof)
        print(json.dumps(prof.to_dict(), indent=2) if args.json else f"{prof.note}\nwritten to {path}")


def _rate(text: str) -> float:
    """Bytes/s from '1gbit', '100mbit', '25GB/s' or a number."""
    import re

    t = text.strip().lower().replace("/s", "").replace("ps", "")
    m = re.fullmatch(r"([\d.]+(?:e[-+]?\d+)?)\s*([kmgt]?)(bit|b)?", t)
    if not m:
        raise SystemExit(f"mpitp plan infer: --link {text!r}: give e.g. 1gbit, 10gbit or 25GB/s")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


def _seconds(text: str) -> float:
    import re

    m = re.fullmatch(r"\s*([\d.]+(?:e[-+]?\d+)?)\s*(us|ms|s|ns)?\s*", text.lower())
    if not m:
        raise SystemExit(f"mpitp plan infer: --latency {text!r}: give e.g. 100us or 2ms")
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


def _infer(args):
    from dataclasses import replace

    from ..plan import infer as pinf

    prof = _profile(args)
    if args.link or args.latency:
        inter = prof.inter
        inter = replace(inter, beta=_rate(args.link)) if args.link else inter
        inter = replace(inter, alpha=_seconds(args.latency)) if args.latency else inter
        prof = replace(prof, name=prof.name + " (inter-node link given)", inter=inter)
    m = ptp.load_model(args.model)
    nodes = args.nodes or args.pp
    res = pinf.plan(m, args.pp, args.tp, nodes, args.batch, args.context, prof, args.weights, args.greedy)
    res["crossover_latency_s"] = pinf.crossover(m, args.pp, args.tp, nodes, args.batch, prof) if args.pp > 1 else None
    if m.num_experts:
        res["moe"] = pinf.moe(m, args.pp * args.tp, nodes, args.batch, args.weights)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"{ptp.model_name(args.model)}: {args.pp} stage(s) x TP={args.tp} on {nodes} node(s) "
        f"({res['ranks_per_node']} rank(s) a node), batch {args.batch}; inter-node "
        f"{prof.inter.beta * 8 / 1e9:g} Gbit/s, {prof.inter.alpha * 1e6:g} us; intra {prof.intra.beta / 1e9:g} GB/s"
    )
    for r in res["stages"]:
        where = "inside a node" if r["tp_inside_node"] else "ACROSS nodes"
        print(
            f"  stage {r['stage']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, ranks {r['ranks'][0]}-"
            f"{r['ranks'][-1]} ({where}), {r['allreduces']} all-reduces a step; weights "
            f"{_mb(r['weights_per_rank_bytes'])} + KV cache {_mb(r['kv_cache_per_rank_bytes'])} per rank"
        )
    for cls in ("intra", "inter"):
        print(
            f"per token, {cls}-node: {res['messages_per_step'][cls]:,} messages, "
            f"{_mb(res['bytes_per_step'][cls])} (all ranks)"
        )
    if args.pp > 1:
        print(
            f"stage boundary: {_mb(res['pp_boundary_bytes_per_rank'])} from each tp rank per step, "
            f"{res['stage_boundaries_across_nodes']} of {args.pp - 1} boundaries across nodes"
        )
    print(f"communication per step (one stream, stages in turn): {_time(res['comm_time_s'])}")
    if "moe" in res:
        _print_moe(res["moe"])
    x = res["crossover_latency_s"]
    if args.pp > 1:
        print(
            "pipeline stages beat TP over all ranks on these nodes when the inter-node latency exceeds "
            + (_time(x) if x is not None else "- (never: TP sends no more messages)")
        )
